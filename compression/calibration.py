"""Seeded calibration windows: C4 documents in a seeded order, tokenized, concatenated, cut into windows."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import NamedTuple

import torch

from compression.evaluation.corpora import C4_EVAL_DOCUMENTS
from server.config import data_dir
from server.errors import ConfigError
from server.fileio import read_jsonl_texts

log = logging.getLogger(__name__)

DEFAULT_DATA = Path("c4") / "c4-validation-sample.jsonl"  # under data_dir(): the calibration and C4 evaluation file


class Calibration(NamedTuple):
    """Calibration token windows [num_samples, seqlen], the documents they came from (line order, sorted), and how
    many documents were left out of the draw."""

    windows: torch.Tensor
    document_ids: list[int]
    excluded: int = 0


def evaluation_documents(path: Path) -> set[int]:
    """Documents of `path` that `neuronmm eval` scores C4 perplexity on (none unless it is that file)."""
    c4 = data_dir() / DEFAULT_DATA
    return set(range(C4_EVAL_DOCUMENTS)) if c4.is_file() and path.resolve() == c4.resolve() else set()


def compression_calibration(path: Path, tokenizer, num_samples: int, seqlen: int, seed: int) -> Calibration:
    """The windows a compression calibrates on: calibration_windows without the C4 evaluation documents.

    Calibrating on text the evaluation then scores would flatter the compressed model's C4 perplexity (before
    2026-12-01, 19 of the default 67 calibration documents were among the 500 evaluated ones).
    """
    return calibration_windows(path, tokenizer, num_samples, seqlen, seed, exclude=evaluation_documents(path))


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
    return Calibration(torch.tensor(ids[:need], dtype=torch.long).view(num_samples, seqlen), sorted(used),
                       len(texts) - len(order))
