"""Sampler: the candidate fast path draws from exactly the distribution the full top-k/top-p filter defines."""

from __future__ import annotations

import pytest
import torch

from server.engine.sampler import _filter_top_k_top_p, _sample_candidates


def _empirical(scaled, top_k, top_p, draws=6000):
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(scaled.shape[-1])
    for _ in range(draws):
        token = _sample_candidates(scaled, top_k, top_p, gen)
        assert token is not None
        counts[token] += 1
    return counts / draws


@pytest.mark.parametrize("top_k,top_p", [(0, 0.6), (5, 1.0), (20, 0.7), (0, 0.95)])
def test_candidate_path_matches_full_filter(top_k, top_p):
    torch.manual_seed(0)
    scaled = torch.randn(5000) * 4  # peaked enough that the nucleus fits in the candidates
    expected = torch.softmax(_filter_top_k_top_p(scaled, top_k, top_p), dim=-1)
    got = _empirical(scaled, top_k, top_p)
    assert set(got.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert (got - expected).abs().max() < 0.03


def test_candidate_path_declines_when_nucleus_is_wider_than_candidates():
    flat = torch.zeros(5000)  # uniform: a 0.9 nucleus holds 4500 tokens
    assert _sample_candidates(flat, 0, 0.9, None) is None
    assert _sample_candidates(flat, 0, 1.0, None) is None  # unfiltered sampling needs the full vocab
    assert _sample_candidates(flat, 1000, 1.0, None) is None  # large top-k: normaliser needs all k
    assert _sample_candidates(flat, 8, 1.0, None) is not None
