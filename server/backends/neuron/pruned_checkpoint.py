"""A structurally pruned artifact as a plain Llama checkpoint that transformers-neuronx can compile.

tnx builds every decoder layer from one config, so all layers share one intermediate size. Each pruned layer's
gate/up/down is zero-padded to the widest layer's width (rounded up to 128 · tp_degree, the tile times the cores
the intermediate dimension is split over) and written with `intermediate_size` set to that width. The padding is
exact: a zero row of gate and up gives SiLU(0)·0 = 0 in that channel, and the zero column of down adds nothing.
No patch of tnx is needed, so the checkpoint runs on tnx's own dense MLP path. The speed-up on trn1 is
intermediate / width (none when some layer keeps every channel); per-layer widths need the low-rank kernel path.
Not run on a Neuron device here: the checkpoint is checked offline against the artifact applied to the HF model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from server.errors import ConfigError
from server.fileio import atomic_dir, files_sha256
from server.models.artifact import FACTORS, MANIFEST, Manifest, check_model_hash, load_artifact, weight_key
from server.models.loader import load_state_dict

log = logging.getLogger(__name__)

TILE = 128
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def layer_widths(manifest: Manifest, num_layers: int, intermediate: int) -> list[int]:
    """Each layer's kept intermediate width (the dense one where the artifact leaves the layer alone)."""
    widths = [intermediate] * num_layers
    for name in manifest.pruned_modules():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or parts[-1] not in PROJECTIONS or parts[-2] != "mlp":
            raise ConfigError(f"model.compressed: pruned module {name} is not a Llama MLP projection")
        out_f, in_f = manifest.modules[name].pruned_shape
        widths[int(parts[2])] = in_f if parts[-1] == "down_proj" else out_f
    return widths


def padded_width(widths: list[int], tp_degree: int) -> int:
    """The one width every layer is padded to: the widest layer, rounded up to TILE · tp_degree."""
    return _round_up(max(widths), TILE * tp_degree)


def pad_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate/up [w, hidden] and down [hidden, w] zero-padded to `width` channels (exact, see the module docstring)."""
    w = gate.shape[0]
    if width < w or up.shape[0] != w or down.shape[1] != w:
        raise ValueError(f"cannot pad widths {gate.shape[0]}/{up.shape[0]}/{down.shape[1]} to {width}")
    pad_rows = lambda t: torch.cat([t, t.new_zeros(width - w, t.shape[1])])  # noqa: E731
    return pad_rows(gate), pad_rows(up), torch.cat([down, down.new_zeros(down.shape[0], width - w)], dim=1)


def pruned_state_dict(model_dir: Path, manifest: Manifest, tensors: dict[str, torch.Tensor], width: int,
                      num_layers: int) -> dict[str, torch.Tensor]:
    """The source checkpoint with every layer's MLP replaced by the artifact's (padded to `width`), source dtype."""
    state = load_state_dict(model_dir)
    pruned = set(manifest.pruned_modules())
    for i in range(num_layers):
        names = [f"model.layers.{i}.mlp.{p}" for p in PROJECTIONS]
        mats = [tensors[weight_key(n)] if n in pruned else state[f"{n}.weight"] for n in names]
        dtype = state[f"{names[0]}.weight"].dtype
        for name, mat in zip(names, pad_mlp(*mats, width)):
            state[f"{name}.weight"] = mat.to(dtype).contiguous()
    return state


def write_pruned_checkpoint(model_dir: Path, artifact_dir: Path, cache_dir: Path, tp_degree: int) -> Path:
    """The folder (under cache_dir, reused when it exists) holding the padded checkpoint for tnx; returns it."""
    model_dir, artifact_dir = Path(model_dir), Path(artifact_dir).expanduser()
    manifest, tensors = load_artifact(artifact_dir)
    if not manifest.pruned_modules():
        raise ConfigError(f"model.compressed: {artifact_dir} has no pruned modules")
    check_model_hash(manifest, model_dir, f"model.compressed {artifact_dir}")
    config = json.loads((model_dir / "config.json").read_text())
    num_layers, intermediate = int(config["num_hidden_layers"]), int(config["intermediate_size"])
    widths = layer_widths(manifest, num_layers, intermediate)
    width = padded_width(widths, tp_degree)
    key = files_sha256([artifact_dir / MANIFEST, artifact_dir / FACTORS])[:16]
    out = Path(cache_dir) / f"pruned-{key}-w{width}"
    if (out / "config.json").is_file():
        return out
    state = pruned_state_dict(model_dir, manifest, tensors, width, num_layers)
    with atomic_dir(out) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({**config, "intermediate_size": width}, indent=2) + "\n")
        for name in _SIDE_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
    log.info("model.compressed %s: pruned checkpoint for tnx at %s (layer widths %d..%d, padded to %d of %d)",
             artifact_dir, out, min(widths), max(widths), width, intermediate)
    return out
