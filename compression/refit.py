"""Closed-form refit of a truncated matrix's B factor on the compressed model's inputs against the dense outputs.

The whitened SVD minimises ‖X_c (W − BA)ᵀ‖ on the compressed model's own inputs X_c, i.e. it reproduces what the
dense matrix would output *on the already-damaged inputs*. The refit instead targets what the dense model actually
outputs, X_d Wᵀ (X_d: the dense model's inputs to the same matrix), so each layer can absorb part of the error the
layers before it left: with A fixed, B = argmin ‖X_c Aᵀ Bᵀ − X_d Wᵀ‖² + λ‖B − B₀‖², a ridge toward the SVD's B₀.
"""

from __future__ import annotations

import torch


def refit_b(weight: torch.Tensor, A: torch.Tensor, B0: torch.Tensor, xtx_c: torch.Tensor, cross: torch.Tensor,
            damp: float) -> torch.Tensor:
    """B [out, rank] = (W C Aᵀ + λB₀)(A S Aᵀ + λI)⁻¹ with S = X_cᵀX_c [in, in], C = X_dᵀX_c [in, in] (float64).

    λ = damp · mean diag(A S Aᵀ): the ridge keeps directions the calibration barely excites near the SVD's B₀.
    """
    W, A, B0 = (t.to(torch.float64) for t in (weight, A, B0))
    G = A @ xtx_c.to(torch.float64) @ A.T  # [rank, rank]: Gram of the compressed inputs projected by A
    target = W @ cross.to(torch.float64) @ A.T  # [out, rank]: dense outputs against the projected inputs
    lam = damp * float(G.diagonal().mean())
    eye = torch.eye(G.shape[0], dtype=G.dtype)
    # G + λI is symmetric positive definite (λ > 0 or G full rank): solve Bᵀ from (G + λI) Bᵀ = (target + λB₀)ᵀ.
    return torch.linalg.solve(G + lam * eye, (target + lam * B0).T).T


def dense_output_rel_error(weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, xtx_c: torch.Tensor,
                           cross: torch.Tensor, dense_sq: float) -> float:
    """‖X_c Aᵀ Bᵀ − X_d Wᵀ‖_F / ‖X_d Wᵀ‖_F from the statistics (dense_sq = ‖X_d Wᵀ‖²_F, measured in the dense pass)."""
    W, A, B = (t.to(torch.float64) for t in (weight, A, B))
    G = A @ xtx_c.to(torch.float64) @ A.T
    target = W @ cross.to(torch.float64) @ A.T
    err = dense_sq - 2 * float((target * B).sum()) + float(((B @ G) * B).sum())
    return (max(err, 0.0) / dense_sq) ** 0.5 if dense_sq > 0 else 0.0
