"""Perplexity the GPTQ/SVD-LLM way: tokenize the whole corpus once, non-overlapping windows, exp(mean token NLL)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from server.errors import ConfigError


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity over `num_windows` windows of `seqlen` tokens (`num_windows_total` available)."""

    corpus: str
    perplexity: float
    mean_nll: float
    seqlen: int
    num_windows: int
    num_windows_total: int
    num_tokens_scored: int

    def to_dict(self) -> dict:
        return asdict(self)


def token_windows(ids: torch.Tensor, seqlen: int, limit: int | None = None) -> torch.Tensor:
    """[num_windows, seqlen] non-overlapping windows from 1-D ids; the ragged tail is dropped (as the papers do)."""
    if seqlen < 2:
        raise ConfigError(f"--seqlen: must be at least 2, got {seqlen}")
    num = ids.numel() // seqlen
    if num == 0:
        raise ConfigError(f"corpus has {ids.numel()} tokens, fewer than one window of {seqlen}")
    if limit is not None:
        num = min(num, limit)
    return ids[: num * seqlen].view(num, seqlen)


@torch.inference_mode()
def windows_nll(model, windows: torch.Tensor, batch_size: int = 4, desc: str = "ppl") -> tuple[float, int]:
    """(sum of token NLLs, number of tokens) over windows; each window predicts its tokens 1..L-1."""
    total, count = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc=desc, unit="batch"):
        batch = windows[start:start + batch_size]
        logits = model(input_ids=batch, use_cache=False).logits
        # float64 sum: tens of thousands of per-token terms.
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        total += float(nll.double())
        count += batch[:, 1:].numel()
    return total, count


def perplexity(model, tokenizer, corpus: str, text: str, seqlen: int = 2048, limit: int | None = None,
               batch_size: int = 4) -> PerplexityResult:
    """Perplexity of `model` on `text` (already joined per the corpus protocol)."""
    # Default special tokens, as the papers call the tokenizer (a BOS once at the start for Llama-2; none here).
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)
    total_windows = ids.numel() // seqlen
    windows = token_windows(ids, seqlen, limit)
    nll, count = windows_nll(model, windows, batch_size, desc=f"ppl {corpus}")
    mean = nll / count
    return PerplexityResult(corpus, math.exp(mean), mean, seqlen, len(windows), total_windows, count)
