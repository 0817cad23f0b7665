"""recover_artifact: load model + artifact, train factor adapters, merge, rewrite the artifact."""

from __future__ import annotations

import dataclasses
import logging
import resource
import sys
import time
from pathlib import Path

import torch

from compression.recovery.adapter import attach_adapters, merge_adapters
from compression.recovery.artifact_io import (check_source, factor_tensors, install_factors, read_artifact,
                                              write_artifact)
from compression.recovery.checkpoint import CHECKPOINT_NAME
from compression.recovery.data import recovery_documents, token_windows
from compression.recovery.train import RecoveryConfig, train_adapters

log = logging.getLogger(__name__)

DEFAULT_DATA = Path("c4") / "c4-validation-sample.jsonl"


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _peak_rss_mib() -> float:
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20  # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def calibration_params(manifest: dict) -> dict:
    """{"samples", "seqlen", "seed"} of the compression run (manifest, else the config defaults)."""
    from server.config import CompressionConfig

    defaults = CompressionConfig()
    found = {"samples": defaults.calib_samples, "seqlen": defaults.calib_seqlen, "seed": defaults.seed}
    aliases = {"samples": ("calib_samples", "samples", "num_samples"), "seqlen": ("calib_seqlen", "seqlen"),
               "seed": ("seed", "calib_seed")}
    for scope in (manifest, manifest.get("calibration") if isinstance(manifest.get("calibration"), dict) else {}):
        for field, names in aliases.items():
            for name in names:
                if isinstance(scope.get(name), int):
                    found[field] = scope[name]
    return found


def load_adapted_model(model_dir: Path, tensors: dict, rcfg: RecoveryConfig, device: torch.device):
    """The HF model (float32) with the artifact's factors installed and adapters attached; (model, names)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = install_factors(model, tensors)
    model.to(device)
    attach_adapters(model, rcfg.adapter_rank, rcfg.alpha, rcfg.seed)
    return model, names


def recover_artifact(artifact_dir: Path, model_dir: Path, cfg=None, *, out_dir: Path | None = None,
                     resume: bool = False, data_path: Path | None = None, stop_after: int | None = None) -> dict:
    """LoRA-recover an artifact's factors and rewrite it (atomically) with a manifest "recovery" block.

    `cfg` is a RecoveryConfig, or anything else (e.g. the server Config) for the defaults. Returns the
    recovery block; if `stop_after` interrupts training, the artifact is left untouched (checkpoint only).
    """
    from transformers import AutoTokenizer

    from compression.evaluation.datadir import data_dir

    rcfg = cfg if isinstance(cfg, RecoveryConfig) else RecoveryConfig()
    rcfg.validate()
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir or artifact_dir)
    manifest, tensors = read_artifact(artifact_dir)
    check_source(manifest, Path(model_dir), artifact_dir)
    torch.set_num_threads(rcfg.num_threads)
    device = _pick_device(rcfg.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calib = calibration_params(manifest)
    docs, data_sha, num_excluded = recovery_documents(Path(data_path) if data_path else data_dir() / DEFAULT_DATA,
                                                      tokenizer, calib)
    windows = token_windows(tokenizer, docs, rcfg.seqlen, max_windows=rcfg.steps * rcfg.batch_size)
    torch.manual_seed(rcfg.seed)
    model, names = load_adapted_model(Path(model_dir), tensors, rcfg, device)
    t0 = time.perf_counter()
    ckpt = artifact_dir / CHECKPOINT_NAME
    run = train_adapters(model, windows, rcfg, ckpt, resume=resume, stop_after=stop_after)
    if not run["completed"]:
        log.info("recovery stopped at step %d of %d; resume with --resume", len(run["losses"]), rcfg.steps)
        return {}
    merge_adapters(model)
    losses = run["losses"]
    tail = losses[-min(10, len(losses)):]
    block = {
        "method": "lora-on-factors", "adapter_rank": rcfg.adapter_rank, "alpha": rcfg.alpha,
        "steps": rcfg.steps, "batch_size": rcfg.batch_size, "seqlen": rcfg.seqlen, "tokens": run["tokens"],
        "lr": rcfg.lr, "schedule": f"linear warmup {rcfg.warmup_steps} steps, cosine to {rcfg.min_lr_ratio}x",
        "optimizer": f"AdamW(weight_decay={rcfg.weight_decay}), grad-norm clip {rcfg.max_grad_norm}",
        "initial_loss": losses[0], "final_loss": sum(tail) / len(tail),
        "data": "c4-validation-sample.jsonl minus the compression calibration documents, file order",
        "data_sha256": data_sha, "calibration_documents_excluded": num_excluded, "calibration": calib,
        "num_windows": len(windows), "seed": rcfg.seed, "device": str(device),
        "wall_s": round(run["wall_s"], 2), "total_wall_s": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "config": dataclasses.asdict(rcfg),
    }
    if device.type == "cuda":
        block["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    new_manifest = dict(manifest, recovery=block)
    write_artifact(artifact_dir, out_dir, new_manifest, factor_tensors(model, names))
    ckpt.unlink(missing_ok=True)  # in-place: already gone with the old dir; --out: the source keeps none
    log.info("recovered %d modules: loss %.3f -> %.3f in %.0f s", len(names), losses[0], block["final_loss"],
             run["wall_s"])
    return block
