"""LowRankLinear: a Linear replaced by its two SVD factors, y = (x Aᵀ) Bᵀ."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LowRankLinear(nn.Module):
    """y = (x Aᵀ) Bᵀ with A [rank, in_features] and B [out_features, rank] (nn.Linear layouts).

    In kernel terms this is X·U·V with U = Aᵀ [in, rank] and V = Bᵀ [rank, out].
    """

    def __init__(self, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise ValueError(f"LowRankLinear: A {tuple(A.shape)} and B {tuple(B.shape)} do not chain")
        self.A = nn.Parameter(A.contiguous(), requires_grad=False)
        self.B = nn.Parameter(B.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def in_features(self) -> int:
        return self.A.shape[1]

    @property
    def out_features(self) -> int:
        return self.B.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, rank={self.rank}, out={self.out_features}"
