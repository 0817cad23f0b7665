"""Batched sampler: every row draws from exactly the distribution the full top-k/top-p filter defines."""

from __future__ import annotations

import pytest
import torch

from server.engine.sampler import NUM_CANDIDATES, apply_penalties, filter_top_k_top_p, sample, sample_scaled
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import Sequence
from server.models import fused_ops

VOCAB = 2000


def _empirical(scaled: torch.Tensor, top_k: int, top_p: float, draws: int = 4000) -> torch.Tensor:
    rows = scaled.expand(draws, -1)
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(1))
    tokens = sample_scaled(rows, torch.full((draws,), top_k), torch.full((draws,), top_p), uniform)
    return torch.bincount(tokens, minlength=scaled.shape[-1]).float() / draws


@pytest.mark.parametrize("top_k,top_p,spread", [
    (VOCAB, 0.6, 4.0), (5, 1.0, 4.0), (20, 0.7, 4.0), (VOCAB, 0.95, 4.0),  # inside the candidates
    (VOCAB, 1.0, 1.0), (VOCAB, 0.9, 0.1), (1000, 1.0, 1.0)])  # the whole-vocabulary fallbacks
def test_sampled_distribution_matches_full_filter(top_k, top_p, spread):
    scaled = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * spread
    expected = torch.softmax(filter_top_k_top_p(scaled.unsqueeze(0), torch.tensor([top_k]),
                                                 torch.tensor([top_p]))[0], dim=-1)
    got = _empirical(scaled, top_k, top_p)
    assert set(got.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert (got - expected).abs().max() < 0.03


def test_rows_with_different_settings_sample_independently():
    scaled = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 4
    tokens = sample_scaled(scaled, torch.tensor([1, VOCAB, VOCAB]), torch.tensor([1.0, 1.0, 1e-6]),
                           torch.tensor([0.9, 0.5, 0.9]))
    assert tokens[0] == scaled[0].argmax()  # top-k 1 is greedy
    assert tokens[2] == scaled[2].argmax()  # a tiny nucleus holds only the best token
    assert NUM_CANDIDATES < VOCAB


def test_penalties_apply_per_row_in_one_pass():
    seqs = []
    for freq, pres in ((1.0, 0.0), (0.0, 2.0), (0.0, 0.0)):
        seq = Sequence("r", 0, [1], SamplingParams(frequency_penalty=freq, presence_penalty=pres), detok=None)
        seq.output_ids = [3, 3, 5]
        seqs.append(seq)
    logits = apply_penalties(torch.zeros(3, 8), seqs)
    assert logits[0, 3] == -2.0 and logits[0, 5] == -1.0
    assert logits[1, 3] == -2.0 and logits[1, 5] == -2.0
    assert logits[2].abs().sum() == 0


def test_a_step_with_no_row_to_sample_samples_nothing():
    """Every sequence of a step still mid-prefill: the engine asks for no token."""
    assert sample(torch.zeros(0, 8), []) == ([], [])


needs_fused_ops = pytest.mark.skipif(not fused_ops.load(), reason="the fused CPU ops cannot be built here")


@needs_fused_ops
def test_fused_temperature_sampling_picks_the_torch_paths_token():
    """The one-pass C++ op lands where the torch inverse CDF lands, up to a rounding tie at a boundary."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 3000, generator=g) * 3
    temps = torch.rand(64, generator=g) + 0.3
    uniform = torch.rand(64, generator=g)
    want = sample_scaled(logits / temps.unsqueeze(1), torch.full((64,), 3000), torch.ones(64), uniform)
    got = torch.ops.neuronmm.sample_temperature(logits, 1.0 / temps, uniform)
    assert got.dtype == torch.long and got.shape == (64,)
    assert (got == want).sum() >= 62


@needs_fused_ops
def test_fused_temperature_sampling_never_picks_a_masked_token():
    """Grammar masks and logit_bias -inf: zero probability exactly, at the ends of the unit interval too."""
    logits = torch.full((5, 1000), float("-inf"))
    allowed = [3, 517, 998]
    logits[:, allowed] = torch.tensor([1.0, 0.0, -2.0])
    uniform = torch.tensor([0.0, 1e-9, 0.5, 1 - 1e-9, 1.0])
    got = torch.ops.neuronmm.sample_temperature(logits, torch.ones(5), uniform)
    assert set(got.tolist()) <= set(allowed)
    assert got[0] == 3 and got[-1] == 998


@needs_fused_ops
def test_fused_temperature_sampling_draws_the_softmax_distribution():
    scaled = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    draws = 4000
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(1))
    tokens = torch.ops.neuronmm.sample_temperature(scaled.expand(draws, -1).contiguous(), torch.full((draws,), 2.0),
                                                  uniform)
    got = torch.bincount(tokens, minlength=VOCAB).float() / draws
    assert (got - torch.softmax(scaled * 2.0, -1)).abs().max() < 0.03


@needs_fused_ops
@pytest.mark.parametrize("vocab", [1, 15, 16, 37, 49152])
def test_fused_argmax_is_torchs_argmax(vocab):
    """Greedy's fused argmax: torch.argmax's index for random rows, ties (the first wins, inside a vector's lanes,
    across lanes and in the scalar tail), and rows masked to -inf (0, or the one unmasked token)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    top = logits.max() + 1
    logits[1, vocab // 2:] = top  # a tie over the second half of the row
    logits[2, [vocab - 1, vocab // 3]] = top  # the earlier of two
    logits[3] = float("-inf")
    logits[4] = float("-inf")
    logits[4, vocab - 1] = 0.0
    got = torch.ops.neuronmm.argmax_rows(logits)
    assert got.dtype == torch.long and torch.equal(got, logits.argmax(dim=-1))


@needs_fused_ops
def test_greedy_rows_take_the_fused_argmax(monkeypatch):
    """sample() sends the greedy rows of CPU fp32 logits through the fused op, and other logits to torch."""
    calls = []
    fused = torch.ops.neuronmm.argmax_rows
    monkeypatch.setattr(torch.ops.neuronmm, "argmax_rows", lambda logits: calls.append(logits.shape) or fused(logits))
    seqs = [Sequence(f"r{i}", 0, [1, 2], SamplingParams(temperature=0.0), detok=None) for i in range(3)]
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    assert sample(logits, seqs)[0] == logits.argmax(dim=-1).tolist() and calls == [(3, 50)]
    assert sample(logits.double(), seqs)[0] == logits.argmax(dim=-1).tolist() and len(calls) == 1


def test_each_sampled_row_draws_one_uniform_and_plain_batches_take_the_fused_op(monkeypatch):
    """A row's token is where its own generator's next uniform falls; a batch of plain temperature rows goes through
    the fused op in one call, a batch with a filtered row through torch, with the same tokens as sample_scaled."""
    if not fused_ops.load():
        pytest.skip("the fused CPU ops are not built on this machine")
    calls = []
    fused = torch.ops.neuronmm.sample_temperature
    monkeypatch.setattr(torch.ops.neuronmm, "sample_temperature", lambda *a: calls.append(a[0].shape) or fused(*a))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    uniforms = torch.tensor([torch.rand(1, generator=torch.Generator().manual_seed(i)).item() for i in range(3)])

    def seqs(top_ps: list[float]) -> list[Sequence]:
        return [Sequence(f"r{i}", 0, [1, 2], SamplingParams(temperature=0.7, top_p=p), detok=None,
                         generator=torch.Generator().manual_seed(i)) for i, p in enumerate(top_ps)]

    for top_ps, fused_calls in (([1.0, 1.0, 1.0], 1), ([1.0, 0.5, 1.0], 1)):
        tokens, _ = sample(logits, seqs(top_ps))
        expected = sample_scaled(logits / 0.7, torch.full((3,), VOCAB), torch.tensor(top_ps), uniforms)
        assert tokens == expected.tolist() and len(calls) == fused_calls
