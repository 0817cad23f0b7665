"""Layer-by-layer driver: calibrate, whiten, truncate, swap in factors, feed the next layer compressed activations."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn
from tqdm import tqdm

from compression import latency
from compression.allocation import Spectrum, allocate, allocate_exact, truncation_loss
from compression.calibration import Calibration, calibration_windows, compression_calibration, evaluation_documents
from compression.measured import allocate_measured
from compression.rank import block_rank, saves_parameters
from compression.sensitivity import dense_mlp_spectra, output_fisher
from compression.refit import dense_output_rel_error, refit_b
from compression.statistics import (MLP, batched_gram, capture_layer0_inputs, cross_gram, gram, input_grams,
                                    mlp_inputs, mlp_intermediate, single_threaded_lapack)
from compression.whiten import activation_rel_error, damped_cholesky, plain_factors, whitened_factors
from server.config import CompressionConfig, data_path
from server.errors import ConfigError
from server.fileio import check_out_file, file_sha256, write_json_atomic
from server.models.artifact import (FORMAT_VERSION, CalibrationRecord, Manifest, ModuleRecord, ParameterCounts,
                                    SourceRecord, factor_keys, save_artifact, weights_sha256)
from server.models.lowrank import LowRankLinear

log = logging.getLogger(__name__)

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


class CompressSettings(CompressionConfig):
    """Everything that decides the factors (recorded in the manifest): the config's compression block plus
    the knobs the server's config schema does not carry (allocation, refit) and two of the calibration passes.

    Defaults are the setting measured best at keep 0.8 on SmolLM2-135M (docs/BENCHMARKS.md, issue 18 ablation):
    greedy sensitivity allocation, no refit; exact allocation and refit each raised WikiText-2 perplexity there."""

    allocation: Literal["exact", "measured", "sensitivity", "uniform"] = "sensitivity"
    # SVD: least-squares refit of each B factor against the dense layer's outputs (opt-in); prune: of down_proj on
    # the kept channels (on by default). None: the method's default.
    refit: bool | None = None
    refit_damp: float = Field(1e-2, ge=0)  # ridge toward the SVD's B, relative to the mean diagonal of the Gram
    fisher_windows: int = Field(16, ge=1)  # calibration windows the Fisher estimate back-propagates
    batch_size: int = Field(8, ge=1)  # windows per forward pass of the calibration passes
    # --allocation measured: held-out scoring windows (the calibration file's next documents in the seeded order,
    # none of the calibration's nor of the C4 evaluation split), the scoring precision and the re-scoring rounds
    score_windows: int = Field(8, ge=1)
    score_seqlen: int = Field(256, ge=16)
    score_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    measured_rounds: int = Field(1, ge=0)
    # --method prune: the order channels leave a layer in (compression/prune.py): obs (Optimal Brain Surgeon with
    # down_proj compensated) or energy (E[h²]·‖down column‖²)
    prune_order: Literal["obs", "energy"] = "obs"

    @model_validator(mode="after")
    def _method_defaults(self) -> "CompressSettings":
        if self.refit is None:
            self.refit = self.method == "prune"
        return self


def tool_version() -> str:
    """The installed neuronmm version (recorded in manifests)."""
    try:
        from importlib.metadata import version

        return version("neuronmm")
    except Exception:  # not installed as a distribution (e.g. run from a checkout)
        return "0+unknown"


def calibration_batch_size(num_samples: int, wanted: int) -> int:
    """Windows per calibration forward: a divisor of num_samples (at most `wanted`)."""
    # Every batch must have the same shape: layer-0 kwargs (rotary tables, mask) are captured once.
    return math.gcd(num_samples, max(1, wanted))


@dataclass
class _RefitStats:
    """What the refit of one group of matrices needs: X_dᵀX_c and the dense outputs' squared norms per child."""

    cross: torch.Tensor  # [in, in] float64, dense inputs against compressed inputs
    dense_sq: dict[str, float]  # child name -> ‖X_d Wᵀ‖²_F


