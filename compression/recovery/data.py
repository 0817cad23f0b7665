"""Recovery training text: C4 sample documents that compression calibration did not use, as windows.

Split (documented in docs/BENCHMARKS.md): compression.calibration shuffles the documents with the
calibration seed and consumes them until samples x seqlen tokens, and the manifest records which
(`calibration.document_ids`); we exclude those documents and take the rest in file order.
WikiText-2 and PTB are untouched; `neuronmm eval`'s C4 perplexity reads every document of the
sample, so C4 perplexity after recovery is partly in-sample - WikiText-2/PTB are the held-out
measures.
"""

from __future__ import annotations

from pathlib import Path

import torch

from server.config import data_path
from server.errors import ConfigError
from server.fileio import file_sha256, read_jsonl_texts


def read_documents(path: Path) -> tuple[list[str], str]:
    """Every document text of a C4 jsonl file (file order) and the sha256 of the whole file."""
    path = data_path(path, "recovery data")
    return read_jsonl_texts(path), file_sha256(path)


def recovery_documents(path: Path, exclude: set[int] = frozenset()) -> tuple[list[str], str, int]:
    """(documents of `path` whose line index is not in `exclude`, in file order; file sha256; number excluded)."""
    docs, sha = read_documents(path)
    rest = [d for i, d in enumerate(docs) if i not in exclude]
    if not rest:
        raise ConfigError(f"{path}: every document went to calibration; none left for recovery")
    return rest, sha, len(docs) - len(rest)


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
