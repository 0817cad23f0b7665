"""Elementwise SwiGLU h = silu(g) ⊙ u over HBM tensors: the glue the unfused MLP variants need."""

from ..compat import nki, nl
from ._blocks import P, split


@nki.jit
def swiglu(g, u, col_block=2048):
    """h = silu(g) * u. Layouts: g, u, h [num_tokens, intermediate] (HBM, bf16); any num_tokens >= 1."""
    num_tokens, inter = g.shape
    assert u.shape == g.shape
    h = nl.ndarray(g.shape, dtype=g.dtype, buffer=nl.shared_hbm)
    for _, t0, tsz in split(num_tokens, P):
        for _, c0, csz in split(inter, col_block):
            gt = nl.load(g[nl.ds(t0, tsz), nl.ds(c0, csz)])
            ut = nl.load(u[nl.ds(t0, tsz), nl.ds(c0, csz)])
            nl.store(h[nl.ds(t0, tsz), nl.ds(c0, csz)], nl.multiply(nl.silu(gt), ut, dtype=g.dtype))
    return h
