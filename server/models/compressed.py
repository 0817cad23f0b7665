"""Put an artifact's modules into a model (LowRankLinear, or a narrower Linear when pruned) and read them back out."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from server.errors import ConfigError
from server.models.artifact import Manifest, check_model_hash, factor_keys, load_artifact, weight_key
from server.models.lowrank import LowRankLinear
from server.models.module_init import no_init

log = logging.getLogger(__name__)


def _replace(model: nn.Module, target: str, new: nn.Module) -> None:
    parent, _, child = target.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _existing_linear(model: nn.Module, target: str, name: str) -> nn.Linear:
    try:
        old = model.get_submodule(target)
    except AttributeError:
        raise ConfigError(f"compressed artifact: module {target} does not exist in the model") from None
    if not isinstance(old, nn.Linear):
        raise ConfigError(f"compressed artifact: {name} replaces {type(old).__name__}, not a Linear")
    return old


def linear_with(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A Linear holding copies of `weight` [out, in] (and `bias`), in their dtype and device, frozen."""
    out_f, in_f = weight.shape
    with no_init():
        lin = nn.Linear(in_f, out_f, bias=bias is not None, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin.requires_grad_(False)


def _pruned_linear(old: nn.Linear, weight: torch.Tensor, name: str) -> nn.Linear:
    """A Linear holding the pruned weight (in the old one's dtype and device), with the old bias."""
    if old.bias is not None and weight.shape[0] != old.out_features:
        raise ConfigError(f"compressed artifact: {name} prunes the outputs of a Linear with a bias (unsupported)")
    return linear_with(weight.to(old.weight.device, old.weight.dtype), old.bias).requires_grad_(
        old.weight.requires_grad)


def _check_mlp_widths(model: nn.Module, targets: list[str]) -> None:
    """Every MLP with a pruned projection must still chain: gate and up out = down in."""
    for parent in sorted({t.rpartition(".")[0] for t in targets}):
        mlp = model.get_submodule(parent) if parent else model
        gate, up, down = (getattr(mlp, f"{p}_proj", None) for p in ("gate", "up", "down"))
        widths = {getattr(gate, "out_features", None), getattr(up, "out_features", None),
                  getattr(down, "in_features", None)}
        if len(widths) != 1:
            raise ConfigError(f"compressed artifact: {parent} gate/up/down disagree on the intermediate width "
                              f"after pruning ({sorted(w for w in widths if w is not None)})")


def swap_in_artifact(model: nn.Module, manifest: Manifest, tensors: dict[str, torch.Tensor],
                     name_map: Callable[[str], str] = lambda name: name) -> list[str]:
    """Replace the artifact's modules (HF names mapped by name_map): a LowRankLinear for each low-rank one, a
    narrower Linear for each pruned one; returns the HF names replaced (manifest order)."""
    for name in manifest.low_rank_modules():
        target = name_map(name)
        old = _existing_linear(model, target, name)
        A, B = (tensors[key] for key in factor_keys(name))
        if (old.in_features, old.out_features) != (A.shape[1], B.shape[0]):
            raise ConfigError(f"compressed artifact: {name} factors {tuple(A.shape)}x{tuple(B.shape)} do not "
                              f"fit the model's {old}")
        dtype, device = old.weight.dtype, old.weight.device
        bias = None if old.bias is None else old.bias.detach().clone()
        _replace(model, target, LowRankLinear(A.to(device, dtype), B.to(device, dtype), bias))
    pruned = [name_map(name) for name in manifest.pruned_modules()]
    for name, target in zip(manifest.pruned_modules(), pruned):
        old = _existing_linear(model, target, name)
        info = manifest.modules[name]
        if (old.in_features, old.out_features) != (info.in_features, info.out_features):
            raise ConfigError(f"compressed artifact: {name} was pruned from a ({info.out_features}, "
                              f"{info.in_features}) weight, but the model's is {tuple(old.weight.shape)}")
        _replace(model, target, _pruned_linear(old, tensors[weight_key(name)], name))
    _check_mlp_widths(model, pruned)
    return manifest.replaced_modules()


def artifact_tensors(model: nn.Module, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The artifact's tensors read back from the model: factors of its LowRankLinear modules and the weights of its
    pruned ones (contiguous, on CPU), under the artifact's keys."""
    out = {}
    for name in manifest.low_rank_modules():
        mod = model.get_submodule(name)
        if not isinstance(mod, LowRankLinear):
            raise TypeError(f"{name} is {type(mod).__name__}, not LowRankLinear")
        a_key, b_key = factor_keys(name)
        out[a_key], out[b_key] = mod.A.detach().cpu().contiguous(), mod.B.detach().cpu().contiguous()
    for name in manifest.pruned_modules():
        mod = model.get_submodule(name)
        if not isinstance(mod, nn.Linear) or tuple(mod.weight.shape) != manifest.modules[name].pruned_shape:
            raise TypeError(f"{name} is {mod}, not the pruned Linear of shape {manifest.modules[name].pruned_shape}")
        out[weight_key(name)] = mod.weight.detach().cpu().contiguous()
    return out


def apply_compressed_artifact(model: nn.Module, artifact_dir: Path, model_dir: Path) -> int:
    """Replace the artifact's Linears in the serving LlamaModel (before fusing); returns how many.

    The serving model's module names lack HF's `model.` prefix (`layers.3.mlp.down_proj`).
    """
    artifact_dir = Path(artifact_dir).expanduser()
    manifest, tensors = load_artifact(artifact_dir)
    check_model_hash(manifest, Path(model_dir), f"model.compressed {artifact_dir}")
    count = len(swap_in_artifact(model, manifest, tensors, name_map=lambda name: name.removeprefix("model.")))
    log.info("model.compressed %s: %d modules replaced (%s, keep_ratio %s)", artifact_dir, count,
             manifest.method, manifest.keep_ratio)
    return count


def apply_artifact_to_hf(model: nn.Module, artifact_dir: Path, model_dir: Path | None = None) -> Manifest:
    """Swap the artifact's modules into a transformers Llama-family causal LM in place; returns the manifest.

    The model hash is checked against model_dir (default: the folder the model was loaded from).
    """
    manifest, tensors = load_artifact(artifact_dir)
    source = model_dir or getattr(getattr(model, "config", None), "_name_or_path", None)
    if source and Path(source).is_dir():
        check_model_hash(manifest, Path(source), f"compressed artifact {artifact_dir}")
    else:
        log.warning("compressed artifact %s: model folder unknown, weights hash not checked", artifact_dir)
    count = len(swap_in_artifact(model, manifest, tensors))
    log.info("compressed artifact %s: %d modules replaced (%s, keep_ratio %s)", artifact_dir, count,
             manifest.method, manifest.keep_ratio)
    return manifest
