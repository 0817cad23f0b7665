"""Seeded calibration windows: C4 documents in a seeded order, tokenized, concatenated, cut into windows."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import NamedTuple

import torch

from server.errors import ConfigError
from server.fileio import read_jsonl_texts

log = logging.getLogger(__name__)


class Calibration(NamedTuple):
    """Calibration token windows [num_samples, seqlen] and the documents they came from (line order, sorted)."""

    windows: torch.Tensor
    document_ids: list[int]


def calibration_windows(path: Path, tokenizer, num_samples: int, seqlen: int, seed: int,
                        exclude: frozenset[int] | set[int] = frozenset()) -> Calibration:
    """Documents shuffled by seed, joined by EOS, cut end to end into [num_samples, seqlen] token ids.

    exclude: line indices of documents to skip (the seeded order of the others is unchanged), e.g. the calibration's
    own documents when cutting held-out windows from the same file.
    """
    texts = read_jsonl_texts(path)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    order = [i for i in order if i not in exclude]
    need, ids, used = num_samples * seqlen, [], []
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for i in order:
        ids.extend(tokenizer(texts[i], add_special_tokens=False)["input_ids"] + sep)
        used.append(i)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ConfigError(f"compression: {path} has {len(ids)} tokens{' outside the excluded documents' if exclude else ''}, "
                          f"need {num_samples} x {seqlen} = {need}")
    log.info("calibration: %d windows x %d tokens from %s (seed %d)", num_samples, seqlen, path.name, seed)
    return Calibration(torch.tensor(ids[:need], dtype=torch.long).view(num_samples, seqlen), sorted(used))