class _Compressor:
    """Compresses one matrix at a time and keeps the per-module record and factors."""

    def __init__(self, settings: CompressSettings, ranks: dict[str, int | None] | None = None):
        self.s = settings
        self.ranks = ranks  # per-module ranks from a sensitivity allocation (None: keep matrix dense); None: uniform
        self.modules: dict[str, ModuleRecord] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.refit: dict[str, list[float]] = {}  # module -> [dense-output rel error before refit, after]

    def compress(self, parent: nn.Module, child: str, hf_name: str, xtx: torch.Tensor, L: torch.Tensor | None,
                 refit: _RefitStats | None = None) -> None:
        linear = getattr(parent, child)
        out_f, in_f = linear.weight.shape
        if self.ranks is not None and hf_name in self.ranks:
            rank = self.ranks[hf_name]
            if rank is None:
                reason = f"{self.s.allocation} allocation kept it dense"
                log.info("%s kept dense: %s", hf_name, reason)
                self.modules[hf_name] = ModuleRecord(dense=True, reason=reason, in_features=in_f, out_features=out_f)
                return
        else:
            rank = block_rank(in_f, out_f, self.s.keep_ratio, self.s.rank_multiple)
        if not saves_parameters(in_f, out_f, rank):
            reason = f"rank {rank} would not save parameters ({rank * (in_f + out_f)} >= {in_f * out_f} or >= min dim)"
            log.info("%s kept dense: %s", hf_name, reason)
            self.modules[hf_name] = ModuleRecord(dense=True, reason=reason, in_features=in_f, out_features=out_f)
            return
        W = linear.weight.detach()
        with single_threaded_lapack():
            A, B = whitened_factors(W, L, rank) if self.s.method == "whitened" else plain_factors(W, rank)
        if refit is not None:
            before = dense_output_rel_error(W, A, B, xtx, refit.cross, refit.dense_sq[child])
            B = refit_b(W, A, B, xtx, refit.cross, self.s.refit_damp)
            after = dense_output_rel_error(W, A, B, xtx, refit.cross, refit.dense_sq[child])
            self.refit[hf_name] = [round(before, 6), round(after, 6)]
        rel = activation_rel_error(W, A, B, xtx)
        self.modules[hf_name] = ModuleRecord(rank=rank, in_features=in_f, out_features=out_f, rel_error=round(rel, 6))
        a_key, b_key = factor_keys(hf_name)
        self.tensors[a_key], self.tensors[b_key] = A.to(torch.float32), B.to(torch.float32)
        setattr(parent, child, LowRankLinear(A.to(W.dtype), B.to(W.dtype), linear.bias))

    def group(self, parent: nn.Module, children: tuple[str, ...], prefix: str, xtx: torch.Tensor,
              refit: _RefitStats | None = None) -> dict:
        """Compress matrices that share one input (one XᵀX, one Cholesky); returns the damping record."""
        L, lam = (None, 0.0)
        if self.s.method == "whitened":
            L, lam = damped_cholesky(xtx)
            log.debug("%s: cholesky damping %.3g", prefix, lam)
        for child in children:
            self.compress(parent, child, f"{prefix}.{child}", xtx, L, refit)
        return {"children": list(children), "damp": lam}


def _attention_pass(comp: _Compressor, layer: nn.Module, i: int, hidden, kwargs, bs: int) -> list[dict]:
    """Compress q/k/v, then o_proj on the compressed q/k/v's attention output (as down_proj follows gate/up)."""
    attn = layer.self_attn
    prefix = f"model.layers.{i}.self_attn"
    xtx_qkv = input_grams(layer, hidden, kwargs, bs, {"qkv": attn.q_proj})["qkv"]
    records = [comp.group(attn, ("q_proj", "k_proj", "v_proj"), prefix, xtx_qkv)]
    # A second pass: o_proj's input changed with q/k/v, and its factors must fit the input the model will feed it.
    xtx_o = input_grams(layer, hidden, kwargs, bs, {"o": attn.o_proj})["o"]
    return records + [comp.group(attn, ("o_proj",), prefix, xtx_o)]


@dataclass
class _DensePass:
    """The DENSE layer's MLP on the dense model's own hidden states (the refit's targets)."""

    normed: torch.Tensor  # [num_samples, seqlen, hidden]: gate/up input
    inner: torch.Tensor  # [num_samples, seqlen, intermediate]: down input, act(gate)·up
    out_sq: dict[str, float]  # child -> ‖output‖²_F over the calibration tokens
    next_hidden: torch.Tensor  # the dense next layer's input


