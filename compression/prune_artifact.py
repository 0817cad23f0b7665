"""`neuronmm compress --method prune`: structured pruning of the MLP's intermediate channels, written as an artifact.

The same calibration windows, budget and artifact folder as the SVD path (compression/compress.py); the maths is
compression/prune.py's. Per layer the kept channels are a whole number of `rank_multiple` blocks (128: the
trn1 tile), so every pruned matmul stays tile-aligned. Steps (each with a progress bar):

1. channel statistics: HᵀH of every layer's intermediate activations on the dense model (one pass);
2. each layer's removal order (`prune_order`: obs or energy) and, for the global allocation, the output Fisher of
   down_proj, which puts the layers' output errors into one unit (model loss);
3. the allocation: exact DP over the layers' block costs under the MLP budget (allocation sensitivity or exact),
   or the same number of blocks from every layer (uniform);
4. slicing, and with `refit` (the default here) down_proj re-solved on the kept channels, layer by layer on the
   pruned model's own activations.

The artifact stores gate/up/down of each pruned layer whole (`<module>.weight`, fp32); the manifest's module records
give each one's `pruned_shape`, the allocation record each layer's intermediate size.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from compression.calibration import compression_calibration
from compression.compress import CompressSettings, calibration_batch_size, tool_version
from compression.evaluation.model import count_parameters
from compression.prune import apply_plan, layer_stats, make_plan, removal_orders
from compression.sensitivity import output_fisher
from compression.statistics import MLP
from server.config import data_path
from server.errors import ConfigError
from server.fileio import file_sha256
from server.models.artifact import (FORMAT_VERSION, CalibrationRecord, Manifest, ModuleRecord, ParameterCounts,
                                    SourceRecord, save_artifact, weight_key, weights_sha256)

log = logging.getLogger(__name__)

MIN_KEEP_BLOCKS = 1  # every layer keeps at least one block: a layer's MLP is never removed outright


def check_prune_settings(settings: CompressSettings, intermediate: int | None = None) -> None:
    """ConfigError for settings pruning cannot honour (before any calibration pass)."""
    if settings.targets != "mlp":
        raise ConfigError("--method prune prunes the MLP's intermediate channels only (--targets mlp)")
    if settings.allocation == "measured":
        raise ConfigError("--method prune: --allocation measured scores SVD ranks; use sensitivity/exact (the exact "
                          "DP over Fisher-weighted costs) or uniform")
    if settings.sensitivity != "fisher" or settings.latency_model != "none":
        raise ConfigError("--method prune weighs layers by the output Fisher only (no --sensitivity normalised, no "
                          "--latency-model)")
    if intermediate is not None and (intermediate % settings.rank_multiple
                                     or intermediate // settings.rank_multiple <= MIN_KEEP_BLOCKS):
        raise ConfigError(f"--rank-multiple {settings.rank_multiple}: pruning removes whole blocks, and the MLP's "
                          f"intermediate size {intermediate} is not a multiple of it with room to remove one")


def _mlp_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """HF name -> (in, out) of every MLP projection."""
    return {name: (mod.in_features, mod.out_features) for name, mod in model.named_modules()
            if name.rsplit(".", 1)[-1] in MLP}


def _records(model: nn.Module, dense_shapes: dict[str, tuple[int, int]],
             refit_errors: list[list[float]] | None) -> tuple[dict[str, ModuleRecord], dict[str, torch.Tensor]]:
    """Each MLP projection's record (pruned, or kept dense when its layer lost no channel) and the pruned weights.

    rel_error of a pruned down_proj: the layer's MLP-output error on the calibration tokens, relative (after the
    refit when there was one); gate/up carry none (their kept rows are exact)."""
    modules, tensors = {}, {}
    for name, (in_f, out_f) in dense_shapes.items():
        weight = model.get_submodule(name).weight
        if tuple(weight.shape) == (out_f, in_f):
            modules[name] = ModuleRecord(in_features=in_f, out_features=out_f, dense=True,
                                         reason="no channels removed in this layer")
            continue
        error = None
        if refit_errors is not None and name.endswith("down_proj"):
            error = refit_errors[int(name.split(".")[2])][1]
        modules[name] = ModuleRecord(in_features=in_f, out_features=out_f, pruned_shape=tuple(weight.shape),
                                     rel_error=error)
        tensors[weight_key(name)] = weight.detach()
    return modules, tensors


def prune_compress_model(model_dir: Path, settings: CompressSettings, out_dir: Path, model_id: str) -> Manifest:
    """Prune the MLP channels of the model in model_dir per settings and write the artifact; returns the manifest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_prune_settings(settings)
    started = time.perf_counter()
    calib_path = data_path(settings.calib_data, "compression.calib_data")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    check_prune_settings(settings, inter)
    block = settings.rank_multiple
    calib = compression_calibration(calib_path, tokenizer, settings.calib_samples, settings.calib_seqlen,
                                    settings.seed)
    windows, bs = calib.windows, calibration_batch_size(settings.calib_samples, settings.batch_size)
    params_before, dense_shapes = count_parameters(model), _mlp_shapes(model)
    mlp_before = sum(i * o for i, o in dense_shapes.values())
    wall = {}

    t = time.perf_counter()
    stats = layer_stats(model, windows, bs)
    orders = removal_orders(model, stats, settings.prune_order, inter - MIN_KEEP_BLOCKS * block, settings.refit_damp)
    del stats
    wall["statistics_and_orders_s"] = round(time.perf_counter() - t, 1)
    method = "uniform" if settings.allocation == "uniform" else "global"
    weights = None
    if method == "global":
        t = time.perf_counter()
        fisher = output_fisher(model, windows[:settings.fisher_windows])
        weights = [fisher[f"model.layers.{i}.mlp.down_proj"] for i in range(len(model.model.layers))]
        wall["output_fisher_s"] = round(time.perf_counter() - t, 1)
    plan = make_plan(orders, inter, hidden, settings.keep_ratio, block, method, weights, MIN_KEEP_BLOCKS)
    t = time.perf_counter()
    with torch.no_grad():
        refit = apply_plan(model, plan, windows, bs, refit=settings.refit, damp=settings.refit_damp)
    wall["slice_and_refit_s"] = round(time.perf_counter() - t, 1)

    modules, tensors = _records(model, dense_shapes, refit.get("rel_error"))
    params_after = count_parameters(model)
    mlp_after = sum(m.in_features * m.out_features if m.dense else m.pruned_shape[0] * m.pruned_shape[1]
                    for m in modules.values())
    counts = ParameterCounts(model_before=params_before, model_after=params_after, mlp_before=mlp_before,
                             mlp_after=mlp_after, model_ratio=round(params_after / params_before, 6),
                             mlp_ratio=round(mlp_after / mlp_before, 6))
    allocation = {**plan.record, "method": "exact DP over layers" if method == "global" else "uniform",
                  "order": settings.prune_order, "unit": "channels of the MLP intermediate dimension",
                  "min_keep_blocks": MIN_KEEP_BLOCKS, "removed_blocks": plan.removed_blocks,
                  "weights": "output Fisher of down_proj" if weights else None,
                  "fisher_down_proj": [float(f"{w:.6g}") for w in weights] if weights else None, "wall_s": wall}
    refit_record = {"enabled": False}
    if settings.refit:
        errors = refit["rel_error"]
        refit_record = {"enabled": True, "damp": settings.refit_damp,
                        "solve": "down_proj on the kept channels K: W_K = (W·G_{:,K} + λW_K)(G_KK + λI)⁻¹, G = HᵀH of "
                                 "the layer's unpruned intermediate on the pruned model's own activations, "
                                 "λ = damp·mean diag G_KK; layer by layer",
                        "mean_rel_error_before": round(sum(e[0] for e in errors) / len(errors), 6),
                        "mean_rel_error_after": round(sum(e[1] for e in errors) / len(errors), 6),
                        "rel_error": errors}
    source_sha = weights_sha256(model_dir)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        source=SourceRecord(model_id=model_id, model_dir_name=Path(model_dir).name, sha256=source_sha),
        method="prune", keep_ratio=settings.keep_ratio, rank_multiple=block, targets="mlp", allocation=allocation,
        calibration=CalibrationRecord(data=calib_path.name, sha256=file_sha256(calib_path),
                                      samples=settings.calib_samples, seqlen=settings.calib_seqlen, seed=settings.seed,
                                      statistics="float64 HᵀH of the MLP intermediate", sequential=True,
                                      document_ids=calib.document_ids,
                                      excluded_documents=calib.excluded),
        seed=settings.seed, tool_version=tool_version(), settings=settings.model_dump(),
        parameters=counts, params_before=counts.model_before, params_after=counts.model_after,
        refit=refit_record, compress_wall_s=round(time.perf_counter() - started, 1), modules=modules,
    )
    save_artifact(out_dir, manifest, tensors)
    log.info("wrote %s: %d pruned modules, intermediate sizes %s, model parameters %d -> %d (%.3f)", out_dir,
             len(tensors), plan.record["intermediate_sizes"], counts.model_before, counts.model_after,
             counts.model_ratio)
    return manifest
