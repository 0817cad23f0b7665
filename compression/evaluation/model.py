"""Load the model under evaluation: its transformers model (Llama family) in fp32, with an artifact if given."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from server.config import Config
from server.errors import ConfigError
from server.models.artifact import MANIFEST
from server.models.compressed import apply_artifact_to_hf
from server.models.source import model_positions, resolve_model_dir

log = logging.getLogger(__name__)


def load_eval_model(cfg: Config, compressed: str | Path | None = None, num_threads: int = 2):
    """(model, tokenizer, model_dir): the config's model in fp32 transformers, low-rank factors swapped in if given."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The CPU is shared; more threads than this only adds contention.
    torch.set_num_threads(max(1, min(num_threads, 2)))
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if compressed:
        path = Path(compressed).expanduser()
        if not (path / MANIFEST).is_file():
            raise ConfigError(f"--compressed: no {MANIFEST} in {path}")
        apply_artifact_to_hf(model, path)
        log.info("applied compressed artifact %s", path)
    return model, tokenizer, model_dir


def max_positions(cfg: Config) -> int:
    """The model's position limit, read from its config.json without loading weights."""
    return int(model_positions(resolve_model_dir(cfg.model, cfg.cache_path), 2048))


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters the model holds (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
