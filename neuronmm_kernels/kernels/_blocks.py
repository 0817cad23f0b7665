"""NKI building blocks shared by the kernels (plain Python helpers, traced inline into each kernel).

Layouts: an SBUF "T" tensor holds a transposed activation as (128, ceil(K / 128), tokens):
partition p of slice k is feature k*128 + p, so slice k is directly a matmul operand with the
contraction dim on partitions. When K is not a multiple of 128 the last slice uses its first
K % 128 partitions only (a contraction tile may be shorter than 128). All PSUM accumulators are
fp32 and live one accumulation group per 2 KiB bank.

Loops: every block loop is `blocks(total, size, body)`: an affine loop over the full blocks, then
the tail block once inside a one-trip `sequential_range`. The tail's addresses are constants, and
neuronx-cc rejects a plain write inside an affine loop whose destination address does not use the
loop's index ("Unexpected output dependencies, missing indices in the dst access"), even for one
trip; a sequential loop is exempt and still scopes the tail's tensors like a loop body.
"""

from ..compat import nisa, nl

P = 128            # partitions = contraction tile
MOVING_FMAX = 512  # moving free size = one fp32 PSUM bank
PSUM_BANKS = 8


def blocks(total: int, size: int, body) -> None:
    """Call body(block_index, start, block_size) for each size-block of [0, total), the tail last."""
    num_full, tail = divmod(total, size)
    if num_full:
        for i in nl.affine_range(num_full):
            body(i, i * size, size)
    if tail:
        for _ in nl.sequential_range(1):  # see the module docstring: no affine loop around constant addresses
            body(num_full, num_full * size, tail)


