"""Recovery training text: the second half of the C4 sample's documents, cut into token windows.

Split (documented in docs/BENCHMARKS.md): documents are taken in file order; the first half
(index < n/2) is left to compression calibration, the second half is recovery training text.
WikiText-2 and PTB are untouched; `neuronmm eval`'s C4 perplexity reads every document of the
sample, so after recovery half of that text has been trained on - report WikiText-2/PTB as the
held-out measures.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from server.config import ConfigError


def recovery_documents(path: Path) -> tuple[list[str], str]:
    """The second-half documents of a C4 jsonl file and the sha256 of the whole file."""
    if not path.is_file():
        raise ConfigError(f"recovery data not found: {path} (set NEURONMM_DATA_DIR)")
    raw = path.read_bytes()
    docs = []
    for num, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                docs.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{path}:{num}: not a JSON object with a `text` field") from None
    if len(docs) < 2:
        raise ConfigError(f"{path}: needs at least 2 documents for the calibration/recovery split")
    return docs[len(docs) // 2:], hashlib.sha256(raw).hexdigest()


def token_windows(tokenizer, docs: list[str], seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """Documents joined with "\\n\\n", tokenized, cut into non-overlapping [num_windows, seqlen] windows."""
    ids: list[int] = []
    need = None if max_windows is None else max_windows * seqlen
    for doc in docs:
        ids.extend(tokenizer(doc + "\n\n", add_special_tokens=False)["input_ids"])
        if need is not None and len(ids) >= need:
            break
    num = len(ids) // seqlen if need is None else min(len(ids) // seqlen, max_windows)
    if num < 1:
        raise ConfigError(f"recovery text too short for one window of {seqlen} tokens")
    return torch.tensor(ids[: num * seqlen], dtype=torch.long).view(num, seqlen)


def batch_indices(step: int, num_windows: int, batch_size: int, seed: int) -> torch.Tensor:
    """Window indices of training step `step`: a seeded permutation per epoch, a pure function of step.

    Being a function of (step, seed) only is what makes `--resume` exact: no sampler state to save.
    """
    per_epoch = max(1, num_windows // batch_size)
    epoch, pos = divmod(step, per_epoch)
    perm = torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    idx = perm[pos * batch_size:(pos + 1) * batch_size]
    if len(idx) < batch_size:  # fewer windows than a batch: wrap around
        idx = perm[torch.arange(pos * batch_size, (pos + 1) * batch_size) % num_windows]
    return idx
