"""Atomic training checkpoints: adapter + optimizer + scheduler state, step and loss history."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from server.fileio import atomic_file

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "recovery-checkpoint.pt"


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` through server.fileio.atomic_file: a crash never leaves half a file."""
    with atomic_file(path) as tmp:
        torch.save(state, tmp)
    log.info("checkpoint at step %d -> %s", state["step"], path)


def load_checkpoint(path: Path) -> dict | None:
    """The saved state, or None when no checkpoint exists."""
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
