"""Compression maths: rank budget, whitening, Cholesky fallback, float64 statistics."""

from __future__ import annotations

import pytest
import torch

from compression.rank import block_rank, low_rank_params, saves_parameters
from compression.whiten import activation_rel_error, damped_cholesky, plain_factors, whitened_factors


@pytest.mark.parametrize("in_f,out_f", [(576, 1536), (1536, 576), (64, 128), (4096, 11008)])
@pytest.mark.parametrize("keep", [0.9, 0.8, 0.6, 0.3])
@pytest.mark.parametrize("m", [1, 32, 128])
def test_rank_formula_meets_budget(in_f, out_f, keep, m):
    r = block_rank(in_f, out_f, keep, m)
    assert r % m == 0 and r >= m
    budget = in_f * out_f * keep
    # Rounded to the nearest multiple: within half a rank step of the budget (unless clamped to m).
    if r > m:
        assert abs(low_rank_params(in_f, out_f, r) - budget) <= (in_f + out_f) * m / 2 + 1e-6


def test_saves_parameters_keeps_dense_when_no_gain():
    assert not saves_parameters(576, 1536, 512)  # 512*(576+1536) > 576*1536
    assert not saves_parameters(64, 128, 64)  # full rank is no truncation
    assert saves_parameters(576, 1536, 128)


def _correlated_acts(n=2000, d=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) * torch.logspace(0, -3, d, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ mix


def test_whitened_beats_plain_on_activation_error():
    X = _correlated_acts()
    W = torch.randn(40, 48, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    xtx = X.T @ X
    L, _ = damped_cholesky(xtx)
    for rank in (4, 12, 24):
        e_w = activation_rel_error(W, *whitened_factors(W, L, rank), xtx)
        e_p = activation_rel_error(W, *plain_factors(W, rank), xtx)
        assert e_w < e_p
        # The error from XᵀX equals the error measured directly on the activations.
        A, B = whitened_factors(W, L, rank)
        direct = (torch.linalg.norm(X @ (W - B @ A).T) / torch.linalg.norm(X @ W.T)).item()
        assert abs(direct - e_w) < 1e-6


def test_full_rank_factors_reproduce_dense():
    X = _correlated_acts(d=32)
    W = torch.randn(20, 32, dtype=torch.float64)
    L, _ = damped_cholesky(X.T @ X)
    A, B = whitened_factors(W, L, 20)
    assert torch.allclose(B @ A, W, atol=1e-8)
    A, B = plain_factors(W, 20)
    assert torch.allclose(B @ A, W, atol=1e-10)


def test_cholesky_fallback_on_singular(caplog):
    x = torch.randn(100, 3, dtype=torch.float64)
    X = torch.cat([x, x[:, :1], torch.zeros(100, 2, dtype=torch.float64)], dim=1)  # rank-deficient
    xtx = X.T @ X
    xtx[4, 4] = -1e-3  # not even PSD: the first tries must fail
    L, lam = damped_cholesky(xtx)
    assert lam > 1e-3 * 1e-6 * float(xtx.diagonal().mean())
    assert torch.allclose(L @ L.T, xtx + lam * torch.eye(6, dtype=torch.float64))
    with pytest.raises(ValueError):
        damped_cholesky(torch.full((3, 3), float("nan"), dtype=torch.float64))


def test_gram_is_float64_symmetric_xtx_over_leading_dims():
    from compression.statistics import gram

    x = torch.randn(3, 17, 9, dtype=torch.float32)
    flat = x.reshape(-1, 9).to(torch.float64)
    g = gram(x)
    assert g.dtype == torch.float64 and g.shape == (9, 9)
    assert torch.equal(g, g.T)
    torch.testing.assert_close(g, flat.T @ flat, rtol=1e-12, atol=1e-10)


def test_gram_float32_is_symmetric_and_within_float32_rounding_of_the_float64_gram():
    from compression.statistics import gram, gram_float32

    x = torch.randn(4, 256, 48, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    g32, g64 = gram_float32(x), gram(x)
    assert g32.dtype == torch.float64 and torch.equal(g32, g32.T)
    scale = g64.diagonal().sqrt()
    relative = (g32 - g64) / torch.outer(scale, scale)  # error per entry against the Cauchy-Schwarz bound
    assert relative.abs().max() < 1e-5 and not torch.equal(g32, g64)
