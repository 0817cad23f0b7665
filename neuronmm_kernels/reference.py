"""NumPy golden versions of every kernel, rounding to bf16 exactly where the kernels must.

Inputs are any float arrays (bf16 included); matmuls run in float32 like PSUM; a value that
becomes a TensorE operand or an output is rounded to bf16 (the output dtype).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _round(a, dtype=BF16) -> np.ndarray:
    return np.asarray(a).astype(dtype).astype(np.float32)


def silu(a: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in float32."""
    a = _f32(a)
    return a / (1.0 + np.exp(-a))


def dense_matmul(x, w) -> np.ndarray:
    """x [tokens, in] · w [in, out] -> bf16 [tokens, out]."""
    return (_f32(x) @ _f32(w)).astype(BF16)


def lowrank_matmul(x, u, v, transpose_out: bool = False) -> np.ndarray:
    """x · u · v with x·u rounded to bf16 (a TensorE operand) -> bf16 [tokens, out] (or transposed)."""
    y = (_round(_f32(x) @ _f32(u)) @ _f32(v)).astype(BF16)
    return np.ascontiguousarray(y.T) if transpose_out else y


def swiglu(g, u) -> np.ndarray:
    """silu(g) * u -> bf16, with silu(g) rounded to bf16 first (it is evicted to SBUF as bf16)."""
    return (_round(silu(g)) * _f32(u)).astype(BF16)


def lowrank_mlp(x, gate_u, gate_v, up_u, up_v, down_u, down_v) -> np.ndarray:
    """(silu(x·gate_u·gate_v) ⊙ (x·up_u·up_v))·down_u·down_v -> bf16 [tokens, hidden]."""
    x = _f32(x)
    gate = _round(x @ _f32(gate_u)) @ _f32(gate_v)  # fp32 in PSUM
    up = _round(x @ _f32(up_u)) @ _f32(up_v)
    h = _round(_round(silu(gate)) * up)
    return (_round(h @ _f32(down_u)) @ _f32(down_v)).astype(BF16)