def num_tiles(total: int) -> int:
    """Partition tiles needed for `total` features (the last may be partial)."""
    return -(-total // P)


def transpose_identity(dtype):
    """The fp32 [128, 128] SBUF identity that `transpose_into` needs for fp32 data; None for other dtypes."""
    if dtype != nl.float32:
        return None
    return nl.load(nl.shared_identity_matrix(P, dtype=nl.float32))


def transpose_into(dst, src, ident) -> None:
    """dst = srcᵀ for an SBUF tile src [p, f] (p, f <= 128), through PSUM, cast to dst's dtype.

    bf16 uses the PE transpose. fp32 uses a matmul against an identity, because nc_transpose of
    fp32 data is not exact on trn1 (AWS's workaround: nki-samples 8370e11^
    contributed/neuron-team-kernels/flash_paged_attn_varlen/utils.py:298-327, PF_transpose_with_PE).
    """
    p, f = src.shape
    tp = nl.ndarray((f, p), nl.float32, buffer=nl.psum)
    if src.dtype == nl.float32:
        tp[...] = nisa.nc_matmul(src, ident[0:p, 0:p], is_moving_onezero=True, is_transpose=True)
    else:
        tp[...] = nisa.nc_transpose(src)
    dst[...] = nisa.tensor_copy(tp, dtype=dst.dtype)


def load_transposed(x, t0, tsz: int, xT, ident=None, pack: int = 1) -> None:
    """xT[:, k, 0:tsz] = x[t0:t0+tsz, k*128:(k+1)*128]ᵀ: contiguous row loads, then on-chip transposes.

    With pack > 1 the contraction tiles come in the packed order of load_rows_packed: tile
    c*pack + j holds features c*128*pack + pack*p + j on partition p (the transposes read the rows
    tile with a free-dim stride of `pack`; the feature count must be a multiple of 128 * pack).
    """
    def rows_block(_, s0, ssz):
        rows = nl.load(x[nl.ds(t0 + s0, ssz), :])  # [ssz tokens, in]: whole rows, one contiguous run

        def feature_tile(k, k0, ksz):
            transpose_into(xT[0:ksz, k, nl.ds(s0, ssz)], rows[:, nl.ds(k0, ksz)], ident)

        def packed_chunk(c, c0, _):
            i_t, i_q = nl.arange(ssz)[:, None], nl.arange(P)[None, :]
            for j in nl.static_range(pack):
                transpose_into(xT[:, c * pack + j, nl.ds(s0, ssz)], rows[i_t, c0 + pack * i_q + j], ident)

        if pack == 1:
            blocks(x.shape[1], P, feature_tile)
        else:
            assert x.shape[1] % (P * pack) == 0, ("packed contraction needs in_features % (128 * pack) == 0", x.shape)
            blocks(x.shape[1], P * pack, packed_chunk)

    blocks(tsz, P, rows_block)


def load_packed(w, c, pack: int):
    """Rows c*128*pack + pack*p + j (j < pack) of w [K, R] as a (128, pack, R) tile: pack whole rows per partition.

    One contiguous run of pack * R * itemsize bytes per partition (w is row-major), so the DMA reaches
    its >= 4 KiB full-speed row length for R * pack >= 2048 bf16 columns. Slice j is contraction tile
    c*pack + j in load_transposed's packed order.
    """
    i_p, i_j, i_c = nl.arange(P)[:, None, None], nl.arange(pack)[None, :, None], nl.arange(w.shape[1])[None, None, :]
    return nl.load(w[c * (P * pack) + pack * i_p + i_j, i_c])


def load_rows_packed(w, pack: int):
    """All of w [K, R] resident as (128, K/128, R) in load_transposed's packed tile order (see load_packed)."""
    assert w.shape[0] % (P * pack) == 0, ("packed rows need K % (128 * pack) == 0", w.shape)
    wb = nl.ndarray((P, w.shape[0] // P, w.shape[1]), w.dtype, buffer=nl.sbuf)
    for c in nl.affine_range(w.shape[0] // (P * pack)):
        wb[:, nl.ds(c * pack, pack), :] = load_packed(w, c, pack)
    return wb


def _src_tile(srcT, k, k0, ksz: int, tsz: int, src_hbm, t0):
    """Contraction tile k of the transposed source: from SBUF, or streamed from an HBM [K, tokens] spill."""
    if src_hbm is None:
        return srcT[0:ksz, k, 0:tsz]
    return nl.load(src_hbm[nl.ds(k0, ksz), nl.ds(t0, tsz)])


def project_transposed(w, srcT, zT, tsz: int, group: int, src_hbm=None, t0=0, w_sbuf=None, z0=0) -> None:
    """zT[:, j, z0:z0+tsz] = (src · w)ᵀ for w [K, R] in HBM (R a multiple of 128) and srcT in SBUF.

    w tiles are stationary (free = 128 rank columns), srcT is moving, so the result comes out already
    transposed, rank on partitions, ready to be the next matmul's operand. tsz may exceed one PSUM
    bank's 512 tokens: each w tile then serves every 512-token chunk before the next loads, so w is
    read once for all tsz tokens; `group` rank tiles (clamped so group x chunks <= 8 banks)
    accumulate at once and w rows load group*128 wide. With src_hbm (a feature-major [K, tokens]
    HBM tensor) the source streams from HBM instead; with w_sbuf (w already resident as
    (128, ceil(K/128), R), see load_columns) nothing is loaded.
    """
    num_chunks = -(-tsz // MOVING_FMAX)
    assert num_chunks <= PSUM_BANKS, ("at most 8 PSUM banks of 512 tokens", tsz)
    group = max(1, min(group, PSUM_BANKS // num_chunks))

    def rank_group(_, g0, gsz):
        acc = nl.zeros((P, num_chunks * gsz, MOVING_FMAX), nl.float32, buffer=nl.psum)

        def contraction_tile(k, k0, ksz):
            if w_sbuf is None:
                wt = nl.load(w[nl.ds(k0, ksz), nl.ds(g0 * P, gsz * P)])
            else:
                wt = w_sbuf[0:ksz, k, nl.ds(g0 * P, gsz * P)]
            src = _src_tile(srcT, k, k0, ksz, tsz, src_hbm, t0)

            def chunk(c, c0, csz):
                for j in nl.affine_range(gsz):
                    acc[:, c * gsz + j, 0:csz] += nisa.nc_matmul(wt[:, nl.ds(j * P, P)], src[:, nl.ds(c0, csz)])

            blocks(tsz, MOVING_FMAX, chunk)

        def evict(c, c0, csz):
            for j in nl.affine_range(gsz):
                zT[:, g0 + j, nl.ds(z0 + c0, csz)] = nisa.activation(nl.copy, acc[:, c * gsz + j, 0:csz],
                                                                    dtype=zT.dtype)

        blocks(w.shape[0], P, contraction_tile)
        blocks(tsz, MOVING_FMAX, evict)

    blocks(w.shape[1] // P, group, rank_group)


def project_transposed_small(w, srcT, zT, tsz: int, src_hbm=None, t0=0, w_sbuf=None, ident=None,
                             z0=0, pack: int = 1) -> None:
    """Same result as project_transposed for tsz <= 128 tokens, with w moving instead of stationary.

    srcT tiles are stationary (free = tsz), w streams as moving operands 512 columns at a time, so
    each w tile loads as whole rows (rank * 2 contiguous bytes per partition: full DMA speed at
    decode sizes). z = src · w lands token-major in PSUM; rank/128 on-chip transposes of
    [tsz, 128] turn it into zT. Needs rank <= 8 * 512 (one PSUM bank per 512 rank columns).
    With pack > 1 (srcT in load_transposed's packed order, w streamed from HBM) each load brings
    `pack` whole rows per partition (load_packed): longer DMA runs, same matmuls.
    """
    rank = w.shape[1]
    for _ in nl.sequential_range(1):  # scope: the accumulator banks are free again afterwards
        acc = nl.zeros((tsz, -(-rank // MOVING_FMAX), MOVING_FMAX), nl.float32, buffer=nl.psum)

        def contraction_tile(k, k0, ksz):
            wt = nl.load(w[nl.ds(k0, ksz), :]) if w_sbuf is None else w_sbuf[0:ksz, k, :]
            src = _src_tile(srcT, k, k0, ksz, tsz, src_hbm, t0)

            def rank_chunk(c, c0, csz):
                acc[:, c, 0:csz] += nisa.nc_matmul(src, wt[:, nl.ds(c0, csz)])

            blocks(rank, MOVING_FMAX, rank_chunk)

        def evict_chunk(c, c0, csz):
            z = nisa.activation(nl.copy, acc[:, c, 0:csz], dtype=zT.dtype)  # [tsz, csz] token-major
            for j in nl.affine_range(csz // P):
                transpose_into(zT[:, c * (MOVING_FMAX // P) + j, nl.ds(z0, tsz)], z[:, nl.ds(j * P, P)], ident)

        def packed_chunk(c, _, __):
            wp = load_packed(w, c, pack)
            for j in nl.static_range(pack):
                src = _src_tile(srcT, c * pack + j, 0, P, tsz, None, t0)

                def rank_chunk(r, c0, csz):
                    acc[:, r, 0:csz] += nisa.nc_matmul(src, wp[:, j, nl.ds(c0, csz)])

                blocks(rank, MOVING_FMAX, rank_chunk)

        if pack > 1 and w_sbuf is None:
            assert src_hbm is None and w.shape[0] % (P * pack) == 0, "packed rows: SBUF source, K % (128*pack) == 0"
            blocks(w.shape[0], P * pack, packed_chunk)
        else:
            blocks(w.shape[0], P, contraction_tile)
        blocks(rank, MOVING_FMAX, evict_chunk)


def project(w, srcT, zT, tsz: int, group: int, u_moving: bool, src_hbm=None, t0=0, w_sbuf=None,
            ident=None, z0=0, pack: int = 1) -> None:
    """zT[..., z0:z0+tsz] = (src · w)ᵀ with w stationary (any tsz) or, when u_moving, w moving (tsz <= 128).

    pack > 1: srcT (and w_sbuf, if given) are in load_transposed's packed contraction order; a
    streamed w then needs u_moving (whole packed rows per load).
    """
    if u_moving:
        project_transposed_small(w, srcT, zT, tsz, src_hbm, t0, w_sbuf, ident, z0, pack)
    else:
        assert pack == 1 or w_sbuf is not None, "packed rows with stationary w need it resident (hoist_u)"
        project_transposed(w, srcT, zT, tsz, group, src_hbm, t0, w_sbuf, z0)


def load_columns(v, n0, nsz: int):
    """v[:, n0:n0+nsz] as (128, ceil(K/128), nsz): the contraction dim K = v.shape[0] on partitions."""
    vb = nl.ndarray((P, num_tiles(v.shape[0]), nsz), v.dtype, buffer=nl.sbuf)

    def row_tile(r, r0, rsz):
        vb[0:rsz, r, :] = nl.load(v[nl.ds(r0, rsz), nl.ds(n0, nsz)])

    blocks(v.shape[0], P, row_tile)
    return vb


def store_natural(zT, v, y, t0, tsz: int, out_block: int) -> None:
    """y[t0:t0+tsz, :] = z · v, token-major: zT tiles stationary (128 tokens), v tiles moving (512 cols)."""
    def out_columns(_, n0, nsz):
        vb = load_columns(v, n0, nsz)

        def token_tile(_, s0, ssz):
            yb = nl.ndarray((ssz, nsz), y.dtype, buffer=nl.sbuf)

            def bank(_, c0, csz):
                acc = nl.zeros((ssz, csz), nl.float32, buffer=nl.psum)

                def rank_tile(r, _, rsz):
                    acc[...] += nisa.nc_matmul(zT[0:rsz, r, nl.ds(s0, ssz)], vb[0:rsz, r, nl.ds(c0, csz)])

                blocks(v.shape[0], P, rank_tile)
                yb[:, nl.ds(c0, csz)] = nisa.tensor_copy(acc, dtype=y.dtype)

            blocks(nsz, MOVING_FMAX, bank)
            nl.store(y[nl.ds(t0 + s0, ssz), nl.ds(n0, nsz)], yb)

        blocks(tsz, P, token_tile)

    blocks(v.shape[1], out_block, out_columns)


def store_transposed(zT, v, yT, t0, tsz: int, out_block: int, pack: int = 1) -> None:
    """yT[:, t0:t0+tsz] = (z · v)ᵀ, feature-major: v tiles stationary (128 cols), zT moving (512-token chunks).

    pack > 1 (out_block and out_features multiples of 128 * pack): partition q of a packed group
    holds output features c0 + pack*q + j (j < pack), the stationary being a stride-`pack` column
    view of the resident V block (free-dim strides on SBUF run at full speed: "NeuronCore offers much
    more flexible memory access in its on-chip SRAMs along the free dimension", SDK docs
    nki/about/indexing-overview); the group's (128, pack, tsz) result is stored at once, `pack`
    adjacent rows of yT per partition: one pack * tsz * 2-byte run when the block spans all tokens
    (a 512-token Yᵀ row alone is a 1 KiB run, below the DMA's full rate).
    """
    assert pack == 1 or (v.shape[1] % (P * pack) == 0 and out_block % (P * pack) == 0), \
        ("packed Yᵀ stores need out_features and out_block multiples of 128 * pack", v.shape, out_block, pack)

    def out_columns(_, n0, nsz):
        vb = load_columns(v, n0, nsz)

        def packed_group(_, c0, __):
            yb = nl.ndarray((P, pack, tsz), yT.dtype, buffer=nl.sbuf)
            i_r, i_q = nl.arange(P)[:, None], nl.arange(P)[None, :]
            for j in nl.static_range(pack):
                def token_chunk(_, s0, ssz):
                    acc = nl.zeros((P, ssz), nl.float32, buffer=nl.psum)
                    for r in nl.affine_range(v.shape[0] // P):
                        acc[...] += nisa.nc_matmul(vb[i_r, r, c0 + pack * i_q + j], zT[:, r, nl.ds(s0, ssz)])
                    yb[:, j, nl.ds(s0, ssz)] = nisa.tensor_copy(acc, dtype=yT.dtype)

                blocks(tsz, MOVING_FMAX, token_chunk)
            i_p, i_j, i_t = nl.arange(P)[:, None, None], nl.arange(pack)[None, :, None], nl.arange(tsz)[None, None, :]
            nl.store(yT[n0 + c0 + pack * i_p + i_j, t0 + i_t], yb)

        def feature_tile(_, c0, csz):
            def token_chunk(_, s0, ssz):
                acc = nl.zeros((csz, ssz), nl.float32, buffer=nl.psum)

                def rank_tile(r, _, rsz):
                    acc[...] += nisa.nc_matmul(vb[0:rsz, r, nl.ds(c0, csz)], zT[0:rsz, r, nl.ds(s0, ssz)])

                blocks(v.shape[0], P, rank_tile)
                nl.store(yT[nl.ds(n0 + c0, csz), nl.ds(t0 + s0, ssz)], nisa.tensor_copy(acc, dtype=yT.dtype))

            blocks(tsz, MOVING_FMAX, token_chunk)

        if pack == 1:
            blocks(nsz, P, feature_tile)
        else:
            blocks(nsz, P * pack, packed_group)

    blocks(v.shape[1], out_block, out_columns)


def swiglu_transposed(zgT, zuT, gate_v, up_v, hT, tsz: int, block: int, h_hbm=None, t0=0) -> None:
    """hT[:, i, 0:tsz] = (silu(zg · gate_v) ⊙ (zu · up_v))ᵀ: SiLU evicts gate PSUM on ScalarE,
    the product reads up straight from PSUM on VectorE; the result is already the down
    projection's moving operand (intermediate on partitions). With h_hbm, each 128-row tile is
    stored to the feature-major HBM spill h_hbm[intermediate, tokens] instead of kept in SBUF.
    block is a multiple of 128; the intermediate size need not be."""
    num_rg, num_ru = gate_v.shape[0] // P, up_v.shape[0] // P

    def column_block(b, n0, nsz):
        gb = load_columns(gate_v, n0, nsz)
        ub = load_columns(up_v, n0, nsz)

        def feature_tile(c, c0, csz):
            acc_g = nl.zeros((csz, tsz), nl.float32, buffer=nl.psum)
            acc_u = nl.zeros((csz, tsz), nl.float32, buffer=nl.psum)
            for r in nl.affine_range(num_rg):
                acc_g += nisa.nc_matmul(gb[:, r, nl.ds(c0, csz)], zgT[:, r, 0:tsz])
            for r in nl.affine_range(num_ru):
                acc_u += nisa.nc_matmul(ub[:, r, nl.ds(c0, csz)], zuT[:, r, 0:tsz])
            g = nisa.activation(nl.silu, acc_g, dtype=zgT.dtype)
            i = b * (block // P) + c
            if h_hbm is None:
                hT[0:csz, i, 0:tsz] = nl.multiply(g, acc_u, dtype=hT.dtype)
            else:
                nl.store(h_hbm[nl.ds(i * P, csz), nl.ds(t0, tsz)], nl.multiply(g, acc_u, dtype=h_hbm.dtype))

        blocks(nsz, P, feature_tile)

    blocks(gate_v.shape[1], block, column_block)


def load_rows(w, r0, rsz: int):
    """w[r0:r0+rsz, :] as (128, ceil(rsz/128), cols): rows on partitions, each a whole contiguous row."""
    wb = nl.ndarray((P, num_tiles(rsz), w.shape[1]), w.dtype, buffer=nl.sbuf)

    def row_tile(r, q0, qsz):
        wb[0:qsz, r, :] = nl.load(w[nl.ds(r0 + q0, qsz), :])

    blocks(rsz, P, row_tile)
    return wb


def swiglu_down_streamed(zgT, zuT, gate_v, up_v, down_u, zdT, tsz: int, block: int) -> None:
    """zdT[:, :, 0:tsz] = (h · down_u)ᵀ, h = silu(zg · gate_v) ⊙ (zu · up_v), without hᵀ ever whole on chip.

    For token blocks whose hᵀ [intermediate, tokens] cannot stay in SBUF: each `block` of intermediate
    columns loads its gate_v/up_v columns and down_u rows once, computes that slice of hᵀ 512 tokens
    at a time, and adds its down-projection partial (fp32 PSUM) into an fp32 SBUF accumulator, so
    every factor is read once per token block however many tokens it has. The column loop is a
    sequential_range because it carries the accumulator from one block to the next.
    """
    num_rg, num_ru, num_rd = gate_v.shape[0] // P, up_v.shape[0] // P, down_u.shape[1] // P
    zd_acc = nl.zeros((P, num_rd, tsz), nl.float32, buffer=nl.sbuf)

    def column_block(n0, nsz):
        gb, ub, du = load_columns(gate_v, n0, nsz), load_columns(up_v, n0, nsz), load_rows(down_u, n0, nsz)

        def token_chunk(_, s0, ssz):
            hT = nl.ndarray((P, num_tiles(nsz), ssz), zgT.dtype, buffer=nl.sbuf)

            def feature_tile(c, c0, csz):
                acc_g = nl.zeros((csz, ssz), nl.float32, buffer=nl.psum)
                acc_u = nl.zeros((csz, ssz), nl.float32, buffer=nl.psum)
                for r in nl.affine_range(num_rg):
                    acc_g += nisa.nc_matmul(gb[:, r, nl.ds(c0, csz)], zgT[:, r, nl.ds(s0, ssz)])
                for r in nl.affine_range(num_ru):
                    acc_u += nisa.nc_matmul(ub[:, r, nl.ds(c0, csz)], zuT[:, r, nl.ds(s0, ssz)])
                g = nisa.activation(nl.silu, acc_g, dtype=zgT.dtype)
                hT[0:csz, c, 0:ssz] = nl.multiply(g, acc_u, dtype=hT.dtype)

            blocks(nsz, P, feature_tile)
            for j in nl.affine_range(num_rd):
                acc_d = nl.zeros((P, ssz), nl.float32, buffer=nl.psum)

                def h_tile(c, _, csz):
                    acc_d[...] += nisa.nc_matmul(du[0:csz, c, nl.ds(j * P, P)], hT[0:csz, c, 0:ssz])

                blocks(nsz, P, h_tile)
                zd_acc[:, j, nl.ds(s0, ssz)] += acc_d

        blocks(tsz, MOVING_FMAX, token_chunk)

    num_full, tail = divmod(gate_v.shape[1], block)
    if num_full:  # Python ifs, not empty loops: neuronx-cc compiles a loop's body even when it has no trips
        for b in nl.sequential_range(num_full):
            column_block(b * block, block)
    if tail:
        for _ in nl.sequential_range(1):
            column_block(num_full * block, tail)
    for j in nl.affine_range(num_rd):
        def evict(_, s0, ssz):
            zdT[:, j, nl.ds(s0, ssz)] = nisa.tensor_copy(zd_acc[:, j, nl.ds(s0, ssz)], dtype=zdT.dtype)

        blocks(tsz, MOVING_FMAX, evict)