def _dense_pass(layer: nn.Module, hidden: torch.Tensor, kwargs, bs: int) -> _DensePass:
    """Run layer (still dense) on hidden; keep what the refit needs. Call before the layer is compressed."""
    mlp = layer.mlp
    residual, normed = mlp_inputs(layer, hidden, kwargs, bs)
    sq = {"gate_proj": 0.0, "up_proj": 0.0, "down_proj": 0.0}
    inner, outs = [], []
    with torch.no_grad():
        for start in range(0, normed.shape[0], bs):
            x = normed[start:start + bs]
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
            m = mlp.act_fn(g) * u
            d = mlp.down_proj(m)
            for name, y in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
                sq[name] += float(y.double().pow(2).sum())
            inner.append(m)
            outs.append(residual[start:start + bs] + d)
    return _DensePass(normed, torch.cat(inner), sq, torch.cat(outs))


def _mlp_pass(comp: _Compressor, layer: nn.Module, i: int, hidden, kwargs, bs: int,
              dense: _DensePass | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Compress gate/up, then down on the compressed gate/up's output; returns the next layer's input.

    With `dense` (refit on) each B is refitted against the dense layer's outputs, so down is fitted on the refitted
    gate/up's output.
    """
    mlp, prefix = layer.mlp, f"model.layers.{i}.mlp"
    residual, normed = mlp_inputs(layer, hidden, kwargs, bs)
    xtx = batched_gram(normed, bs)
    refit = _RefitStats(cross_gram(dense.normed, normed, bs), dense.out_sq) if dense is not None else None
    damps = [comp.group(mlp, ("gate_proj", "up_proj"), prefix, xtx, refit)]
    inner, xtx_down = [], None
    with torch.no_grad():
        for start in range(0, normed.shape[0], bs):
            x = normed[start:start + bs]
            m = mlp_intermediate(mlp, x)
            xtx_down = gram(m) if xtx_down is None else xtx_down + gram(m)
            inner.append(m)
    refit = None
    if dense is not None:
        refit = _RefitStats(cross_gram(dense.inner, torch.cat(inner), bs), dense.out_sq)
    damps.append(comp.group(mlp, ("down_proj",), prefix, xtx_down, refit))
    with torch.no_grad():
        out = torch.cat([residual[k:k + bs] + mlp.down_proj(inner[j]) for j, k in enumerate(range(0, normed.shape[0], bs))])
    return out, damps


def _param_counts(model: nn.Module, modules: dict[str, ModuleRecord]) -> ParameterCounts:
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    mlp = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in MLP]
    mlp_after = sum(m.weight.numel() if isinstance(m, nn.Linear) else m.A.numel() + m.B.numel() for m in mlp)
    mlp_before = sum(m.in_features * m.out_features for m in mlp)
    saved = sum(m.in_features * m.out_features - m.rank * (m.in_features + m.out_features)
                for m in modules.values() if not m.dense)
    return ParameterCounts(model_before=total + saved, model_after=total, mlp_before=mlp_before, mlp_after=mlp_after,
                           model_ratio=round(total / (total + saved), 6), mlp_ratio=round(mlp_after / mlp_before, 6))


def _spectra_key(settings: CompressSettings, source_sha: str, calib_sha: str, calib_documents: list[int]) -> dict:
    """Everything the dense pre-pass depends on: a cache file is reused only when all of it matches.

    calib_documents: the documents the windows were drawn from; the same file, samples and seed draw others when the
    C4 evaluation split is left out (compression_calibration), as it is since 2026-12-01.
    """
    keys = ("method", "sensitivity", "fisher_windows", "calib_samples", "calib_seqlen", "seed", "batch_size")
    # spectra 2: plain spectra measure the output error (2026-12-01); a cache of plain weight-error spectra is stale
    return {"source_sha256": source_sha, "calib_sha256": calib_sha, "calib_documents": calib_documents, "spectra": 2,
            **{k: getattr(settings, k) for k in keys}}


def check_sensitivity_cache(path: Path) -> Path:
    """The --sensitivity-cache file, checked before the work (ConfigError, one line): absent, empty, or a cache this
    tool wrote; any other file is refused rather than overwritten."""
    path = check_out_file(path, "--sensitivity-cache")
    if path.is_file() and path.stat().st_size:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or not {"key", "spectra", "measured"} & data.keys():
            raise ConfigError(f"--sensitivity-cache {path}: exists and is not a sensitivity cache (nothing was "
                              f"overwritten; name a new file)")
    return path


def _read_cache(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s is not a readable cache; it will be rewritten", path)
        return {}
    return data if isinstance(data, dict) else {}


def _load_spectra(path: Path | None, key: dict) -> list[Spectrum] | None:
    data = _read_cache(path)
    if not data.get("spectra"):
        return None
    if data.get("key") != key:
        log.warning("%s was made with other settings or weights; recomputing the sensitivity pre-pass", path)
        return None
    log.info("sensitivity pre-pass read from %s", path)
    return [Spectrum(d["name"], d["in"], d["out"], np.asarray(d["sigma"]), d["weight"]) for d in data["spectra"]]


def _save_spectra(path: Path | None, key: dict, spectra: list[Spectrum]) -> None:
    if path is not None:  # the measured entries the file may hold stay
        write_json_atomic(path, {**_read_cache(path), "key": key, "spectra": [
            {"name": s.name, "in": s.in_features, "out": s.out_features, "sigma": s.sigma.tolist(),
             "weight": s.weight} for s in spectra]})


MEASURED_VERSION = 1  # bump when the measured scoring changes meaning: older cache entries stop matching
MEASURED_CACHE_ENTRIES = 32  # the cache keeps the newest entries of the measured allocation, each under its key


def _measured_key(settings: CompressSettings, source_sha: str, calib_sha: str, calib_documents: list[int]) -> dict:
    """Everything the measured scores of round 0 depend on (later rounds add keep_ratio and the round)."""
    keys = ("method", "rank_multiple", "calib_samples", "calib_seqlen", "seed", "batch_size", "score_windows",
            "score_seqlen", "score_dtype")
    return {"measured_version": MEASURED_VERSION, "source_sha256": source_sha, "calib_sha256": calib_sha,
            "calib_documents": calib_documents,  # as in _spectra_key
            **{k: getattr(settings, k) for k in keys}}


def _measured_cache(path: Path | None, base_key: dict, keep_ratio: float):
    """cached(name, make) for allocate_measured: JSON entries under "measured" in the sensitivity cache file."""
    def cached(name: str, make):
        key = {**base_key, "step": name, **({} if name == "round0" else {"keep_ratio": keep_ratio})}
        for entry in _read_cache(path).get("measured", []):
            if entry.get("key") == key:
                log.info("measured allocation step %s read from %s", name, path)
                return entry["value"]
        value = make()
        if path is not None:
            data = _read_cache(path)
            entries = [e for e in data.get("measured", []) if e.get("key") != key] + [{"key": key, "value": value}]
            write_json_atomic(path, {**data, "measured": entries[-MEASURED_CACHE_ENTRIES:]})
        return value
    return cached


def _allocate_measured(model: nn.Module, hidden, kwargs, bs: int, settings: CompressSettings, score: Calibration,
                       cache: Path | None, cache_key: dict) -> tuple[dict, dict]:
    """The measured allocation (compression.measured.allocate_measured) and its manifest record."""
    dtype = getattr(torch, settings.score_dtype)
    try:
        result = allocate_measured(model, hidden, kwargs, bs, score.windows, settings.keep_ratio,
                                   settings.rank_multiple, whitened=settings.method == "whitened", dtype=dtype,
                                   rounds=settings.measured_rounds,
                                   cached=_measured_cache(cache, cache_key, settings.keep_ratio))
    except ValueError as e:
        raise ConfigError(f"--allocation measured: {e}") from e
    record = {
        "sensitivity": "measured rise of the mean next-token loss on held-out calibration windows when the matrix "
                       "alone is replaced by its whitened rank-r truncation (factors from the dense model's "
                       "calibration statistics), the rest of the model dense; rounds >= 1 re-measure every option "
                       "with the other matrices at the previous round's ranks",
        "solver": "multiple-choice knapsack, dynamic programming over the budget: per matrix every rank multiple "
                  "that saves parameters, or dense; minimises the summed measured loss rise; of the rounds' "
                  "allocations the one with the lowest measured loss on the scoring windows is kept",
        "scoring": {"windows": settings.score_windows, "seqlen": settings.score_seqlen, "tokens": result["tokens"],
                    "dtype": settings.score_dtype,
                    "documents": "the calibration file's documents in the calibration's seeded order, skipping the "
                                 "calibration's own documents and the C4 evaluation split",
                    "document_ids": score.document_ids},
        "dense_loss": result["dense_loss"], "rounds": result["rounds"], "chosen_round": result["chosen_round"],
        "exact": result["exact"], "param_unit": result["unit"], "total_loss": result["total_loss"],
        "mlp_budget": result["budget"], "mlp_params_used": result["used"], "loss": result["loss"],
        "deltas": {name: {("dense" if r is None else str(r)): float(f"{d:.6g}") for r, d in row.items()}
                   for name, row in result["deltas"].items()},
    }
    return record, result["ranks"]


def _allocate(model: nn.Module, windows: torch.Tensor, hidden, kwargs, bs: int, settings: CompressSettings,
              cache: Path | None = None, cache_key: dict | None = None, score: Calibration | None = None,
              measured_key: dict | None = None) -> tuple[dict, dict | None]:
    """(manifest "allocation" record, per-module MLP ranks or None for the uniform formula).

    cache: a JSON file holding the dense pre-pass (spectra and Fisher weights) for cache_key, and the measured
    allocation's steps for measured_key; read when they match, else computed and written, so allocation experiments
    on one model and calibration pay the pre-pass once. score: the measured allocation's scoring windows.
    """
    record = {"method": settings.allocation, "latency_model": settings.latency_model}
    if settings.allocation == "uniform":
        return record, None
    if settings.allocation == "measured":
        if score is None or measured_key is None:
            raise ValueError("the measured allocation needs its scoring windows and cache key")
        extra, ranks = _allocate_measured(model, hidden, kwargs, bs, settings, score, cache, measured_key)
        return {**record, **extra}, ranks
    if settings.allocation == "exact" and settings.sensitivity != "fisher":
        raise ConfigError("--allocation exact needs --sensitivity fisher (normalised losses of different matrices "
                          "are not in one unit, so their sum is not a model loss to minimise)")
    spectra = _load_spectra(cache, cache_key)
    if spectra is None:
        weights = output_fisher(model, windows[:settings.fisher_windows]) if settings.sensitivity == "fisher" else None
        spectra = dense_mlp_spectra(model, hidden, kwargs, bs, whitened=settings.method == "whitened", weights=weights)
        _save_spectra(cache, cache_key, spectra)
    weights = spectra[0].weight if spectra else None
    measure = (f"{settings.method} truncation loss weighted by the output Fisher (mean ‖∂loss/∂y‖² per output, "
               f"{settings.fisher_windows} calibration windows)" if weights is not None
               else f"normalised {settings.method} truncation loss (relative output error)")
    if settings.allocation == "exact":
        try:
            result = allocate_exact(spectra, settings.keep_ratio, settings.rank_multiple)
        except ValueError as e:
            raise ConfigError(f"--allocation exact: {e}") from e
        greedy = allocate(spectra, settings.keep_ratio, settings.rank_multiple)  # for comparison in the manifest
        greedy_loss = sum(truncation_loss(sp)[greedy["ranks"][sp.name]] if greedy["ranks"][sp.name] else 0.0
                          for sp in spectra)
        record.update({"sensitivity": measure,
                       "solver": "multiple-choice knapsack, dynamic programming over the budget: per matrix every "
                                 "rank multiple that saves parameters, or dense; minimises the summed measure",
                       "exact": result["exact"], "param_unit": result["unit"], "total_loss": result["total_loss"],
                       "greedy_total_loss": float(greedy_loss),
                       "mlp_budget": result["budget"], "mlp_params_used": result["used"], "loss": result["loss"]})
        return record, result["ranks"]
    step_latency = None
    if settings.latency_model == "trn1":
        step_latency = latency.step_latency(128)
    try:
        result = allocate(spectra, settings.keep_ratio, settings.rank_multiple, step_latency)
    except ValueError as e:
        raise ConfigError(f"--allocation sensitivity: {e}") from e
    record.update({"sensitivity": f"{measure} per parameter (greedy, one rank step)",
                   "tie_break": "lowest modeled trn1 latency at 128 tokens among steps within 2 % of the best gain "
                                "per parameter" if step_latency else "none",
                   "mlp_budget": result["budget"], "mlp_params_used": result["used"], "loss": result["loss"]})
    return record, result["ranks"]


def _refit_record(settings: CompressSettings, comp: _Compressor) -> dict:
    """The manifest's "refit" block: whether, how, and each module's dense-output error before and after."""
    if not settings.refit:
        return {"enabled": False}
    before = [v[0] for v in comp.refit.values()]
    after = [v[1] for v in comp.refit.values()]
    return {"enabled": True, "damp": settings.refit_damp,
            "solve": "A fixed; B = (W·X_dᵀX_c·Aᵀ + λB₀)(A·X_cᵀX_c·Aᵀ + λI)⁻¹, X_c the compressed model's inputs, X_d the "
                     "dense model's, λ = damp·mean diag; layer by layer, down after the refitted gate/up",
            "mean_dense_rel_error_before": round(sum(before) / max(len(before), 1), 6),
            "mean_dense_rel_error_after": round(sum(after) / max(len(after), 1), 6),
            "dense_rel_error": comp.refit}


def compress_model(model_dir: Path, settings: CompressSettings, out_dir: Path, model_id: str,
                   sensitivity_cache: Path | None = None) -> Manifest:
    """Compress the model in model_dir per settings and write the artifact to out_dir; returns the manifest.

    sensitivity_cache: optional JSON file that keeps the allocation's dense pre-pass between runs (see _allocate).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings.method == "prune":
        raise ValueError("method prune is compression.prune_artifact.prune_compress_model, not the SVD driver")
    started = time.perf_counter()
    calib_path = data_path(settings.calib_data, "compression.calib_data")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    calib = compression_calibration(calib_path, tokenizer, settings.calib_samples, settings.calib_seqlen,
                                    settings.seed)
    windows = calib.windows
    bs = calibration_batch_size(settings.calib_samples, settings.batch_size)
    damping = {}
    with torch.no_grad():
        hidden, kwargs = capture_layer0_inputs(model, windows, bs)
    source_sha, calib_sha = weights_sha256(model_dir), file_sha256(calib_path)
    score = None
    if settings.allocation == "measured":  # held out: neither calibration documents nor C4 evaluation ones
        held = set(calib.document_ids) | evaluation_documents(calib_path)
        score = calibration_windows(calib_path, tokenizer, settings.score_windows, settings.score_seqlen,
                                    settings.seed, exclude=held)
    allocation, ranks = _allocate(model, windows, hidden, kwargs, bs, settings, sensitivity_cache,
                                  _spectra_key(settings, source_sha, calib_sha, calib.document_ids), score,
                                  _measured_key(settings, source_sha, calib_sha, calib.document_ids))
    comp = _Compressor(settings, ranks)
    hidden_dense = hidden  # the dense model's hidden states, advanced beside the compressed ones for the refit
    with torch.no_grad():
        layers = model.model.layers
        for i in tqdm(range(len(layers)), desc=f"compress {settings.method} keep {settings.keep_ratio}", unit="layer"):
            layer, records = layers[i], []
            dense = _dense_pass(layer, hidden_dense, kwargs, bs) if settings.refit else None
            if settings.targets == "mlp+attn":
                records += _attention_pass(comp, layer, i, hidden, kwargs, bs)
            hidden, mlp_records = _mlp_pass(comp, layer, i, hidden, kwargs, bs, dense)
            if dense is not None:
                hidden_dense = dense.next_hidden
            del dense
            damping[str(i)] = {r["children"][0]: r["damp"] for r in records + mlp_records}
    counts = _param_counts(model, comp.modules)
    if settings.latency_model == "trn1":
        allocation["modeled_latency"] = latency.model_latency(comp.modules)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        source=SourceRecord(model_id=model_id, model_dir_name=Path(model_dir).name, sha256=source_sha),
        method=settings.method, keep_ratio=settings.keep_ratio, rank_multiple=settings.rank_multiple,
        targets=settings.targets, allocation=allocation,
        calibration=CalibrationRecord(data=calib_path.name, sha256=calib_sha,
                                      samples=settings.calib_samples, seqlen=settings.calib_seqlen, seed=settings.seed,
                                      statistics="float64 XᵀX", sequential=True, document_ids=calib.document_ids,
                                      excluded_documents=calib.excluded),
        seed=settings.seed, tool_version=tool_version(), settings=settings.model_dump(),
        parameters=counts, params_before=counts.model_before, params_after=counts.model_after,
        damping=damping, refit=_refit_record(settings, comp), compress_wall_s=round(time.perf_counter() - started, 1),
        modules=comp.modules,
    )
    save_artifact(out_dir, manifest, comp.tensors)
    log.info("wrote %s: %d low-rank modules, model parameters %d -> %d (%.3f)", out_dir, len(comp.tensors) // 2,
             counts.model_before, counts.model_after, counts.model_ratio)
    return manifest
