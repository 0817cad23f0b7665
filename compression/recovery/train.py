"""The recovery training loop: next-token or distillation loss, AdamW, warmup + cosine LR, clipping, checkpoints."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from compression.recovery.adapter import adapter_parameters
from compression.recovery.checkpoint import load_checkpoint, save_checkpoint
from compression.recovery.data import batch_indices
from compression.recovery.distill import TeacherCache, can_cache_teacher, distill_backward, shared_prefix_layers
from server.config import RecoveryConfig
from server.errors import ConfigError

log = logging.getLogger(__name__)

# Above this the teacher runs again in every epoch instead of its states being held: 990 MiB of cache put the default
# model's one-command recipe at 4.97 GiB peak RSS, so 1.5 GiB stays inside issue 18's 6 GiB budget.
TEACHER_CACHE_LIMIT = 3 << 29


def lr_factor(step: int, cfg: RecoveryConfig) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def step_backward(model: nn.Module, batch: torch.Tensor, cfg: RecoveryConfig, teacher: nn.Module | None,
                  shared_layers: int = 0, cache: TeacherCache | None = None,
                  indices: torch.Tensor | None = None) -> float:
    """One batch's loss, its gradients accumulated into .grad: next-token cross-entropy, or KL to the teacher
    (whose states for the windows `indices` come from `cache` when given)."""
    if cfg.objective == "next_token":
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.item()
    states = None if cache is None else cache.states(teacher, batch, indices, shared_layers)
    return distill_backward(model, teacher, batch, shared_layers, states=states, hidden_weight=cfg.hidden_loss,
                            ce_weight=cfg.cross_entropy_weight)


def train_adapters(model: nn.Module, windows: torch.Tensor, cfg: RecoveryConfig, ckpt_path: Path,
                   resume: bool = False, stop_after: int | None = None, teacher: nn.Module | None = None,
                   cache_teacher: bool = True) -> dict:
    """Train the model's recovery parameters for cfg.steps; returns {losses, tokens, wall_s, resumed_from, ...}.

    `teacher` (frozen, eval) is required with cfg.objective "distill"; when the steps revisit windows (more
    steps × batch than windows) its states are cached per window unless `cache_teacher` is off. `stop_after` ends
    the run early after that many steps (tests use it to simulate an interruption).
    """
    if cfg.objective == "distill" and teacher is None:
        raise ValueError("objective distill needs a teacher model")
    device = next(model.parameters()).device
    params = adapter_parameters(model)
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    start, losses, wall_before = 0, [], 0.0
    state = load_checkpoint(ckpt_path) if resume else None
    if resume and state is None:
        log.warning("--resume: no checkpoint at %s; training from the first step", ckpt_path)
    if state is not None:
        if state["config"] != cfg.fingerprint():
            raise ConfigError(f"{ckpt_path}: checkpoint was written with other recovery settings; drop --resume")
        for p, saved in zip(params, state["adapters"], strict=True):
            p.data.copy_(saved)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start, losses, wall_before = state["step"], list(state["losses"]), state["wall_s"]
        log.info("resuming recovery at step %d of %d", start, cfg.steps)
    shared = shared_prefix_layers(model, teacher) if cfg.objective == "distill" else 0
    if shared:
        log.info("distillation: the student starts from the teacher's hidden state after %d shared layers", shared)
    cache = None
    if cfg.objective == "distill" and cfg.steps * cfg.batch_size > len(windows) and cache_teacher \
            and can_cache_teacher(model, teacher):
        layers = cfg.hidden_loss > 0  # then the states after every unshared layer but the last are targets too
        per_window = (1 if shared else 0) + 1 + (len(model.base_model.layers) - shared - 1 if layers else 0)
        need = TeacherCache.bytes_needed(len(windows), windows.shape[1], teacher.config.hidden_size, per_window)
        if need <= TEACHER_CACHE_LIMIT:
            cache = TeacherCache(layers)
        else:
            log.warning("windows are revisited but caching the teacher's states would take %.1f GiB (limit %.1f): "
                        "the teacher runs on every step", need / 2**30, TEACHER_CACHE_LIMIT / 2**30)
    model.train()
    t0 = time.perf_counter()
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc="recovery", unit="step")
    for step in bar:
        indices = batch_indices(step, len(windows), cfg.batch_size, cfg.seed)
        batch = windows[indices].to(device)
        opt.zero_grad(set_to_none=True)
        loss = step_backward(model, batch, cfg, teacher, shared, cache, indices)
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        losses.append(loss)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == end:
            save_checkpoint(ckpt_path, {
                "step": done, "losses": losses, "config": cfg.fingerprint(),
                "adapters": [p.detach().cpu().clone() for p in params],
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "wall_s": wall_before + time.perf_counter() - t0})
    model.eval()
    run = {"losses": losses, "tokens": len(losses) * cfg.batch_size * cfg.seqlen,
           "wall_s": wall_before + time.perf_counter() - t0, "resumed_from": start,
           "completed": len(losses) >= cfg.steps}
    if cache is not None:
        run["teacher_cache"] = {"batches_from_cache": cache.hits, "batches_run": cache.misses,
                                "mib": round(cache.nbytes / 2**20, 1)}
        log.info("teacher cache: %d batches read, %d run, %.0f MiB", cache.hits, cache.misses, cache.nbytes / 2**20)
    return run
