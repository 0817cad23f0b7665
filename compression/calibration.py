"""Seeded calibration windows: C4 documents in a seeded order, tokenized, concatenated, cut into windows."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import NamedTuple

import torch

from server.errors import ConfigError

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parent.parent
_SHARED_PREFIX = "../shared/data/"


def resolve_calib_path(calib_data: str) -> Path:
    """The config's compression.calib_data as a path: relative to the repo; $NEURONMM_DATA_DIR replaces ../shared/data."""
    env = os.environ.get("NEURONMM_DATA_DIR")
    if env and calib_data.startswith(_SHARED_PREFIX):
        path = Path(env).expanduser() / calib_data[len(_SHARED_PREFIX):]
    else:
        path = Path(calib_data).expanduser()
        path = path if path.is_absolute() else (_REPO / path)
    if not path.is_file():
        raise ConfigError(f"compression.calib_data: file not found: {path} (set NEURONMM_DATA_DIR)")
    return path.resolve()


def _texts(path: Path) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as fh:
        for num, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"compression.calib_data: {path}:{num} is not a JSON line with `text`") from None
    return texts


class Calibration(NamedTuple):
    """Calibration token windows [num_samples, seqlen] and the documents they came from (line order, sorted)."""

    windows: torch.Tensor
    document_ids: list[int]


def calibration_windows(path: Path, tokenizer, num_samples: int, seqlen: int, seed: int) -> Calibration:
    """Documents shuffled by seed, joined by EOS, cut end to end into [num_samples, seqlen] token ids."""
    texts = _texts(path)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    need, ids, used = num_samples * seqlen, [], []
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for i in order:
        ids.extend(tokenizer(texts[i], add_special_tokens=False)["input_ids"] + sep)
        used.append(i)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ConfigError(f"compression: {path} has {len(ids)} tokens, need {num_samples} x {seqlen} = {need}")
    log.info("calibration: %d windows x %d tokens from %s (seed %d)", num_samples, seqlen, path.name, seed)
    return Calibration(torch.tensor(ids[:need], dtype=torch.long).view(num_samples, seqlen), sorted(used))
