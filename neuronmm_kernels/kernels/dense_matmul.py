"""Dense baseline Y = X·W in the style of AWS's tutorial matmul (blocked, hoisted weight-column loads)."""

from ..compat import nki, nl
from ._blocks import P, blocks, load_transposed, num_tiles, store_natural, transpose_identity


@nki.jit
def dense_matmul(x, w, token_block=512, out_block=512):
    """y = x · w.

    Layouts (HBM, row-major): x [num_tokens, in_features], w [in_features, out_features] -> y
    [num_tokens, out_features]. dtypes: bf16 in/out, or fp32 (4x TensorE cost; Xᵀ then comes from
    identity matmuls, since the PE transpose of fp32 is inexact on trn1); fp32 PSUM accumulation. Limits: num_tokens, in_features, out_features >= 1 (tails of
    128/512 handled); token_block <= 512, out_block a multiple of 512 (or the tail).
    Schedule: per token block, Xᵀ via on-chip transposes; per out_block columns, W block hoisted into SBUF,
    then per 128 tokens x 512 columns a PSUM accumulation over in_features.
    """
    num_tokens, d_in = x.shape
    assert w.shape[0] == d_in, (x.shape, w.shape)
    assert 1 <= token_block <= 512
    y = nl.ndarray((num_tokens, w.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    ident = transpose_identity(x.dtype)

    def token_block_body(_, t0, tsz):
        xT = nl.ndarray((P, num_tiles(d_in), tsz), dtype=x.dtype, buffer=nl.sbuf)
        load_transposed(x, t0, tsz, xT, ident)
        store_natural(xT, w, y, t0, tsz, out_block)

    blocks(num_tokens, token_block, token_block_body)
    return y
