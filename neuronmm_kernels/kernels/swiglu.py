"""Elementwise SwiGLU h = silu(g) ⊙ u over HBM tensors: the glue the unfused MLP variants need."""

from ..compat import nki, nl
from ._blocks import P, blocks


@nki.jit
def swiglu(g, u, col_block=2048, row_pack=1):
    """h = silu(g) * u, elementwise, so any 2-D layout: g, u, h [rows, cols] (HBM, bf16), e.g.
    token-major [num_tokens, intermediate] or feature-major [intermediate, num_tokens]; any sizes >= 1.

    row_pack > 1 (rows a multiple of 128 * row_pack) puts row_pack adjacent rows on each partition,
    so short rows (a feature-major 512-token row is 1 KiB) still move as >= 4 KiB DMA runs.
    """
    rows, cols = g.shape
    assert u.shape == g.shape
    assert row_pack == 1 or rows % (P * row_pack) == 0, ("row_pack needs rows % (128 * row_pack) == 0", rows)
    h = nl.ndarray(g.shape, dtype=g.dtype, buffer=nl.shared_hbm)

    def row_tile(_, t0, tsz):
        def column_block(_, c0, csz):
            gt = nl.load(g[nl.ds(t0, tsz), nl.ds(c0, csz)])
            ut = nl.load(u[nl.ds(t0, tsz), nl.ds(c0, csz)])
            nl.store(h[nl.ds(t0, tsz), nl.ds(c0, csz)], nl.multiply(nl.silu(gt), ut, dtype=g.dtype))

        blocks(cols, col_block, column_block)

    def row_group(_, r0, __):
        def column_block(_, c0, csz):
            i_p, i_j = nl.arange(P)[:, None, None], nl.arange(row_pack)[None, :, None]
            i_c = nl.arange(csz)[None, None, :]
            rows_ix, cols_ix = r0 + row_pack * i_p + i_j, c0 + i_c
            gt, ut = nl.load(g[rows_ix, cols_ix]), nl.load(u[rows_ix, cols_ix])
            nl.store(h[rows_ix, cols_ix], nl.multiply(nl.silu(gt), ut, dtype=g.dtype))

        blocks(cols, col_block, column_block)

    if row_pack == 1:
        blocks(rows, P, row_tile)
    else:
        blocks(rows, P * row_pack, row_group)
    return h
