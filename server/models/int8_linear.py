"""int8 weights for the CPU panel GEMM (`--quantization int8`): the quantisation, the panel layout, and a reference.

Weights are quantised per output column (w ≈ s_n · q, q = round(w · 127 / max|w_n|) in -127..127); at run time
each row of x is quantised per 64 inputs the same way (csrc/int8_gemm.cpp), and y = s_n Σ_b s_b Σ r·q with the
block sums exact in int32. `int8_linear_ref` computes the same in plain torch (float64 sums), for tests and for
evaluating the quality cost without the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.models.lowrank import LowRankLinear

BLOCK = 64  # inputs of x per run-time scale (csrc/int8_gemm.cpp kBlock)
PANEL = 32  # output columns per panel


def int8_available() -> bool:
    """The int8 panel GEMM is in this CPU's fused-ops build (AVX512-VNNI, or AVX2 with fp32 activations)."""
    return hasattr(torch.ops.neuronmm, "panel_linear_int8")


def fits_int8(in_features: int) -> bool:
    """Whether a weight with this many inputs can take int8 panels (x is quantised per 64 inputs)."""
    return in_features % BLOCK == 0


def _quantise(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of v's last dimension: q = round(v · 127 / max|v|) (ties to even; 0 where max|v| is), scale =
    max|v| / 127, in fp32 as the kernel computes them."""
    v = v.float()
    peak = v.abs().amax(-1, keepdim=True)
    # a true division: `127.0 / peak` is computed as 127 · (1 / peak) by torch, rounded twice
    inv = torch.where(peak > 0, torch.full_like(peak, 127.0) / peak, torch.zeros_like(peak))
    return torch.round(v * inv), peak / 127.0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, scale [N] fp32) of a weight [N, K], per output column."""
    q, scale = _quantise(weight)
    return q.to(torch.int8), scale[:, 0]


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r [M, K] as fp32 integers, scale [M, K / 64]) of x [M, K], per 64 inputs of a row."""
    M, K = x.shape
    r, scale = _quantise(x.reshape(M, K // BLOCK, BLOCK))
    return r.reshape(M, K), scale[..., 0]


def pack_int8_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K a multiple of 64) -> int8 panels [ceil(N/32), K·32 + 128] uint8 for csrc/int8_gemm.cpp: per panel,
    q + 128 as [K/4][32][4] bytes, then the 32 columns' fp32 scales (zero columns pad N)."""
    N, K = weight.shape
    if not fits_int8(K):
        raise ValueError(f"int8 panels need in_features a multiple of {BLOCK}, got {K}")
    q, scale = quantize_weight(weight.detach())
    panels = (N + PANEL - 1) // PANEL
    padded = torch.zeros(panels * PANEL, K, dtype=torch.int16)
    padded[:N] = q
    codes = (padded + 128).to(torch.uint8).reshape(panels, PANEL, K // 4, 4).permute(0, 2, 1, 3)
    scales = torch.zeros(panels * PANEL, dtype=torch.float32)
    scales[:N] = scale
    return torch.cat([codes.reshape(panels, K * PANEL), scales.reshape(panels, PANEL).view(torch.uint8)], 1).contiguous()


def dequantize_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel sees it: each row's 64-input blocks quantised and scaled back (fp32)."""
    M, K = x.shape
    r, scale = quantize_rows_ref(x)
    return (r.reshape(M, K // BLOCK, BLOCK) * scale[..., None]).reshape(M, K)


def dequantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] as its int8 panels hold it (fp32)."""
    q, scale = quantize_weight(weight)
    return q.float() * scale[:, None]


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the int8 panel GEMM computes for x [M, K] and a weight [N, K], summed in float64, as fp32 (the kernel's
    output is in x's dtype: round to it to compare)."""
    return (dequantize_rows_ref(x).double() @ dequantize_weight(weight).double().T).float()


class Int8ReferenceLinear(nn.Module):
    """y = x Wᵀ as the int8 panel GEMM computes it, in plain torch: for evaluating the quality cost where the kernel
    is not (`neuronmm eval --quantization int8`; fp32 sums) and for tests (`sum_dtype` float64: closer to the
    kernel's exact block sums, so a model's activations round to the same int8 levels)."""

    def __init__(self, weight: torch.Tensor, sum_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("weight", dequantize_weight(weight.detach()).to(sum_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = dequantize_rows_ref(x.reshape(-1, x.shape[-1])).to(self.weight.dtype)
        return F.linear(flat, self.weight).to(x.dtype).reshape(*x.shape[:-1], -1)


def quantize_linears_ref(model: nn.Module, sum_dtype: torch.dtype = torch.float32) -> int:
    """Swap every bias-free Linear (and each factor of a LowRankLinear) whose K fits int8 panels for an
    Int8ReferenceLinear, in place; returns how many weights were quantised."""
    count = 0
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear and child.bias is None and fits_int8(child.in_features):
            setattr(model, name, Int8ReferenceLinear(child.weight, sum_dtype))
            count += 1
        elif isinstance(child, LowRankLinear) and child.bias is None:
            factors = [Int8ReferenceLinear(w, sum_dtype) if fits_int8(w.shape[1]) else _linear(w)
                       for w in (child.A, child.B)]
            setattr(model, name, nn.Sequential(*factors))
            count += sum(isinstance(f, Int8ReferenceLinear) for f in factors)
        else:
            count += quantize_linears_ref(child, sum_dtype)
    return count


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return layer
