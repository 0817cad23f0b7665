"""The same kernels through the real compiler's CPU simulator (nki.simulate_kernel) when neuronxcc exists."""

from __future__ import annotations

import pytest
from conftest import assert_bf16_close

from neuronmm_kernels import compat
from neuronmm_kernels import reference as ref

pytestmark = pytest.mark.skipif(not compat.HAVE_NEURONXCC,
                                reason="neuronxcc is not importable (install the Neuron SDK 2.25 from AWS's pip "
                                       "index; PyPI's neuronx-cc is a placeholder)")


@pytest.mark.parametrize("num_tokens", [1, 77, 300])
def test_lowrank_matmul_simulated(make, num_tokens):
    from neuronmm_kernels.kernels.lowrank_matmul import lowrank_matmul

    x, u, v = make(num_tokens, 256, scale=1.0), make(256, 128), make(128, 640)
    y = compat.nki.simulate_kernel(lowrank_matmul, x, u, v)
    # simulate_kernel computes bf16 in fp32, so allow the reference's bf16 rounding as tolerance
    assert_bf16_close(y.astype(ref.BF16), ref.lowrank_matmul(x, u, v))


@pytest.mark.parametrize("num_tokens", [1, 45])
def test_lowrank_mlp_simulated(make, num_tokens):
    from neuronmm_kernels.kernels.lowrank_mlp import lowrank_mlp

    args = [make(num_tokens, 256, scale=1.0), make(256, 128), make(128, 384), make(256, 128), make(128, 384),
            make(384, 128), make(128, 256)]
    y = compat.nki.simulate_kernel(lowrank_mlp, *args, gate_block=128)
    assert_bf16_close(y.astype(ref.BF16), ref.lowrank_mlp(*args))



@pytest.mark.parametrize("num_tokens", [3, 300])
def test_feature_major_lowrank_matmul_simulated(make, num_tokens):
    """Xᵀ input (chunked, packed rows) and packed Yᵀ output through the real simulator."""
    import numpy as np

    from neuronmm_kernels.kernels.lowrank_matmul import lowrank_matmul

    x, u, v = make(num_tokens, 512, scale=1.0), make(512, 256), make(256, 512)
    y = compat.nki.simulate_kernel(lowrank_matmul, np.ascontiguousarray(x.T), u, v, transpose_in=True, row_pack=2,
                                   k_chunk=2)
    assert_bf16_close(y.astype(ref.BF16), ref.lowrank_matmul(x, u, v))
    yT = compat.nki.simulate_kernel(lowrank_matmul, x, u, v, transpose_out=True, out_pack=4)
    assert_bf16_close(yT.astype(ref.BF16), ref.lowrank_matmul(x, u, v, transpose_out=True))
