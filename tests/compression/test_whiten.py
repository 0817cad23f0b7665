"""Whitened SVD: exact at full rank, beats plain SVD on activations, survives a singular XᵀX."""

import logging

import torch

from compression.whiten import activation_rel_error, damped_cholesky, plain_factors, whitened_factors


def _data(seed=0, n=512, d_in=48, d_out=80):
    g = torch.Generator().manual_seed(seed)
    # Anisotropic activations with outlier channels, as in LLM MLP inputs.
    scales = torch.logspace(-2, 1, d_in, dtype=torch.float64)
    X = torch.randn(n, d_in, generator=g, dtype=torch.float64) * scales
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    return X, W


def test_full_rank_reproduces_dense():
    X, W = _data()
    L, _ = damped_cholesky(X.T @ X)
    A, B = whitened_factors(W, L, rank=min(W.shape))
    assert torch.allclose(X @ A.T @ B.T, X @ W.T, atol=1e-8 * float((X @ W.T).abs().max()))
    A, B = plain_factors(W, rank=min(W.shape))
    assert torch.allclose(B @ A, W, atol=1e-10)


def test_whitened_beats_plain_on_activations():
    X, W = _data(1)
    G = X.T @ X
    L, _ = damped_cholesky(G)
    for rank in (8, 16, 32):
        whitened = activation_rel_error(W, *whitened_factors(W, L, rank), G)
        plain = activation_rel_error(W, *plain_factors(W, rank), G)
        direct = float(torch.linalg.norm(X @ (W - whitened_factors(W, L, rank)[1] @ whitened_factors(W, L, rank)[0]).T)
                       / torch.linalg.norm(X @ W.T))
        assert abs(direct - whitened) < 1e-9  # the XᵀX shortcut is the real activation error
        assert whitened < 0.7 * plain


def test_cholesky_fallback_on_singular(caplog):
    v = torch.arange(1.0, 49.0, dtype=torch.float64)
    G = torch.outer(v, v)  # rank 1: no Cholesky without damping
    assert torch.linalg.cholesky_ex(G)[1] != 0
    start = 1e-20 * float(G.diagonal().mean())
    with caplog.at_level(logging.INFO, logger="compression.whiten"):
        L, lam = damped_cholesky(G, rel_damp=1e-20)
    assert lam >= 10 * start  # damping had to be raised
    assert "damping" in caplog.text
    assert torch.allclose(L @ L.T, G + lam * torch.eye(48, dtype=torch.float64), atol=1e-9 * float(G.max()))
    L0, lam0 = damped_cholesky(torch.zeros(4, 4))  # all-zero statistics still factor
    assert lam0 > 0 and torch.isfinite(L0).all()
