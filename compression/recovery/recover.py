"""recover_artifact: load model + artifact (+ dense teacher), train adapters or factors, merge, rewrite the artifact."""

from __future__ import annotations

import logging
import resource
import sys
import time
from pathlib import Path

import torch

from compression.calibration import DEFAULT_DATA, calibration_windows, evaluation_documents
from compression.recovery.adapter import merge_adapters, prepare_training
from compression.recovery.checkpoint import CHECKPOINT_NAME
from compression.recovery.data import recovery_documents, token_windows
from compression.recovery.train import train_adapters
from server.config import RecoveryConfig, data_dir
from server.errors import ConfigError
from server.models.artifact import FACTORS, MANIFEST, Manifest, check_model_hash, load_artifact, save_artifact
from server.models.compressed import artifact_tensors, swap_in_artifact
from server.models.source import model_positions

log = logging.getLogger(__name__)

def pick_device(name: str) -> torch.device:
    """The device recovery trains on: auto (CUDA where there is one), cpu, or cuda[:N] (ConfigError, one line, for
    another name or a CUDA device this machine lacks)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"recovery.device: {name!r} is not auto, cpu or cuda[:N]")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"recovery.device: {name}, but this machine's torch sees no such CUDA device")
    return device


def check_seqlen(rcfg: RecoveryConfig, model_dir: Path) -> None:
    """ConfigError (one line) for training windows longer than the model's positions (a step would grind for minutes
    first)."""
    positions = model_positions(model_dir)
    if positions and rcfg.seqlen > positions:
        raise ConfigError(f"recovery.seqlen: {rcfg.seqlen} exceeds the model's {positions} positions")


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
    # such artifacts predate the held-out draw (compression_calibration), so the replay draws from every document
    return set(calibration_windows(path, tokenizer, calib.samples, calib.seqlen, calib.seed).document_ids)


def load_adapted_model(model_dir: Path, manifest: Manifest, tensors: dict, rcfg: RecoveryConfig,
                       device: torch.device):
    """The HF model (float32) with the artifact's modules in, those made trainable per rcfg.train; (model, names)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = swap_in_artifact(model, manifest, tensors)
    model.to(device)
    prepare_training(model, rcfg.train, rcfg.adapter_rank, rcfg.alpha, rcfg.seed, names)
    return model, names


