"""Batched token selection: one vectorised pass over all sequences of a step.

Every sampled row draws one uniform number from its own generator (so a seed reproduces its sequence
whatever else is in the batch) and picks the token where that number falls in the row's cumulative
distribution (inverse-CDF sampling). Rows with plain temperature sampling (no top-k, no top-p: what
most clients send) go straight to the whole vocabulary: one softmax and a two-level cumulative sum.
Top-k and top-p usually cut the distribution to its few hundred most likely tokens, so rows whose
filtered distribution provably lies inside the leading candidates are sampled there; the rest use
the whole vocabulary.
"""

from __future__ import annotations

import torch

from server.engine.logits_processors import apply_logits_processors
from server.models import fused_ops
from server.engine.sequence import Sequence, TokenLogprob

# Leading candidates per row: the nucleus and the top-k set of real requests almost always fit.
NUM_CANDIDATES = 256


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over each sequence's generated tokens (in place, one scatter)."""
    rows = [(row, seq) for row, seq in enumerate(seqs) if seq.params.has_penalties and seq.output_ids]
    if not rows:
        return logits
    row_ids = torch.tensor([row for row, seq in rows for _ in seq.output_ids], device=logits.device)
    token_ids = torch.tensor([t for _, seq in rows for t in seq.output_ids], device=logits.device)
    counts = torch.zeros(len(seqs), logits.shape[-1], dtype=logits.dtype, device=logits.device)
    counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=logits.dtype), accumulate=True)
    freq = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=logits.dtype, device=logits.device)
    pres = torch.tensor([s.params.presence_penalty for s in seqs], dtype=logits.dtype, device=logits.device)
    logits -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask scaled logits [rows, vocab] outside each row's top-k set and smallest top-p nucleus (full sort)."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    cols = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(cols >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p.unsqueeze(1)  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Column index per row where uniform [rows] falls in the row's (unnormalised) cumulative probs.

    Two levels, so a whole-vocabulary row costs one pass: cumulative sums of blocks of columns pick
    the block, then the cumulative sum inside that block picks the column (fp64 where sums are long).
    """
    rows, cols = probs.shape
    block = _CDF_BLOCK if cols > _CDF_BLOCK else cols
    padded = -cols % block
    if padded:
        probs = torch.cat([probs, probs.new_zeros(rows, padded)], dim=1)
    blocks = probs.view(rows, -1, block)
    # fp32 sums of 256 columns lose nothing that matters; only the running sum over blocks needs fp64
    block_cum = blocks.sum(-1).double().cumsum(-1)  # [rows, num_blocks]
    target = uniform.double() * block_cum[:, -1]
    chosen = torch.searchsorted(block_cum, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(chosen > 0, block_cum.gather(1, (chosen - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), chosen].double().cumsum(-1)  # [rows, block]
    offset = torch.searchsorted(inner, (target - before).unsqueeze(1), right=True).squeeze(1)
    last_positive = (inner < inner[:, -1:]).sum(-1)  # rounding must never land on a zero-probability column
    offset = torch.minimum(offset, last_positive)
    return (chosen * block + offset).clamp_(max=cols - 1)


# Columns per block of the two-level inverse CDF (about the square root of a large vocabulary).
_CDF_BLOCK = 256


def sample_scaled(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  uniform: torch.Tensor) -> torch.Tensor:
    """Token ids [rows] from temperature-scaled logits [rows, vocab] under per-row top_k (vocab: off), top_p.

    Exact for every row: plain temperature rows sample the whole vocabulary; filtered rows sample among
    the leading NUM_CANDIDATES tokens only when the filtered distribution lies inside them.
    """
    unfiltered = (top_k >= scaled.shape[-1]) & (top_p >= 1.0)
    if bool(unfiltered.all()):  # the common batch: no gathers, no sort
        return _inverse_cdf(scaled.softmax(-1), uniform)
    tokens = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)
    plain, filtered = unfiltered.nonzero().squeeze(1), (~unfiltered).nonzero().squeeze(1)
    if plain.numel():
        tokens[plain] = _inverse_cdf(scaled[plain].softmax(-1), uniform[plain])
    tokens[filtered] = _sample_filtered(scaled[filtered], top_k[filtered], top_p[filtered], uniform[filtered])
    return tokens


def _sample_filtered(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     uniform: torch.Tensor) -> torch.Tensor:
    """sample_scaled for rows with a top-k or top-p filter: among the leading candidates where they cover it."""
    vocab = scaled.shape[-1]
    k = min(NUM_CANDIDATES, vocab)
    values, ids = torch.topk(scaled, k, dim=-1)
    in_top_k = torch.arange(k, device=scaled.device) < top_k.unsqueeze(1)
    values = values.masked_fill(~in_top_k, float("-inf"))
    # top-k within the candidates renormalises over them; otherwise the normaliser is the whole vocabulary
    small_k = top_k <= k
    log_norm = torch.where(small_k, torch.logsumexp(values, -1), torch.logsumexp(scaled, -1))
    probs = (values - log_norm.unsqueeze(1)).exp()
    cum = probs.cumsum(-1)
    probs = probs * (cum - probs < top_p.unsqueeze(1))
    covered = small_k | ((top_k == vocab) & (cum[:, -1] >= top_p))
    tokens = ids.gather(1, _inverse_cdf(probs, uniform).unsqueeze(1)).squeeze(1)
    rest = (~covered).nonzero().squeeze(1)
    if rest.numel():
        rest_scaled = filter_top_k_top_p(scaled[rest], top_k[rest], top_p[rest])
        tokens[rest] = _inverse_cdf(rest_scaled.softmax(-1), uniform[rest])
    return tokens


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    params = [s.params for s in seqs]
    uniform = torch.tensor([torch.rand(1, generator=s.generator).item() for s in seqs], device=logits.device)
    # A draw of exactly 0 (torch.rand gives one in 2^24) would pick the first column of positive probability: the
    # fused op's fast exp floors at ~1e-38 rather than 0, so that could be a token at -150 under the row's best.
    uniform.clamp_(min=2.0**-25)
    # Plain temperature rows are told apart in Python, with one tensor built: right after a step the caches hold the
    # weights streamed, not the interpreter's data, and each small tensor op then costs ~20 us (the three tensors, the
    # filter test and the division here took ~250 us of a 6.6 ms batch-1 step under the AVX2 caps, 40 us alone).
    if all(not 0 < p.top_k < vocab and p.top_p >= 1.0 for p in params) and _fused_ops_apply(logits):
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        return torch.ops.neuronmm.sample_temperature(logits, temps.reciprocal_(), uniform)  # one pass a row
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    return sample_scaled(logits / temps.unsqueeze(1), top_k, top_p, uniform)


def _fused_ops_apply(logits: torch.Tensor) -> bool:
    """The fused CPU sampling ops apply: contiguous fp32 CPU logits and the fused ops built on this machine."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and fused_ops.load())


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the fused op where it applies (torch's CPU argmax takes ~0.5 ms for 16 rows of a 49k vocab)."""
    return torch.ops.neuronmm.argmax_rows(logits) if _fused_ops_apply(logits) else logits.argmax(dim=-1)


def check_draft(rows: torch.Tensor, draft: list[int], seq: Sequence) -> list[int]:
    """The tokens a checked speculative draft gives (rows[i]: fp32 logits after the draft's first i tokens).

    Greedy: the draft's lead the argmax agrees with, then the argmax. Sampled (temperature, top-k, top-p): each
    draft token is kept with the probability the model's distribution gives it, the first one refused is replaced
    by a draw from that distribution without it, and after a wholly kept draft the model draws the next token:
    for a draft proposed without the model (a one-hot guess) this is exactly sampling token by token.
    """
    if seq.params.is_greedy:
        picks = argmax(rows).tolist()
        agreed = 0
        while agreed < len(draft) and draft[agreed] == picks[agreed]:
            agreed += 1
        return draft[:agreed] + [picks[agreed]]
    probs = _distributions(rows, seq)
    tokens = []
    for row, guess in enumerate(draft):
        if torch.rand(1, generator=seq.generator).item() < probs[row, guess].item():
            tokens.append(guess)
            continue
        rest = probs[row:row + 1].clone()
        rest[0, guess] = 0.0
        return tokens + [int(_inverse_cdf(rest, torch.rand(1, generator=seq.generator))[0])]
    return tokens + [int(_inverse_cdf(probs[-1:], torch.rand(1, generator=seq.generator))[0])]


def _distributions(rows: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The sequence's sampling distribution over each row: temperature, then its top-k and top-p."""
    params, vocab = seq.params, rows.shape[-1]
    scaled = rows.float() / params.temperature
    if 0 < params.top_k < vocab or params.top_p < 1.0:
        top_k = torch.full((rows.shape[0],), params.top_k if 0 < params.top_k < vocab else vocab, device=rows.device)
        top_p = torch.full((rows.shape[0],), params.top_p, dtype=scaled.dtype, device=rows.device)
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(-1)


def _logprobs(raw_logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    top = []
    if num_top > 0:
        values, ids = torch.topk(raw_logprobs, num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(raw_logprobs[token]), top)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of fp32 logits [num_seqs, vocab]; logprobs are of the model's raw distribution."""
    if not seqs:
        return [], []
    wants_logprobs = [seq.params.logprobs is not None for seq in seqs]
    raw = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None
    logits = apply_penalties(logits, seqs)
    apply_logits_processors(logits, seqs)
    sampled = [row for row, seq in enumerate(seqs) if not seq.params.is_greedy]
    if len(sampled) == len(seqs):  # no greedy row: no argmax, no row gather
        tokens = _sample_rows(logits, seqs)
    else:
        tokens = argmax(logits)
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            tokens[rows] = _sample_rows(logits[rows], [seqs[row] for row in sampled])
    tokens = tokens.tolist()
    lps = [(_logprobs(raw[row], tokens[row], seq.params.logprobs) if wants_logprobs[row] else None)
           for row, seq in enumerate(seqs)]
    return tokens, lps
