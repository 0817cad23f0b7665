"""Elementwise SwiGLU h = silu(g) ⊙ u over HBM tensors: the glue the unfused MLP variants need."""

from ..compat import nki, nl
from ._blocks import P, blocks


@nki.jit
def swiglu(g, u, col_block=2048):
    """h = silu(g) * u. Layouts: g, u, h [num_tokens, intermediate] (HBM, bf16); any num_tokens >= 1."""
    num_tokens, inter = g.shape
    assert u.shape == g.shape
    h = nl.ndarray(g.shape, dtype=g.dtype, buffer=nl.shared_hbm)
    def token_tile(_, t0, tsz):
        def column_block(_, c0, csz):
            gt = nl.load(g[nl.ds(t0, tsz), nl.ds(c0, csz)])
            ut = nl.load(u[nl.ds(t0, tsz), nl.ds(c0, csz)])
            nl.store(h[nl.ds(t0, tsz), nl.ds(c0, csz)], nl.multiply(nl.silu(gt), ut, dtype=g.dtype))

        blocks(inter, col_block, column_block)

    blocks(num_tokens, P, token_tile)
    return h
