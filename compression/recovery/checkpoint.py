"""Atomic training checkpoints: adapter + optimizer + scheduler state, step and loss history."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "recovery-checkpoint.pt"


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` to a temp file beside `path`, then os.replace: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    log.info("checkpoint at step %d -> %s", state["step"], path)


def load_checkpoint(path: Path) -> dict | None:
    """The saved state, or None when no checkpoint exists."""
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