def load_teacher(model_dir: Path, device: torch.device):
    """The dense source model (float32, eval, frozen): the distillation target."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def recovery_method(rcfg: RecoveryConfig) -> str:
    """The manifest's method string: `[distill-kl/]lora-on-factors` or `[distill-kl/]full-factors` (for a pruned
    artifact the "factors" are its narrower weights)."""
    trained = "lora-on-factors" if rcfg.train == "lora" else "full-factors"
    return f"distill-kl/{trained}" if rcfg.objective == "distill" else trained


def _objective_record(rcfg: RecoveryConfig) -> dict:
    """The manifest fields that say what was trained against what."""
    record = {"method": recovery_method(rcfg), "objective": rcfg.objective, "train": rcfg.train}
    if rcfg.objective == "distill":
        record["loss"] = "KL(teacher || student) per token, nats (sum over vocabulary, mean over tokens), T=1"
        if rcfg.hidden_loss:
            record["loss"] += (f" + {rcfg.hidden_loss} x mean squared difference of the RMS-normalised hidden states "
                               "after each of the student's own layers (not in the reported losses)")
        if ce := rcfg.cross_entropy_weight:
            record["loss"] += f" + {ce} x next-token cross-entropy on the text (not in the reported losses)"
        record["teacher"] = "the dense source model, float32"
    else:
        record["loss"] = "next-token cross-entropy per token, nats"
    if rcfg.train == "lora":
        record.update(adapter_rank=rcfg.adapter_rank, alpha=rcfg.alpha)
    return record


def recover_artifact(artifact_dir: Path, model_dir: Path, cfg: RecoveryConfig | None = None, *,
                     out_dir: Path | None = None, resume: bool = False, data_path: Path | None = None, stop_after: int | None = None) -> dict:
    """Recover an artifact's factors (cfg's objective and train) and rewrite it atomically with a "recovery" block.

    `cfg` None means RecoveryConfig's defaults. Returns the recovery block; if `stop_after` interrupts
    training, the artifact is left untouched (checkpoint only).
    """
    from transformers import AutoTokenizer

    rcfg = cfg or RecoveryConfig()
    check_seqlen(rcfg, Path(model_dir))  # both before the artifact and the data load
    device = pick_device(rcfg.device)
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir or artifact_dir)
    manifest, tensors = load_artifact(artifact_dir)
    if not manifest.replaced_modules():
        raise ConfigError(f"recover {artifact_dir}: the artifact has no low-rank or pruned modules to train (all "
                          f"kept dense)")
    check_model_hash(manifest, Path(model_dir), f"recover {artifact_dir}")
    torch.set_num_threads(rcfg.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = Path(data_path) if data_path else data_dir() / DEFAULT_DATA
    calibration = calibration_document_ids(manifest, path, tokenizer)
    held_out = evaluation_documents(path)
    docs, data_sha, num_excluded = recovery_documents(path, calibration | held_out)
    windows = token_windows(tokenizer, docs, rcfg.seqlen, max_windows=rcfg.windows or rcfg.steps * rcfg.batch_size)
    torch.manual_seed(rcfg.seed)
    model, names = load_adapted_model(Path(model_dir), manifest, tensors, rcfg, device)
    teacher = load_teacher(Path(model_dir), device) if rcfg.objective == "distill" else None
    t0 = time.perf_counter()
    ckpt = artifact_dir / CHECKPOINT_NAME
    run = train_adapters(model, windows, rcfg, ckpt, resume=resume, stop_after=stop_after, teacher=teacher)
    del teacher  # its ~0.5 GB is not needed for the merge and save
    if not run["completed"]:
        log.info("recovery stopped at step %d of %d; resume with --resume", len(run["losses"]), rcfg.steps)
        return {}
    merge_adapters(model)
    losses = run["losses"]
    tail = losses[-min(10, len(losses)):]
    block = {
        **_objective_record(rcfg),
        "steps": rcfg.steps, "batch_size": rcfg.batch_size, "seqlen": rcfg.seqlen, "tokens": run["tokens"],
        "lr": rcfg.learning_rate,
        "schedule": f"linear warmup {rcfg.warmup_steps} steps, cosine to {rcfg.min_lr_ratio}x",
        "optimizer": f"AdamW(weight_decay={rcfg.weight_decay}), grad-norm clip {rcfg.max_grad_norm}",
        "initial_loss": losses[0], "final_loss": sum(tail) / len(tail),
        "data": "c4-validation-sample.jsonl minus the compression calibration documents and the C4 evaluation "
                "split, file order",
        "data_sha256": data_sha, "calibration_documents_excluded": len(calibration),
        "evaluation_documents_excluded": len(held_out), "documents_excluded": num_excluded,
        "calibration": manifest.calibration.model_dump(include={"samples", "seqlen", "seed"})
        if manifest.calibration else None,
        # the modules' rel_error stays compression's: the whitened error needs the calibration pass it was made in
        "module_rel_error": "measured at compression, before this recovery changed the weights",
        "num_windows": len(windows), "epochs": round(rcfg.steps * rcfg.batch_size / len(windows), 3),
        "teacher_cache": run.get("teacher_cache"), "seed": rcfg.seed, "device": str(device),
        "wall_s": round(run["wall_s"], 2), "total_wall_s": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "config": rcfg.model_dump(),
    }
    if device.type == "cuda":
        block["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    carry = tuple(item for item in artifact_dir.iterdir() if item.is_file() and item.name not in (MANIFEST, FACTORS)
                  and not item.name.startswith("recovery-"))
    save_artifact(out_dir, manifest.model_copy(update={"recovery": block}), artifact_tensors(model, manifest), carry)
    ckpt.unlink(missing_ok=True)  # in-place: already gone with the old dir; --out: the source keeps none
    log.info("recovered %d modules (%s): loss %.3f -> %.3f in %.0f s", len(names), block["method"], losses[0],
             block["final_loss"], run["wall_s"])
    return block
