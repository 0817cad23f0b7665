"""Feature-major building blocks: an activation that arrives as Xᵀ [features, tokens] in HBM.

Why the layout exists: nc_matmul computes stationary.T @ moving and its result has the stationary's
free dim on partitions ((128, 126) x (128, 512) -> (126, 512): SDK 2.26.1 docs,
nki/api/generated/nki.isa.nc_matmul.html), so a producer with its weight stationary naturally ends
with Yᵀ [out-features on partitions, tokens] and can store it feature-major at no TensorE cost
(lowrank_matmul's transpose_out). A consumer that reads that Xᵀ has the contraction dim on
partitions straight from the DMA: no PE transposes of X at all. AWS's own matmul tutorial takes
its left operand the same way ("lhsT ... delivered transposed for optimal performance":
aws-neuron-sdk 2086a70 general/nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py,
nki_matmul_fully_optimized_). nl.load_transpose2d
would also produce Xᵀ from token-major X, but as a DMA transpose (2-byte elements, far below the
DMA's row rate), so it is not used.

Row packing: the contraction order is free as long as X and U use the same one, so partition p
of packed group g holds features g*128*pack + pack*p + j (j < pack). Then each partition loads
`pack` adjacent rows of Xᵀ and of U: pack * tokens * 2 and pack * rank * 2 contiguous bytes
(whole rows when the block spans all tokens), i.e. >= 4 KiB DMA runs at 512 tokens with pack 4.
"""

from ..compat import nisa, nl
from ._blocks import MOVING_FMAX, P, PSUM_BANKS, blocks, num_tiles


def load_rows_packed_tile(t, r0: int, rsz: int, pack: int, c0, csz: int):
    """Rows r0..r0+rsz of HBM t [R, C], columns c0..c0+csz, as (128, rsz / 128, csz) in packed order.

    pack == 1: tile k holds rows r0 + k*128 + p (the last tile may be partial). pack > 1 (rsz a
    multiple of 128 * pack): tile g*pack + j holds rows r0 + g*128*pack + pack*p + j, so each
    partition's `pack` rows are adjacent in HBM and load as one run.
    """
    out = nl.ndarray((P, num_tiles(rsz), csz), t.dtype, buffer=nl.sbuf)
    if pack == 1:
        def row_tile(k, k0, ksz):
            out[0:ksz, k, :] = nl.load(t[nl.ds(r0 + k0, ksz), nl.ds(c0, csz)])

        blocks(rsz, P, row_tile)
        return out
    assert rsz % (P * pack) == 0, ("packed rows need whole groups of 128 * pack", rsz, pack)
    i_p, i_j, i_c = nl.arange(P)[:, None, None], nl.arange(pack)[None, :, None], nl.arange(csz)[None, None, :]
    for g in nl.affine_range(rsz // (P * pack)):
        out[:, nl.ds(g * pack, pack), :] = nl.load(t[r0 + g * (P * pack) + pack * i_p + i_j, c0 + i_c])
    return out


def project_feature_major(xT, u, zT, t0, tsz: int, pack: int, k_chunk: int, group: int) -> None:
    """zT[:, :, 0:tsz] = (x[t0:t0+tsz] · u)ᵀ for x given feature-major as xT [in_features, tokens].

    The contraction runs in chunks of k_chunk 128-row tiles: each chunk loads its Xᵀ rows and its
    U rows once, as whole rows (U rows span all rank columns: rank * 2 * pack contiguous bytes),
    and feeds every rank tile. A rank tile's chunk partial (fp32 PSUM, `group` rank tiles at a
    time within the 8 banks) is added into an fp32 SBUF accumulator on VectorE, as
    swiglu_down_streamed does for hᵀ and as AWS's nki_matmul_fully_optimized_ does (K blocks in a
    `sequential_range`, `result_tiles[...] += res_tile` from PSUM into SBUF; file cited in the
    module docstring; it is the schedule the cost model is calibrated on); the last chunk's add
    writes bf16 zT. So Xᵀ never needs to be
    resident (only one chunk of it is live) and U loads are never cut into 2 KiB column strips,
    which is what holds the token-major schedule. One chunk covering in_features needs no SBUF
    accumulator (plain PSUM evictions on ScalarE).
    """
    d_in, rank = u.shape
    num_rt = rank // P
    num_chunks = -(-tsz // MOVING_FMAX)
    assert num_chunks <= PSUM_BANKS, ("at most 8 PSUM banks of 512 tokens", tsz)
    group = max(1, min(group, num_rt, PSUM_BANKS // num_chunks))
    rows = P * k_chunk
    assert pack == 1 or (k_chunk % pack == 0 and d_in % (P * pack) == 0), \
        ("pack > 1 needs k_chunk % pack == 0 and in_features % (128 * pack) == 0", pack, k_chunk, d_in)
    single = d_in <= rows
    acc_sb = None if single else nl.zeros((P, num_rt, tsz), nl.float32, buffer=nl.sbuf)

    def chunk(c0, csz: int, final: bool) -> None:
        xc = load_rows_packed_tile(xT, c0, csz, pack, t0, tsz)
        uc = load_rows_packed_tile(u, c0, csz, pack, 0, rank)

        def rank_group(_, g0, gsz):
            acc = nl.zeros((P, num_chunks * gsz, MOVING_FMAX), nl.float32, buffer=nl.psum)

            def k_tile(k, _, ksz):
                def token_chunk(c, s0, ssz):
                    for j in nl.affine_range(gsz):
                        acc[:, c * gsz + j, 0:ssz] += nisa.nc_matmul(uc[0:ksz, k, nl.ds((g0 + j) * P, P)],
                                                                     xc[0:ksz, k, nl.ds(s0, ssz)])

                blocks(tsz, MOVING_FMAX, token_chunk)

            def evict(c, s0, ssz):
                for j in nl.affine_range(gsz):
                    part = acc[:, c * gsz + j, 0:ssz]
                    if single:
                        zT[:, g0 + j, nl.ds(s0, ssz)] = nisa.activation(nl.copy, part, dtype=zT.dtype)
                    elif final:
                        zT[:, g0 + j, nl.ds(s0, ssz)] = nl.add(acc_sb[:, g0 + j, nl.ds(s0, ssz)], part,
                                                               dtype=zT.dtype)
                    else:
                        acc_sb[:, g0 + j, nl.ds(s0, ssz)] += part

            blocks(csz, P, k_tile)
            blocks(tsz, MOVING_FMAX, evict)

        blocks(num_rt, group, rank_group)

    if single:
        for _ in nl.sequential_range(1):  # scope: the chunk's Xᵀ and U rows
            chunk(0, d_in, True)
        return
    num_full, tail = divmod(d_in, rows)
    num_acc = num_full if tail else num_full - 1
    for c in nl.sequential_range(num_acc):  # carries acc_sb from chunk to chunk
        chunk(c * rows, rows, False)
    for _ in nl.sequential_range(1):
        chunk(num_acc * rows, tail or rows, True)
