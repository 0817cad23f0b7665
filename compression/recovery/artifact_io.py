"""Thin layer over the compressed-artifact format (manifest.json + factors.safetensors).

Keys: `model.layers.{i}.mlp.{gate,up,down}_proj.{A,B}`, A [rank, in], B [out, rank]. Only the
pieces recovery needs: read factors, swap them into a HF model, write an updated artifact atomically.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from compression.artifacts import FACTORS, MANIFEST, swap_in_dir
from server.errors import ConfigError
from server.models.lowrank import LowRankLinear



def read_artifact(artifact_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, factor tensors) of an artifact directory; a missing/bad one is a one-line ConfigError.

    Uses compression.artifacts.load_artifact (format + shape checks) for artifacts that carry a
    `modules` table; minimal hand-made artifacts (tests) are read directly.
    """
    manifest_path, factors_path = artifact_dir / MANIFEST, artifact_dir / FACTORS
    if not manifest_path.is_file() or not factors_path.is_file():
        raise ConfigError(f"{artifact_dir}: not a compressed artifact (needs {MANIFEST} and {FACTORS})")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{manifest_path}: not valid JSON ({exc.msg})") from None
    if isinstance(manifest, dict) and "modules" in manifest:
        from compression.artifacts import load_artifact

        return load_artifact(artifact_dir)
    return manifest, load_file(str(factors_path))


def check_source(manifest: dict, model_dir: Path, artifact_dir: Path) -> None:
    """ConfigError when the manifest names source weights other than model_dir's (skipped if it names none)."""
    if isinstance(manifest.get("source"), dict) and manifest["source"].get("sha256"):
        from compression.artifacts import check_model_hash

        check_model_hash(manifest, model_dir, f"recover {artifact_dir}")


def install_factors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Replace each Linear named by a `<name>.A`/`<name>.B` pair with a LowRankLinear; returns the names."""
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    for name in names:
        if f"{name}.A" not in tensors or f"{name}.B" not in tensors:
            raise ConfigError(f"artifact: {name} lacks its A or B factor")
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ConfigError(f"artifact: module {name} does not exist in the model") from None
        A, B = tensors[f"{name}.A"], tensors[f"{name}.B"]
        if (A.shape[1], B.shape[0]) != (old.in_features, old.out_features):
            raise ConfigError(f"artifact: {name} factors {tuple(A.shape)}x{tuple(B.shape)} do not match "
                              f"the model's {old.out_features}x{old.in_features}")
        dtype = old.weight.dtype if hasattr(old, "weight") else A.dtype
        bias = getattr(old, "bias", None)
        new = LowRankLinear(A.to(dtype), B.to(dtype), None if bias is None else bias.detach().clone())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new.to(old.weight.device))
    return names


def factor_tensors(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The `<name>.A`/`<name>.B` tensors of the model's LowRankLinear modules (contiguous, on CPU)."""
    out = {}
    for name in names:
        mod = model.get_submodule(name)
        if not isinstance(mod, LowRankLinear):
            raise TypeError(f"{name} is {type(mod).__name__}, not LowRankLinear")
        out[f"{name}.A"] = mod.A.detach().cpu().contiguous()
        out[f"{name}.B"] = mod.B.detach().cpu().contiguous()
    return out


def write_artifact(src_dir: Path, out_dir: Path, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write src_dir's other files + new manifest/factors to a temp dir beside out_dir, then swap it in.

    In-place (out_dir == src_dir) swaps by two renames, so at every instant out_dir is the old or the
    new artifact, never a half-written one.
    """
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.recovering-", dir=out_dir.parent))
    try:
        for item in src_dir.iterdir():
            if item.name not in (MANIFEST, FACTORS) and item.is_file() and not item.name.startswith("recovery-"):
                shutil.copy2(item, tmp / item.name)
        save_file(tensors, str(tmp / FACTORS))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        swap_in_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
