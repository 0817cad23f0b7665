"""Layer-by-layer driver: calibrate, whiten, truncate, swap in factors, feed the next layer compressed activations."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from pydantic import Field
from torch import nn
from tqdm import tqdm

from compression import latency
from compression.allocation import allocate
from compression.calibration import calibration_windows
from compression.rank import block_rank, saves_parameters
from compression.sensitivity import dense_mlp_spectra, output_fisher
from compression.statistics import MLP, batched_gram, capture_layer0_inputs, gram, input_grams, mlp_inputs
from compression.whiten import activation_rel_error, damped_cholesky, plain_factors, whitened_factors
from server.config import CompressionConfig, data_path
from server.errors import ConfigError
from server.fileio import file_sha256
from server.models.artifact import (FORMAT_VERSION, CalibrationRecord, Manifest, ModuleRecord, ParameterCounts,
                                    SourceRecord, factor_keys, save_artifact, weights_sha256)
from server.models.lowrank import LowRankLinear

log = logging.getLogger(__name__)

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


class CompressSettings(CompressionConfig):
    """Everything that decides the factors (recorded in the manifest): the config's compression block plus
    two knobs of the calibration passes."""

    fisher_windows: int = Field(16, ge=1)  # calibration windows the Fisher estimate back-propagates
    batch_size: int = Field(8, ge=1)  # windows per forward pass of the calibration passes


def _tool_version() -> str:
    try:
        from importlib.metadata import version

        return version("neuronmm")
    except Exception:  # not installed as a distribution (e.g. run from a checkout)
        return "0+unknown"


def _batch_size(num_samples: int, wanted: int) -> int:
    # Every batch must have the same shape: layer-0 kwargs (rotary tables, mask) are captured once.
    return math.gcd(num_samples, max(1, wanted))


class _Compressor:
    """Compresses one matrix at a time and keeps the per-module record and factors."""

    def __init__(self, settings: CompressSettings, ranks: dict[str, int | None] | None = None):
        self.s = settings
        self.ranks = ranks  # per-module ranks from a sensitivity allocation (None: keep matrix dense); None: uniform
        self.modules: dict[str, ModuleRecord] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def compress(self, parent: nn.Module, child: str, hf_name: str, xtx: torch.Tensor, L: torch.Tensor | None) -> None:
        linear = getattr(parent, child)
        out_f, in_f = linear.weight.shape
        if self.ranks is not None and hf_name in self.ranks:
            rank = self.ranks[hf_name]
            if rank is None:
                reason = "sensitivity allocation kept it dense (its next rank step would not save parameters)"
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
        A, B = whitened_factors(W, L, rank) if self.s.method == "whitened" else plain_factors(W, rank)
        rel = activation_rel_error(W, A, B, xtx)
        self.modules[hf_name] = ModuleRecord(rank=rank, in_features=in_f, out_features=out_f, rel_error=round(rel, 6))
        a_key, b_key = factor_keys(hf_name)
        self.tensors[a_key], self.tensors[b_key] = A.to(torch.float32), B.to(torch.float32)
        setattr(parent, child, LowRankLinear(A.to(W.dtype), B.to(W.dtype), linear.bias))

    def group(self, parent: nn.Module, children: tuple[str, ...], prefix: str, xtx: torch.Tensor) -> dict:
        """Compress matrices that share one input (one XᵀX, one Cholesky); returns the damping record."""
        L, lam = (None, 0.0)
        if self.s.method == "whitened":
            L, lam = damped_cholesky(xtx)
            log.debug("%s: cholesky damping %.3g", prefix, lam)
        for child in children:
            self.compress(parent, child, f"{prefix}.{child}", xtx, L)
        return {"children": list(children), "damp": lam}


def _attention_pass(comp: _Compressor, layer: nn.Module, i: int, hidden, kwargs, bs: int) -> list[dict]:
    attn = layer.self_attn
    grams = input_grams(layer, hidden, kwargs, bs, {"qkv": attn.q_proj, "o": attn.o_proj})
    prefix = f"model.layers.{i}.self_attn"
    return [comp.group(attn, ("q_proj", "k_proj", "v_proj"), prefix, grams["qkv"]),
            comp.group(attn, ("o_proj",), prefix, grams["o"])]


def _mlp_pass(comp: _Compressor, layer: nn.Module, i: int, hidden, kwargs, bs: int) -> tuple[torch.Tensor, list[dict]]:
    """Compress gate/up, then down on the compressed gate/up's output; returns the next layer's input."""
    mlp, prefix = layer.mlp, f"model.layers.{i}.mlp"
    residual, normed = mlp_inputs(layer, hidden, kwargs, bs)
    xtx = batched_gram(normed, bs)
    damps = [comp.group(mlp, ("gate_proj", "up_proj"), prefix, xtx)]
    inner, xtx_down = [], None
    with torch.no_grad():
        for start in range(0, normed.shape[0], bs):
            x = normed[start:start + bs]
            m = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
            xtx_down = gram(m) if xtx_down is None else xtx_down + gram(m)
            inner.append(m)
    damps.append(comp.group(mlp, ("down_proj",), prefix, xtx_down))
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


def _allocate(model: nn.Module, windows: torch.Tensor, hidden, kwargs, bs: int,
              settings: CompressSettings) -> tuple[dict, dict | None]:
    """(manifest "allocation" record, per-module MLP ranks or None for the uniform formula)."""
    record = {"method": settings.allocation, "latency_model": settings.latency_model}
    if settings.allocation == "uniform":
        return record, None
    weights = output_fisher(model, windows[:settings.fisher_windows]) if settings.sensitivity == "fisher" else None
    spectra = dense_mlp_spectra(model, hidden, kwargs, bs, whitened=settings.method == "whitened", weights=weights)
    step_latency = None
    if settings.latency_model == "trn1":
        step_latency = latency.step_latency(128)
    try:
        result = allocate(spectra, settings.keep_ratio, settings.rank_multiple, step_latency)
    except ValueError as e:
        raise ConfigError(f"--allocation sensitivity: {e}") from e
    measure = (f"whitened truncation loss weighted by the output Fisher (mean ‖∂loss/∂y‖² per output, "
               f"{settings.fisher_windows} calibration windows)" if weights is not None
               else "normalised whitened truncation loss (relative output error)")
    record.update({"sensitivity": f"{measure} per parameter (greedy, one rank step)",
                   "tie_break": "lowest modeled trn1 latency at 128 tokens among steps within 2 % of the best gain "
                                "per parameter" if step_latency else "none",
                   "mlp_budget": result["budget"], "mlp_params_used": result["used"], "loss": result["loss"]})
    return record, result["ranks"]


def compress_model(model_dir: Path, settings: CompressSettings, out_dir: Path, model_id: str) -> Manifest:
    """Compress the model in model_dir per settings and write the artifact to out_dir; returns the manifest."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    started = time.perf_counter()
    calib_path = data_path(settings.calib_data, "compression.calib_data")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    calib = calibration_windows(calib_path, tokenizer, settings.calib_samples, settings.calib_seqlen, settings.seed)
    windows = calib.windows
    bs = _batch_size(settings.calib_samples, settings.batch_size)
    damping = {}
    with torch.no_grad():
        hidden, kwargs = capture_layer0_inputs(model, windows, bs)
    allocation, ranks = _allocate(model, windows, hidden, kwargs, bs, settings)
    comp = _Compressor(settings, ranks)
    with torch.no_grad():
        layers = model.model.layers
        for i in tqdm(range(len(layers)), desc=f"compress {settings.method} keep {settings.keep_ratio}", unit="layer"):
            layer, records = layers[i], []
            if settings.targets == "mlp+attn":
                records += _attention_pass(comp, layer, i, hidden, kwargs, bs)
            hidden, mlp_records = _mlp_pass(comp, layer, i, hidden, kwargs, bs)
            damping[str(i)] = {r["children"][0]: r["damp"] for r in records + mlp_records}
    counts = _param_counts(model, comp.modules)
    if settings.latency_model == "trn1":
        allocation["modeled_latency"] = latency.model_latency(comp.modules)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        source=SourceRecord(model_id=model_id, model_dir_name=Path(model_dir).name, sha256=weights_sha256(model_dir)),
        method=settings.method, keep_ratio=settings.keep_ratio, rank_multiple=settings.rank_multiple,
        targets=settings.targets, allocation=allocation,
        calibration=CalibrationRecord(data=calib_path.name, sha256=file_sha256(calib_path),
                                      samples=settings.calib_samples, seqlen=settings.calib_seqlen, seed=settings.seed,
                                      statistics="float64 XᵀX", sequential=True, document_ids=calib.document_ids),
        seed=settings.seed, tool_version=_tool_version(), settings=settings.model_dump(),
        parameters=counts, params_before=counts.model_before, params_after=counts.model_after,
        damping=damping, compress_wall_s=round(time.perf_counter() - started, 1),
        modules=comp.modules,
    )
    save_artifact(out_dir, manifest, comp.tensors)
    log.info("wrote %s: %d low-rank modules, model parameters %d -> %d (%.3f)", out_dir, len(comp.tensors) // 2,
             counts.model_before, counts.model_after, counts.model_ratio)
    return manifest
