"""The XᵀX shortcut for the manifest's rel_error equals the error measured on the activations themselves."""

import torch

from compression.whiten import activation_rel_error, damped_cholesky, plain_factors, whitened_factors


def test_rel_error_shortcut_equals_direct_activation_error():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 32, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, 32, dtype=torch.float64)
    W = torch.randn(48, 32, generator=g, dtype=torch.float64)
    G = X.T @ X
    L, _ = damped_cholesky(G)
    for A, B in (whitened_factors(W, L, 8), plain_factors(W, 8)):
        direct = float(torch.linalg.norm(X @ (W - B @ A).T) / torch.linalg.norm(X @ W.T))
        assert abs(activation_rel_error(W, A, B, G) - direct) < 1e-9
