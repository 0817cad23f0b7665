"""The compressed-artifact format and its only load and save: a folder of manifest.json + factors.safetensors.

Factor keys are `<HF module name>.A` [rank, in] and `<HF module name>.B` [out, rank], fp32, e.g.
`model.layers.3.mlp.down_proj.A`; so y = (x Aᵀ) Bᵀ (LowRankLinear's layout). A structurally pruned module
(`neuronmm compress --method prune`) is stored whole as `<HF module name>.weight` [out', in'], narrower than
the dense one along the MLP's intermediate dimension (its record's `pruned_shape`). The manifest is a typed
`Manifest`; a folder is written beside its target and renamed into place (server.fileio.atomic_dir).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError

from server.errors import ConfigError, first_error
from server.fileio import atomic_dir, check_out_dir, files_sha256

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FACTORS = "factors.safetensors"
_HASH_CACHE: dict[tuple, str] = {}


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())


class ModuleRecord(_Record):
    """One Linear of the source model (`in`/`out`: its dense shape): replaced by rank-`rank` factors, by a
    narrower weight of `pruned_shape` [out, in] (structured pruning), or kept dense (with the reason)."""

    in_features: int = Field(alias="in")
    out_features: int = Field(alias="out")
    rank: int | None = None
    pruned_shape: tuple[int, int] | None = None
    rel_error: float | None = None  # at compression, on its calibration tokens (recovery does not update it)
    dense: bool = False
    reason: str | None = None

    @property
    def low_rank(self) -> bool:
        """Replaced by two factors (not kept dense, not pruned)."""
        return not self.dense and self.pruned_shape is None


class SourceRecord(_Record):
    """The dense weights the factors were made from (sha256 over the folder's *.safetensors)."""

    model_id: str | None = None
    model_dir_name: str | None = None
    sha256: str | None = None


class CalibrationRecord(_Record):
    """The calibration run: data file and hash, windows, seed, and which documents (line order) it read."""

    data: str
    sha256: str
    samples: int
    seqlen: int
    seed: int
    statistics: str | None = None
    sequential: bool | None = None
    document_ids: list[int] | None = None  # indices of the non-blank lines of `data`; absent in older artifacts
    excluded_documents: int | None = None  # left out of the draw (the C4 evaluation split); absent before 2026-12-01


class ParameterCounts(_Record):
    """Parameters of the whole model and of its MLPs, before and after compression."""

    model_before: int
    model_after: int
    mlp_before: int
    mlp_after: int
    model_ratio: float
    mlp_ratio: float


class Manifest(_Record):
    """manifest.json: what was replaced (modules), from what (source, calibration) and how (the rest)."""

    format_version: int
    modules: dict[str, ModuleRecord]
    source: SourceRecord | None = None
    method: str | None = None
    keep_ratio: float | None = None
    rank_multiple: int | None = None
    targets: str | None = None
    allocation: dict[str, Any] | None = None
    calibration: CalibrationRecord | None = None
    seed: int | None = None
    tool_version: str | None = None
    settings: dict[str, Any] | None = None
    parameters: ParameterCounts | None = None
    params_before: int | None = None
    params_after: int | None = None
    damping: dict[str, Any] | None = None
    refit: dict[str, Any] | None = None  # least-squares refit of the factors (absent in older artifacts)
    compress_wall_s: float | None = None
    recovery: dict[str, Any] | None = None

    def low_rank_modules(self) -> list[str]:
        """HF module names the artifact replaces by factors (dense-kept and pruned ones excluded)."""
        return [name for name, info in self.modules.items() if info.low_rank]

    def pruned_modules(self) -> list[str]:
        """HF module names the artifact replaces by a narrower weight (structured pruning)."""
        return [name for name, info in self.modules.items() if info.pruned_shape is not None]

    def replaced_modules(self) -> list[str]:
        """Every module the artifact carries tensors for: low-rank and pruned, in manifest order."""
        return [name for name, info in self.modules.items() if not info.dense]

    def to_dict(self) -> dict:
        """The JSON form: the keys that were set, with the file's names (`in`, `out`)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


def factor_keys(module: str) -> tuple[str, str]:
    """The two tensor keys of one module's factors: (`<module>.A` [rank, in], `<module>.B` [out, rank])."""
    return f"{module}.A", f"{module}.B"


def weight_key(module: str) -> str:
    """The tensor key of a pruned module's weight: `<module>.weight` [out', in']."""
    return f"{module}.weight"


def parse_manifest(data: Any, where: Path) -> Manifest:
    """A Manifest from manifest.json's parsed JSON; a wrong version or shape is a ConfigError naming the key."""
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise ConfigError(f"compressed artifact {where}: format_version {version!r}, expected {FORMAT_VERSION}")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"compressed artifact {where}: manifest {first_error(exc)}") from None


