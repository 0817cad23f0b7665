"""Put an artifact's factors into a model (LowRankLinear in place of nn.Linear) and read them back out."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from server.errors import ConfigError
from server.models.artifact import Manifest, check_model_hash, factor_keys, load_artifact
from server.models.lowrank import LowRankLinear

log = logging.getLogger(__name__)


def swap_in_factors(model: nn.Module, manifest: Manifest, tensors: dict[str, torch.Tensor],
                    name_map: Callable[[str], str] = lambda name: name) -> list[str]:
    """Replace each low-rank module (HF name mapped by name_map) by a LowRankLinear; returns the HF names."""
    names = manifest.low_rank_modules()
    for name in names:
        target = name_map(name)
        try:
            old = model.get_submodule(target)
        except AttributeError:
            raise ConfigError(f"compressed artifact: module {target} does not exist in the model") from None
        A, B = (tensors[key] for key in factor_keys(name))
        if not isinstance(old, nn.Linear) or (old.in_features, old.out_features) != (A.shape[1], B.shape[0]):
            raise ConfigError(f"compressed artifact: {name} factors {tuple(A.shape)}x{tuple(B.shape)} do not "
                              f"fit the model's {old}")
        dtype, device = old.weight.dtype, old.weight.device
        bias = None if old.bias is None else old.bias.detach().clone()
        new = LowRankLinear(A.to(device, dtype), B.to(device, dtype), bias)
        parent, _, child = target.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return names


def factor_tensors(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The `<name>.A`/`<name>.B` tensors of the model's LowRankLinear modules (contiguous, on CPU)."""
    out = {}
    for name in names:
        mod = model.get_submodule(name)
        if not isinstance(mod, LowRankLinear):
            raise TypeError(f"{name} is {type(mod).__name__}, not LowRankLinear")
        a_key, b_key = factor_keys(name)
        out[a_key], out[b_key] = mod.A.detach().cpu().contiguous(), mod.B.detach().cpu().contiguous()
    return out


def apply_compressed_artifact(model: nn.Module, artifact_dir: Path, model_dir: Path) -> int:
    """Replace the artifact's Linears in the serving LlamaModel (before fusing); returns how many.

    The serving model's module names lack HF's `model.` prefix (`layers.3.mlp.down_proj`).
    """
    artifact_dir = Path(artifact_dir).expanduser()
    manifest, tensors = load_artifact(artifact_dir)
    check_model_hash(manifest, Path(model_dir), f"model.compressed {artifact_dir}")
    count = len(swap_in_factors(model, manifest, tensors, name_map=lambda name: name.removeprefix("model.")))
    log.info("model.compressed %s: %d modules low-rank (%s, keep_ratio %s)", artifact_dir, count,
             manifest.method, manifest.keep_ratio)
    return count


def apply_artifact_to_hf(model: nn.Module, artifact_dir: Path, model_dir: Path | None = None) -> Manifest:
    """Swap LowRankLinear into a transformers LlamaForCausalLM in place; returns the manifest.

    The model hash is checked against model_dir (default: the folder the model was loaded from).
    """
    manifest, tensors = load_artifact(artifact_dir)
    source = model_dir or getattr(getattr(model, "config", None), "_name_or_path", None)
    if source and Path(source).is_dir():
        check_model_hash(manifest, Path(source), f"compressed artifact {artifact_dir}")
    else:
        log.warning("compressed artifact %s: model folder unknown, weights hash not checked", artifact_dir)
    count = len(swap_in_factors(model, manifest, tensors))
    log.info("compressed artifact %s: %d modules low-rank (%s, keep_ratio %s)", artifact_dir, count,
             manifest.method, manifest.keep_ratio)
    return manifest
