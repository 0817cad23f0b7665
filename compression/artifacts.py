"""Compressed artifacts: a directory of manifest.json + factors.safetensors, written atomically.

Factor keys are `<HF module name>.A` [rank, in] and `<HF module name>.B` [out, rank], fp32, e.g.
`model.layers.3.mlp.down_proj.A`; so y = (x Aᵀ) Bᵀ (LowRankLinear's layout).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from server.errors import ConfigError
from server.models.lowrank import LowRankLinear

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FACTORS = "factors.safetensors"
_HASH_CACHE: dict[tuple, str] = {}


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the model folder's *.safetensors files (names and bytes, sorted); cached per process."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model: no .safetensors files in {model_dir}")
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _HASH_CACHE:
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode())
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(chunk)
        _HASH_CACHE[key] = digest.hexdigest()
    return _HASH_CACHE[key]


def file_sha256(path: Path) -> str:
    """sha256 of one file (the calibration data)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def swap_in_dir(tmp: Path, out_dir: Path) -> None:
    """Rename the finished dir tmp to out_dir (same parent); an existing out_dir stays whole until then."""
    if out_dir.exists():
        # Two renames: the old artifact stays whole until the new one is complete beside it.
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / "a")
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


def write_artifact(out_dir: Path, manifest: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write manifest + factors into a temp dir beside out_dir, then rename it over out_dir.

    An exception or kill before the rename leaves out_dir as it was (absent or the old artifact).
    """
    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file({k: v.detach().to(torch.float32).cpu().contiguous() for k, v in tensors.items()},
                  str(tmp / FACTORS), metadata={"format_version": str(FORMAT_VERSION)})
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        swap_in_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_artifact(artifact_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors); a missing, corrupt or inconsistent artifact is a one-line ConfigError."""
    artifact_dir = Path(artifact_dir).expanduser()
    manifest_path, factors_path = artifact_dir / MANIFEST, artifact_dir / FACTORS
    if not manifest_path.is_file() or not factors_path.is_file():
        raise ConfigError(f"compressed artifact {artifact_dir}: needs {MANIFEST} and {FACTORS}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"compressed artifact {manifest_path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"compressed artifact {artifact_dir}: format_version "
                          f"{manifest.get('format_version') if isinstance(manifest, dict) else None!r}, "
                          f"expected {FORMAT_VERSION}")
    try:
        tensors = load_file(str(factors_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"compressed artifact {factors_path}: unreadable ({exc})") from None
    _check_consistent(artifact_dir, manifest, tensors)
    return manifest, tensors


def _check_consistent(artifact_dir: Path, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
    modules = manifest.get("modules")
    if not isinstance(modules, dict):
        raise ConfigError(f"compressed artifact {artifact_dir}: manifest has no `modules` table")
    for name, info in modules.items():
        if info.get("dense"):
            continue
        A, B = tensors.get(f"{name}.A"), tensors.get(f"{name}.B")
        if A is None or B is None:
            raise ConfigError(f"compressed artifact {artifact_dir}: {name} lacks its A or B factor")
        want_a, want_b = (info["rank"], info["in"]), (info["out"], info["rank"])
        if tuple(A.shape) != want_a or tuple(B.shape) != want_b:
            raise ConfigError(f"compressed artifact {artifact_dir}: {name} factors {tuple(A.shape)}x"
                              f"{tuple(B.shape)} do not match the manifest ({want_a}x{want_b})")
    extra = {k.rsplit(".", 1)[0] for k in tensors} - set(modules)
    if extra:
        raise ConfigError(f"compressed artifact {artifact_dir}: factors for modules not in the manifest "
                          f"({sorted(extra)[:3]})")


def check_model_hash(manifest: dict, model_dir: Path, where: str) -> None:
    """ConfigError when the artifact was made from other weights than those in model_dir."""
    want = manifest.get("source", {}).get("sha256")
    got = weights_sha256(model_dir)
    if want != got:
        raise ConfigError(f"{where}: artifact was made from weights sha256 {str(want)[:12]}…, "
                          f"but {model_dir} has {got[:12]}… (wrong model for this artifact)")


def low_rank_modules(manifest: dict) -> list[str]:
    """HF module names the artifact replaces by low-rank factors (dense-kept ones excluded)."""
    return [name for name, info in manifest["modules"].items() if not info.get("dense")]


def swap_in_factors(model: nn.Module, manifest: dict, tensors: dict[str, torch.Tensor],
                    name_map=lambda name: name) -> int:
    """Replace each low-rank module (HF name mapped by name_map) by a LowRankLinear; returns how many."""
    count = 0
    for name in low_rank_modules(manifest):
        target = name_map(name)
        try:
            old = model.get_submodule(target)
        except AttributeError:
            raise ConfigError(f"compressed artifact: module {target} does not exist in the model") from None
        A, B = tensors[f"{name}.A"], tensors[f"{name}.B"]
        if not isinstance(old, nn.Linear) or (old.in_features, old.out_features) != (A.shape[1], B.shape[0]):
            raise ConfigError(f"compressed artifact: {name} factors {tuple(A.shape)}x{tuple(B.shape)} do not "
                              f"fit the model's {old}")
        dtype, device = old.weight.dtype, old.weight.device
        bias = None if old.bias is None else old.bias.detach().clone()
        new = LowRankLinear(A.to(device, dtype), B.to(device, dtype), bias)
        parent, _, child = target.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        count += 1
    return count


def apply_artifact_to_hf(model: nn.Module, artifact_dir: Path, model_dir: Path | None = None) -> dict:
    """Swap LowRankLinear into a transformers LlamaForCausalLM in place; returns the manifest.

    The model hash is checked against model_dir (default: the folder the model was loaded from).
    """
    manifest, tensors = load_artifact(artifact_dir)
    source = model_dir or getattr(getattr(model, "config", None), "_name_or_path", None)
    if source and Path(source).is_dir():
        check_model_hash(manifest, Path(source), f"compressed artifact {artifact_dir}")
    else:
        log.warning("compressed artifact %s: model folder unknown, weights hash not checked", artifact_dir)
    count = swap_in_factors(model, manifest, tensors)
    log.info("compressed artifact %s: %d modules low-rank (%s, keep_ratio %s)", artifact_dir, count,
             manifest.get("method"), manifest.get("keep_ratio"))
    return manifest
