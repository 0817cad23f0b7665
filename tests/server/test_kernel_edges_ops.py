"""Edges of the fused elementwise ops (csrc/fused_ops.cpp) the main tests leave out: fp16 (which they dispatch), widths
that leave a vector tail, rows split between threads mid-row, Qwen3's head norms at head widths off 64, and argmax
over vocabularies around a vector's 16 lanes."""

import pytest
import torch

from server.models import fused_ops

pytestmark = pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(dtype) -> dict:
    """fp32: the sums of squares and SiLU's exp differ from ATen's in the last bits; bf16 / fp16: a rounding of the
    output apart where those land on either side of a tie (2^-8 / 2^-11 relative, with room)."""
    return {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
            torch.float16: dict(rtol=2e-3, atol=2e-3)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_norms_and_silu_at_tail_widths(dtype, threads):
    """Rows past the 8-row grain (9, 17) and widths of 1, 17, 33 and 1,000 (no whole vector, a lane over, a long tail;
    SiLU's 1,024-value grain ends mid-row), weights in fp32 under narrower activations."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    for rows, hidden in [(1, 1), (9, 17), (17, 33), (3, 1000)]:
        x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
        y = torch.randn(rows, hidden, generator=g).to(dtype)
        w = 1 + 0.1 * torch.randn(hidden, generator=g)
        torch.testing.assert_close(torch.ops.neuronmm.rms_norm(x, w, 1e-6), fused_ops.rms_norm_ref(x, w, 1e-6),
                                   **_tol(dtype))
        ours, ref = x.clone(), x.clone()
        torch.testing.assert_close(torch.ops.neuronmm.add_rms_norm(ours, y, w, 1e-6),
                                   fused_ops.add_rms_norm_ref(ref, y, w, 1e-6), **_tol(dtype))
        assert torch.equal(ours, ref)  # the residual, rounded once to the dtype as the reference rounds it
        gate_up = (torch.randn(rows, 2 * hidden, generator=g) * 4).to(dtype)
        torch.testing.assert_close(torch.ops.neuronmm.silu_mul(gate_up), fused_ops.silu_mul_ref(gate_up),
                                   **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norms_at_head_widths_off_64(dtype):
    """Qwen3's per-head q and k norms at head widths 8, 24 and 128, groups of 1 and 3; the value heads untouched."""
    g = torch.Generator().manual_seed(1)
    for head_dim, q_heads, kv_heads in [(8, 2, 2), (24, 6, 2), (128, 3, 1)]:
        qkv = torch.randn(5, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
        q_weight, k_weight = ((1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2))
        ours, ref = qkv.clone(), qkv.clone()
        torch.ops.neuronmm.head_rms_norm_(ours, q_weight, k_weight, q_heads, kv_heads, 1e-6)
        fused_ops.head_rms_norm_ref(ref, q_weight, k_weight, q_heads, kv_heads, 1e-6)
        torch.testing.assert_close(ours, ref, **_tol(dtype))
        values = slice((q_heads + kv_heads) * head_dim, None)
        assert torch.equal(ours[:, values], qkv[:, values])


@pytest.mark.parametrize("vocab", [2, 17, 31, 33, 257])
def test_argmax_around_a_vectors_lanes(vocab):
    """The first of equal maxima in the vector part against one in the scalar tail, and a row whose only finite
    value sits in the tail: torch.argmax's index."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    top = logits.max() + 1
    logits[1, [vocab - 1, 0]] = top  # the earlier, in the first lane
    logits[2] = float("-inf")
    logits[2, vocab - 1] = -1e30
    logits[3, vocab // 2:] = top
    assert torch.equal(torch.ops.neuronmm.argmax_rows(logits), logits.argmax(dim=-1))
