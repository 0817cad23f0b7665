"""Fused low-rank matmul Y = X·U·V: (XU)ᵀ stays in SBUF and feeds the second matmul in place."""

from ..compat import nki, nl
from ._blocks import (P, blocks, load_columns, load_rows_packed, load_transposed, num_tiles, project, store_natural,
                      store_transposed, transpose_identity)
from ._feature_major import project_feature_major


@nki.jit
def lowrank_matmul(x, u, v, transpose_out=False, token_block=512, group=8, out_block=512, u_moving=False,
                   hoist_u=False, row_pack=1, transpose_in=False, k_chunk=16, out_pack=1):
    """y = x · u · v (or yᵀ with transpose_out=True; x given as xᵀ with transpose_in=True).

    Layouts (HBM, row-major): x [num_tokens, in_features], u [in_features, rank] (= Aᵀ of
    LowRankLinear), v [rank, out_features] (= Bᵀ) -> y [num_tokens, out_features], or
    [out_features, num_tokens] when transpose_out. dtypes: bf16 in/out; both matmuls accumulate in
    fp32 PSUM over their whole contraction (NeuronMM accumulates in bf16); (XU)ᵀ is rounded to bf16
    once, as a TensorE operand. Limits: rank a multiple of 128; num_tokens, in_features and
    out_features any size >= 1 (partial 128-partition tiles for the tails); token_block <= 4096
    (beyond 512 tokens a block is projected in 512-token PSUM chunks, group clamped to 8 / chunks);
    group <= 8 (PSUM banks); u_moving (U tiles as moving operands, whole-row U loads: the decode
    schedule) needs token_block <= 128 and rank <= 4096; out_block a multiple of 512 (natural)
    or 128 (transposed); hoist_u keeps all of U in SBUF for the whole kernel (loaded once, as
    whole contiguous rows) when in_features * rank * 2 / 128 bytes per partition fit. row_pack=2
    (with u_moving or hoist_u; in_features a multiple of 256) loads two whole U rows per partition
    (rank * 4 contiguous bytes: DMA rows of >= 4 KiB for rank >= 1024, where one row of 2-3.5 KiB
    runs at 60-90 % of the DMA peak) and contracts in that order: Xᵀ tiles are transposed from
    X columns with stride 2 to match (same matmuls, same transposes).
    Schedule per token block: Xᵀ by PE transposes; (XU)ᵀ = Uᵀ Xᵀ with U tiles stationary, kept in
    SBUF as (128, rank/128, tokens); then Y = (XU)·V with (XU)ᵀ stationary (token-major output) or
    Yᵀ = Vᵀ(XU)ᵀ with V stationary (feature-major output). No HBM round trip, no transpose of XU.
    U and V are read once per token block, so a block larger than 512 tokens (the tile selector
    picks it when (XU)ᵀ and Xᵀ of the block fit SBUF) cuts their HBM traffic at prefill sizes.
    Feature-major input (transpose_in=True: x is xᵀ [in_features, num_tokens], e.g. the Yᵀ a
    transpose_out producer or a SwiGLU over two of them wrote): no transposes at all; the
    contraction runs in chunks of k_chunk 128-row tiles that load Xᵀ and U as whole rows,
    row_pack adjacent rows per partition (in_features a multiple of 128 * row_pack, k_chunk a
    multiple of row_pack), and add up in an fp32 SBUF accumulator (see _feature_major). Not
    combined with u_moving or hoist_u. out_pack (transpose_out only) stores out_pack adjacent Yᵀ
    rows per partition (see store_transposed): whole-row runs of >= 4 KiB when a token block spans
    all tokens, so a feature-major producer need not store 1 KiB rows at 512 tokens.
    """
    d_in, num_tokens = x.shape if transpose_in else x.shape[::-1]
    rank, d_out = v.shape
    assert u.shape == (d_in, rank) and rank % P == 0, ("rank must be a multiple of 128", u.shape, v.shape)
    token_block = min(token_block, num_tokens)
    assert not u_moving or (token_block <= 128 and rank <= 4096), "u_moving: <= 128 tokens, rank <= 4096"
    assert 1 <= token_block <= 8 * 512 and 1 <= group <= 8
    assert not transpose_in or not (u_moving or hoist_u), "transpose_in has its own (chunked) U schedule"
    assert out_pack == 1 or transpose_out, "out_pack packs Yᵀ rows: transpose_out only"
    assert row_pack == 1 or (u_moving or hoist_u or transpose_in) and d_in % (P * row_pack) == 0, \
        "row_pack > 1 needs u_moving, hoist_u or transpose_in, and in_features % (128 * row_pack) == 0"
    shape = (d_out, num_tokens) if transpose_out else (num_tokens, d_out)
    y = nl.ndarray(shape, dtype=x.dtype, buffer=nl.shared_hbm)
    u_sbuf = (load_columns(u, 0, rank) if row_pack == 1 else load_rows_packed(u, row_pack)) if hoist_u else None
    ident = transpose_identity(x.dtype)

    def token_block_body(_, t0, tsz):
        zT = nl.ndarray((P, rank // P, tsz), dtype=x.dtype, buffer=nl.sbuf)
        # scope: Xᵀ (or the chunk accumulator) is dead once (XU)ᵀ exists (sequential: zT is not indexed by it)
        for _ in nl.sequential_range(1):
            if transpose_in:  # Xᵀ comes from HBM as it is: no transposes
                project_feature_major(x, u, zT, t0, tsz, row_pack, k_chunk, group)
            else:
                xT = nl.ndarray((P, num_tiles(d_in), tsz), dtype=x.dtype, buffer=nl.sbuf)
                load_transposed(x, t0, tsz, xT, ident, row_pack)
                project(u, xT, zT, tsz, group, u_moving, w_sbuf=u_sbuf, ident=ident, pack=row_pack)
        if transpose_out:
            store_transposed(zT, v, y, t0, tsz, out_block, out_pack)
        else:
            store_natural(zT, v, y, t0, tsz, out_block)

    blocks(num_tokens, token_block, token_block_body)
    return y
