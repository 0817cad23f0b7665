"""The four schedules of AWS's NKI matmul tutorial, re-expressed for cost-model calibration.

All compute result [M, N] = lhsTᵀ · rhs with lhsT [K, M] and rhs [K, N] in HBM (bf16). They
reproduce each schedule's data movement and instruction mix (tile shapes, which loads are hoisted,
block sizes) with our own code and folded (non-block-dim) layouts. The published trn1 latencies
for [4096, 8192] x [8192, 8192] are in cost_model.TUTORIAL_MS.
"""

from ..compat import nisa, nki, nl

TILE_K, TILE_M, TILE_N = 128, 128, 512


@nki.jit
def matmul_tiled(lhsT, rhs):
    """Version 0: per (m, n) output tile, load a 128x128 lhsT tile and a 128x512 rhs tile per k step."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            acc = nl.zeros((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                a = nl.load(lhsT[nl.ds(k * TILE_K, TILE_K), nl.ds(m * TILE_M, TILE_M)])
                b = nl.load(rhs[nl.ds(k * TILE_K, TILE_K), nl.ds(n * TILE_N, TILE_N)])
                acc += nisa.nc_matmul(a, b)
            nl.store(result[nl.ds(m * TILE_M, TILE_M), nl.ds(n * TILE_N, TILE_N)],
                     nl.copy(acc, dtype=result.dtype))
    return result


@nki.jit
def matmul_hoisted(lhsT, rhs):
    """Version 1: the lhsT column strip is loaded once per m, the rhs strip once per (m, n)."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    num_k = K // TILE_K
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        a = nl.ndarray((TILE_K, num_k, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
        for k in nl.affine_range(num_k):
            a[:, k, :] = nl.load(lhsT[nl.ds(k * TILE_K, TILE_K), nl.ds(m * TILE_M, TILE_M)])
        for n in nl.affine_range(N // TILE_N):
            b = nl.ndarray((TILE_K, num_k, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
            for k in nl.affine_range(num_k):
                b[:, k, :] = nl.load(rhs[nl.ds(k * TILE_K, TILE_K), nl.ds(n * TILE_N, TILE_N)])
            acc = nl.zeros((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(num_k):
                acc += nisa.nc_matmul(a[:, k, :], b[:, k, :])
            nl.store(result[nl.ds(m * TILE_M, TILE_M), nl.ds(n * TILE_N, TILE_N)],
                     nl.copy(acc, dtype=result.dtype))
    return result


@nki.jit
def matmul_block_free(lhsT, rhs, tiles_m=2, tiles_n=2):
    """Version 2: blocks of tiles_m x 128 rows and tiles_n x 512 columns share their strips."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    num_k, block_m, block_n = K // TILE_K, tiles_m * TILE_M, tiles_n * TILE_N
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // block_m):
        a = nl.ndarray((TILE_K, num_k, block_m), dtype=lhsT.dtype, buffer=nl.sbuf)
        for bm in nl.affine_range(tiles_m):
            for k in nl.affine_range(num_k):
                a[:, k, nl.ds(bm * TILE_M, TILE_M)] = nl.load(
                    lhsT[nl.ds(k * TILE_K, TILE_K), nl.ds(m * block_m + bm * TILE_M, TILE_M)])
        for n in nl.affine_range(N // block_n):
            b = nl.ndarray((TILE_K, num_k, block_n), dtype=rhs.dtype, buffer=nl.sbuf)
            for bn in nl.affine_range(tiles_n):
                for k in nl.affine_range(num_k):
                    b[:, k, nl.ds(bn * TILE_N, TILE_N)] = nl.load(
                        rhs[nl.ds(k * TILE_K, TILE_K), nl.ds(n * block_n + bn * TILE_N, TILE_N)])
            for bm in nl.affine_range(tiles_m):
                for bn in nl.affine_range(tiles_n):
                    acc = nl.zeros((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(num_k):
                        acc += nisa.nc_matmul(a[:, k, nl.ds(bm * TILE_M, TILE_M)], b[:, k, nl.ds(bn * TILE_N, TILE_N)])
                    nl.store(result[nl.ds(m * block_m + bm * TILE_M, TILE_M), nl.ds(n * block_n + bn * TILE_N, TILE_N)],
                             nl.copy(acc, dtype=result.dtype))
    return result


@nki.jit
def matmul_fully_optimized(lhsT, rhs, tiles_m=16, tiles_n=2, tiles_k=8):
    """Version 3: all dims blocked; wide DMA rows; K-block partial sums accumulate in SBUF (VectorE)."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    block_m, block_n, block_k = tiles_m * TILE_M, tiles_n * TILE_N, tiles_k * TILE_K
    num_block_m = M // block_m
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for n in nl.affine_range(N // block_n):
        partial = nl.zeros((TILE_M, num_block_m * tiles_m, block_n), dtype=lhsT.dtype, buffer=nl.sbuf)
        for k in nl.sequential_range(K // block_k):
            b = nl.ndarray((TILE_K, tiles_k, block_n), dtype=rhs.dtype, buffer=nl.sbuf)
            for bk in nl.affine_range(tiles_k):
                b[:, bk, :] = nl.load(rhs[nl.ds(k * block_k + bk * TILE_K, TILE_K), nl.ds(n * block_n, block_n)])
            for m in nl.affine_range(num_block_m):
                a = nl.ndarray((TILE_K, tiles_k, block_m), dtype=lhsT.dtype, buffer=nl.sbuf)
                for bk in nl.affine_range(tiles_k):
                    a[:, bk, :] = nl.load(lhsT[nl.ds(k * block_k + bk * TILE_K, TILE_K), nl.ds(m * block_m, block_m)])
                for bn in nl.affine_range(tiles_n):
                    for bm in nl.affine_range(tiles_m):
                        acc = nl.zeros((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
                        for bk in nl.affine_range(tiles_k):
                            acc += nisa.nc_matmul(a[:, bk, nl.ds(bm * TILE_M, TILE_M)],
                                                  b[:, bk, nl.ds(bn * TILE_N, TILE_N)])
                        partial[:, m * tiles_m + bm, nl.ds(bn * TILE_N, TILE_N)] += acc
        for mt in nl.affine_range(num_block_m * tiles_m):
            nl.store(result[nl.ds(mt * TILE_M, TILE_M), nl.ds(n * block_n, block_n)],
                     nl.copy(partial[:, mt, :], dtype=result.dtype))
    return result


SCHEDULES = {"tiled": matmul_tiled, "hoisted": matmul_hoisted, "block_free": matmul_block_free,
             "fully_optimized": matmul_fully_optimized}
