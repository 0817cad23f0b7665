"""recover_artifact: load model + artifact, train factor adapters, merge, rewrite the artifact."""

from __future__ import annotations

import logging
import resource
import sys
import time
from pathlib import Path

import torch

from compression.calibration import calibration_windows
from compression.recovery.adapter import attach_adapters, merge_adapters
from compression.recovery.checkpoint import CHECKPOINT_NAME
from compression.recovery.data import recovery_documents, token_windows
from compression.recovery.train import train_adapters
from server.config import RecoveryConfig, data_dir
from server.models.artifact import FACTORS, MANIFEST, Manifest, check_model_hash, load_artifact, save_artifact
from server.models.compressed import factor_tensors, swap_in_factors

log = logging.getLogger(__name__)

DEFAULT_DATA = Path("c4") / "c4-validation-sample.jsonl"


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _peak_rss_mib() -> float:
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20  # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def calibration_document_ids(manifest: Manifest, path: Path, tokenizer) -> set[int]:
    """The documents (line indices of `path`) compression calibrated on, as its manifest records them.

    Artifacts written before the ids were recorded get calibration's own selection replayed from their
    samples/seqlen/seed; a manifest without a calibration record (made by hand) excludes nothing.
    """
    calib = manifest.calibration
    if calib is None:
        return set()
    if calib.document_ids is not None:
        return set(calib.document_ids)
    log.warning("manifest records no calibration document ids; replaying the calibration selection")
    return set(calibration_windows(path, tokenizer, calib.samples, calib.seqlen, calib.seed).document_ids)


def load_adapted_model(model_dir: Path, manifest: Manifest, tensors: dict, rcfg: RecoveryConfig,
                       device: torch.device):
    """The HF model (float32) with the artifact's factors installed and adapters attached; (model, names)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = swap_in_factors(model, manifest, tensors)
    model.to(device)
    attach_adapters(model, rcfg.adapter_rank, rcfg.alpha, rcfg.seed)
    return model, names


def recover_artifact(artifact_dir: Path, model_dir: Path, cfg: RecoveryConfig | None = None, *,
                     out_dir: Path | None = None, resume: bool = False, data_path: Path | None = None, stop_after: int | None = None) -> dict:
    """LoRA-recover an artifact's factors and rewrite it (atomically) with a manifest "recovery" block.

    `cfg` None means RecoveryConfig's defaults. Returns the recovery block; if `stop_after` interrupts
    training, the artifact is left untouched (checkpoint only).
    """
    from transformers import AutoTokenizer

    rcfg = cfg or RecoveryConfig()
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir or artifact_dir)
    manifest, tensors = load_artifact(artifact_dir)
    check_model_hash(manifest, Path(model_dir), f"recover {artifact_dir}")
    torch.set_num_threads(rcfg.num_threads)
    device = _pick_device(rcfg.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = Path(data_path) if data_path else data_dir() / DEFAULT_DATA
    docs, data_sha, num_excluded = recovery_documents(path, calibration_document_ids(manifest, path, tokenizer))
    windows = token_windows(tokenizer, docs, rcfg.seqlen, max_windows=rcfg.steps * rcfg.batch_size)
    torch.manual_seed(rcfg.seed)
    model, names = load_adapted_model(Path(model_dir), manifest, tensors, rcfg, device)
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
        "data_sha256": data_sha, "calibration_documents_excluded": num_excluded,
        "calibration": manifest.calibration.model_dump(include={"samples", "seqlen", "seed"})
        if manifest.calibration else None,
        "num_windows": len(windows), "seed": rcfg.seed, "device": str(device),
        "wall_s": round(run["wall_s"], 2), "total_wall_s": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "config": rcfg.model_dump(),
    }
    if device.type == "cuda":
        block["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    carry = tuple(item for item in artifact_dir.iterdir() if item.is_file() and item.name not in (MANIFEST, FACTORS)
                  and not item.name.startswith("recovery-"))
    save_artifact(out_dir, manifest.model_copy(update={"recovery": block}), factor_tensors(model, names), carry)
    ckpt.unlink(missing_ok=True)  # in-place: already gone with the old dir; --out: the source keeps none
    log.info("recovered %d modules: loss %.3f -> %.3f in %.0f s", len(names), losses[0], block["final_loss"],
             run["wall_s"])
    return block