def read_manifest(artifact_dir: Path) -> Manifest:
    """The artifact's manifest alone (no factors read); a missing or bad one is a one-line ConfigError."""
    artifact_dir = Path(artifact_dir).expanduser()
    manifest_path, factors_path = artifact_dir / MANIFEST, artifact_dir / FACTORS
    if not manifest_path.is_file() or not factors_path.is_file():
        raise ConfigError(f"compressed artifact {artifact_dir}: not a compressed artifact (needs {MANIFEST} "
                          f"and {FACTORS})")
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"compressed artifact {manifest_path}: not valid JSON ({exc})") from None
    return parse_manifest(data, artifact_dir)


def load_artifact(artifact_dir: Path) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """(manifest, factor tensors); a missing, corrupt or inconsistent artifact is a one-line ConfigError."""
    # torch is imported here and in save_artifact, not at the top: `neuronmm serve` reads a manifest before it
    # spawns the engine core, and that check should not wait for torch's import
    from safetensors.torch import load_file

    artifact_dir = Path(artifact_dir).expanduser()
    manifest = read_manifest(artifact_dir)
    try:
        tensors = load_file(str(artifact_dir / FACTORS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"compressed artifact {artifact_dir / FACTORS}: unreadable ({exc})") from None
    _check_consistent(artifact_dir, manifest, tensors)
    return manifest, tensors


def _check_consistent(artifact_dir: Path, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
    for name in manifest.pruned_modules():
        info, weight = manifest.modules[name], tensors.get(weight_key(name))
        out_f, in_f = info.pruned_shape
        if info.dense or not (0 < out_f <= info.out_features and 0 < in_f <= info.in_features):
            raise ConfigError(f"compressed artifact {artifact_dir}: {name} pruned_shape {info.pruned_shape} does not "
                              f"fit inside its dense shape ({info.out_features}, {info.in_features})")
        if weight is None or tuple(weight.shape) != (out_f, in_f):
            found = "missing" if weight is None else tuple(weight.shape)
            raise ConfigError(f"compressed artifact {artifact_dir}: {name} weight {found} does not match the "
                              f"manifest's pruned_shape {(out_f, in_f)}")
    for name in manifest.low_rank_modules():
        info = manifest.modules[name]
        A, B = (tensors.get(key) for key in factor_keys(name))
        if A is None or B is None:
            raise ConfigError(f"compressed artifact {artifact_dir}: {name} lacks its A or B factor")
        want_a, want_b = (info.rank, info.in_features), (info.out_features, info.rank)
        if tuple(A.shape) != want_a or tuple(B.shape) != want_b:
            raise ConfigError(f"compressed artifact {artifact_dir}: {name} factors {tuple(A.shape)}x"
                              f"{tuple(B.shape)} do not match the manifest ({want_a}x{want_b})")
    extra = {k.rsplit(".", 1)[0] for k in tensors} - set(manifest.modules)
    if extra:
        raise ConfigError(f"compressed artifact {artifact_dir}: factors for modules not in the manifest "
                          f"({sorted(extra)[:3]})")


def is_artifact(path: Path) -> bool:
    """Whether a folder holds an artifact (its manifest): one an output path may replace."""
    return (Path(path) / MANIFEST).is_file()


def check_artifact_out(path: Path, what: str = "--out") -> Path:
    """An artifact's output folder, checked before the work that fills it (server.fileio.check_out_dir): it may
    replace an earlier artifact or an empty folder, nothing else."""
    return check_out_dir(path, what, is_artifact)


def save_artifact(out_dir: Path, manifest: Manifest, tensors: dict[str, torch.Tensor],
                  carry: tuple[Path, ...] = ()) -> Path:
    """Write manifest + fp32 tensors (+ copies of the `carry` files) into a temp folder, then swap it in.

    An exception or kill before the rename leaves out_dir as it was (absent or the old artifact); an
    in-place rewrite (carry from out_dir itself) swaps by two renames, never exposing half an artifact.
    """
    import torch
    from safetensors.torch import save_file

    check_artifact_out(out_dir, "artifact")  # (the commands check first; this keeps any other caller from a loss)
    with atomic_dir(out_dir) as tmp:
        for path in carry:
            shutil.copy2(path, tmp / Path(path).name)
        save_file({k: v.detach().to(torch.float32).cpu().contiguous() for k, v in tensors.items()},
                  str(tmp / FACTORS), metadata={"format_version": str(FORMAT_VERSION)})
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n", encoding="utf-8")
    return Path(out_dir).expanduser().resolve()


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the model folder's *.safetensors files (names and bytes, sorted); cached per process."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model: no .safetensors files in {model_dir}")
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _HASH_CACHE:
        _HASH_CACHE[key] = files_sha256(files)
    return _HASH_CACHE[key]


def check_model_hash(manifest: Manifest, model_dir: Path, where: str) -> None:
    """ConfigError when the artifact was made from other weights than those in model_dir."""
    want = manifest.source.sha256 if manifest.source else None
    got = weights_sha256(model_dir)
    if want != got:
        raise ConfigError(f"{where}: artifact was made from weights sha256 {str(want)[:12]}…, "
                          f"but {model_dir} has {got[:12]}… (wrong model for this artifact)")
