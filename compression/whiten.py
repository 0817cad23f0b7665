"""Damped Cholesky whitening and truncated-SVD factors (whitened SVD-LLM style, or plain)."""

from __future__ import annotations

import logging

import scipy.linalg
import torch

log = logging.getLogger(__name__)


def damped_cholesky(xtx: torch.Tensor, rel_damp: float = 1e-6, max_tries: int = 12) -> tuple[torch.Tensor, float]:
    """(L lower-triangular with L Lᵀ = XᵀX + λI, λ): λ starts at rel_damp·mean(diag), ×10 until it factors."""
    xtx = xtx.to(torch.float64)
    scale = float(xtx.diagonal().mean()) or 1.0
    eye = torch.eye(xtx.shape[0], dtype=xtx.dtype)
    lam = rel_damp * scale
    for attempt in range(max_tries):
        L, info = torch.linalg.cholesky_ex(xtx + lam * eye)
        if int(info) == 0 and torch.isfinite(L).all():
            if attempt:
                log.info("XᵀX needed damping %.3g (%.1e x mean diagonal) to factor", lam, lam / scale)
            return L, lam
        lam *= 10
    raise ValueError(f"XᵀX did not factor even with damping {lam:.3g} (non-finite statistics?)")


def _svd(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # LAPACK gesdd through SciPy: several times faster than torch's CPU SVD in float64 here.
    U, sigma, Vh = scipy.linalg.svd(M.numpy(), full_matrices=False, lapack_driver="gesdd", check_finite=False)
    return torch.from_numpy(U), torch.from_numpy(sigma), torch.from_numpy(Vh)


def whitened_factors(weight: torch.Tensor, L: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rank, in], B [out, rank] minimising ‖(W − BA) L‖: SVD(W L) = UΣVᵀ, A = √Σr Vrᵀ L⁻¹, B = Ur √Σr."""
    W = weight.to(torch.float64)
    U, sigma, Vh = _svd(W @ L)
    root = sigma[:rank].sqrt()
    C = root[:, None] * Vh[:rank]  # [rank, in]
    # A L = C  <=>  Lᵀ Aᵀ = Cᵀ; Lᵀ is upper-triangular, so a triangular solve (no explicit inverse).
    A = torch.linalg.solve_triangular(L.T, C.T, upper=True).T
    B = U[:, :rank] * root[None, :]
    return A, B


def plain_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of W itself (the baseline that ignores activations)."""
    U, sigma, Vh = _svd(weight.detach().to(torch.float64))
    root = sigma[:rank].sqrt()
    return root[:, None] * Vh[:rank], U[:, :rank] * root[None, :]


def activation_rel_error(weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, xtx: torch.Tensor) -> float:
    """‖X(W − BA)ᵀ‖_F / ‖XWᵀ‖_F on the calibration activations, from XᵀX (no activations kept)."""
    W = weight.to(torch.float64)
    G = xtx.to(torch.float64)
    D = W - B.to(torch.float64) @ A.to(torch.float64)
    num = float(((D @ G) * D).sum())
    den = float(((W @ G) * W).sum())
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else 0.0
