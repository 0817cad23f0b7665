"""Every hardware/language rule the emulator enforces raises, naming the rule, on a kernel that breaks it."""

from __future__ import annotations

import numpy as np
import pytest

from neuronmm_kernels.emulator import NKIRuleError, TensorSpec, nisa, nki, nl, run
from neuronmm_kernels.reference import BF16

F32 = nl.float32


def _raises(rule: str, kernel, *args, **kwargs):
    with pytest.raises(NKIRuleError) as err:
        run(nki.jit(kernel), *args, **kwargs)
    assert err.value.rule == rule, str(err.value)
    assert rule in str(err.value)


def _x(*shape):
    return np.ones(shape, dtype=BF16)


def test_partition_limit_on_allocation_and_load():
    _raises("err_num_partition_exceed_arch_limit", lambda x: nl.ndarray((256, 4), BF16, buffer=nl.sbuf), _x(1, 1))
    _raises("err_num_partition_exceed_arch_limit", lambda x: nl.exp(nl.load(x)), _x(256, 4))


def _mm(s_shape, m_shape, s_buf=None, dtype=BF16):
    def k(x):
        s = nl.zeros(s_shape, dtype, buffer=s_buf or nl.sbuf)
        m = nl.zeros(m_shape, dtype, buffer=nl.sbuf)
        acc = nl.zeros((128, 512), F32, buffer=nl.psum)  # the matmul is checked first
        acc += nisa.nc_matmul(s, m)
    return k


def test_matmul_tile_limits():
    _raises("matmul_stationary_free_le_128", _mm((128, 256), (128, 512)), _x(1, 1))
    _raises("matmul_moving_free_le_512", _mm((128, 128), (128, 1024)), _x(1, 1))
    _raises("matmul_contraction_partitions", _mm((128, 128), (64, 512)), _x(1, 1))


def test_matmul_memory_spaces():
    _raises("matmul_operands_in_sbuf", _mm((128, 128), (128, 512), s_buf=nl.psum, dtype=F32), _x(1, 1))

    def into_sbuf(x):
        a = nl.load(x)
        out = nl.ndarray((128, 128), F32, buffer=nl.sbuf)
        out[...] = nisa.nc_matmul(a, a)

    _raises("matmul_dst_in_psum", into_sbuf, _x(128, 128))

    def accumulate_in_sbuf(x):
        a = nl.load(x)
        out = nl.zeros((128, 128), F32, buffer=nl.sbuf)
        out += nisa.nc_matmul(a, a)

    _raises("matmul_dst_in_psum", accumulate_in_sbuf, _x(128, 128))


def test_matmul_dtypes():
    def mixed(x):
        a = nl.load(x)
        b = nl.load(x, dtype=F32)
        acc = nl.zeros((128, 128), F32, buffer=nl.psum)
        acc += nisa.nc_matmul(a, b)

    _raises("matmul_dtype_mix", mixed, _x(128, 128))

    def bf16_psum(x):
        a = nl.load(x)
        acc = nl.zeros((128, 128), BF16, buffer=nl.psum)
        acc += nisa.nc_matmul(a, a)

    _raises("matmul_psum_fp32", bf16_psum, _x(128, 128))


def test_psum_capacity_and_banks():
    def nine_banks(x):
        for _ in range(9):
            nl.zeros((128, 512), F32, buffer=nl.psum)

    _raises("psum_capacity", nine_banks, _x(1, 1))

    def crossing(x):
        a = nl.load(x)
        acc = nl.zeros((128, 1024), F32, buffer=nl.psum)
        acc[:, 256:768] += nisa.nc_matmul(a[:, 0:128], a)

    _raises("psum_tile_bank", crossing, _x(128, 512))

    def eight_banks_ok(x):
        for _ in range(8):
            nl.zeros((128, 512), F32, buffer=nl.psum)
        out = nl.ndarray((1, 1), BF16, buffer=nl.shared_hbm)
        nl.store(out, 1.0)
        return out

    run(nki.jit(eight_banks_ok), _x(1, 1))


def test_sbuf_capacity_counts_live_tensors_only():
    def too_big(x):
        a = nl.ndarray((128, 100 * 1024 // 2), BF16, buffer=nl.sbuf)
        b = nl.ndarray((128, 80 * 1024 // 2), BF16, buffer=nl.sbuf)

    _raises("sbuf_capacity", too_big, _x(1, 1))

    def loop_reuse(x):  # a buffer allocated per iteration dies with the iteration
        out = nl.ndarray((1, 1), BF16, buffer=nl.shared_hbm)
        for i in nl.affine_range(4):
            nl.ndarray((128, 100 * 1024 // 2), BF16, buffer=nl.sbuf)
        nl.store(out, 1.0)
        return out

    _, trace = run(nki.jit(loop_reuse), _x(1, 1))
    assert trace.peak_sbuf_bytes == 100 * 1024


def test_shapes_of_ops():
    _raises("err_num_partition_mismatch", lambda x: nl.multiply(nl.load(x[0:64, :]), nl.load(x)), _x(128, 8))

    def bad_store(x):
        out = nl.ndarray((128, 8), BF16, buffer=nl.shared_hbm)
        nl.store(out, nl.load(x[:, 0:16]))

    _raises("err_store_dst_shape_smaller_than_other_shape", bad_store, _x(128, 16))
    _raises("err_tensor_access_out_of_bound", lambda x: nl.load(x[0:200, :]), _x(128, 8))
    _raises("err_insufficient_rank", lambda x: nl.ndarray((128,), BF16, buffer=nl.sbuf), _x(1, 1))
    _raises("err_start_partition", lambda x: nl.exp(nl.load(x)[16:80, :]), _x(128, 8))


def test_python_if_on_loop_index_is_refused():
    def branchy(x):
        for i in nl.affine_range(2):
            if i:
                pass

    _raises("err_control_flow_condition_depending_on_loop_index", branchy, _x(1, 1))


def test_modulo_and_floor_division_of_loop_indices_address_tiles():
    """AWS's attention kernel indexes a double buffer with `i_tile_q % 2` (nki-samples 6905a68,
    attention_kernels.py:1041): % and // of a loop index are legal addresses, and count as using it."""
    def double_buffered(x):
        out = nl.ndarray((4, 8), BF16, buffer=nl.shared_hbm)
        buf = nl.ndarray((4, 2, 2, 1), BF16, buffer=nl.sbuf)
        for i in nl.affine_range(4):
            buf[:, i % 2, i // 2, :] = nl.load(x[:, nl.ds(i * 2, 1)])
            nl.store(out[:, nl.ds(i * 2, 2)], nl.load(x[:, nl.ds(i * 2, 2)]))
        return out

    y, _ = run(nki.jit(double_buffered), np.arange(32, dtype=np.float32).reshape(4, 8).astype(BF16))
    assert (y.astype(np.float32) == np.arange(32).reshape(4, 8)).all()


def test_scopes_memory_and_outputs():
    def out_of_scope(x):
        for _ in nl.affine_range(1):
            t = nl.load(x)
        nl.exp(t)

    _raises("err_local_variable_used_out_of_scope", out_of_scope, _x(4, 4))
    _raises("err_store_from_psum", lambda x: nl.store(nl.ndarray((4, 4), BF16, buffer=nl.shared_hbm),
                                                       nl.zeros((4, 4), F32, buffer=nl.psum)), _x(4, 4))
    _raises("err_unsupported_memory", lambda x: nl.load(nl.load(x)), _x(4, 4))
    _raises("err_cannot_update_immutable_parameter", lambda x: nl.store(x, nl.load(x)), _x(4, 4))

    def partial_output(x):
        out = nl.ndarray((8, 4), BF16, buffer=nl.shared_hbm)
        nl.store(out[0:4, :], nl.load(x))
        return out

    _raises("err_tensor_output_not_written_to", partial_output, _x(4, 4))

    def hbm_in_loop(x):
        for _ in nl.affine_range(1):
            nl.ndarray((4, 4), BF16, buffer=nl.shared_hbm)

    _raises("err_shared_hbm_scope", hbm_in_loop, _x(4, 4))

    def make_output(shape):  # SDK docs nki.errors err_shared_hbm_must_in_kernel_level: not in a called function
        return nl.ndarray(shape, BF16, buffer=nl.shared_hbm)

    def hbm_in_helper(x):
        out = make_output(x.shape)
        nl.store(out, nl.load(x))
        return out

    _raises("err_shared_hbm_scope", hbm_in_helper, _x(4, 4))
    _raises("err_leading_dimension_of_tensor_must_be_partition",
            lambda x: nl.ndarray((2, nl.par_dim(128), 4), BF16, buffer=nl.sbuf), _x(4, 4))
    with pytest.raises(NKIRuleError, match="outside"):
        nl.ndarray((4, 4), BF16)


def test_bf16_rounding_nan_fill_and_trace_only():
    def roundtrip(x):
        out = nl.ndarray(x.shape, BF16, buffer=nl.shared_hbm)
        nl.store(out, nl.load(x))
        return out

    x = np.array([[1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9]], dtype=np.float32)  # ties round to even
    y, trace = run(nki.jit(roundtrip), x)
    assert y.dtype == BF16 and y.astype(np.float32).tolist() == [[1.0, 1.0 + 2 ** -7]]
    assert trace.hbm_bytes == 2 * 4 + 2 * 2 and trace.count("load") == 1

    def reads_garbage(x):
        out = nl.ndarray(x.shape, BF16, buffer=nl.shared_hbm)
        nl.store(out, nl.exp(nl.ndarray(x.shape, BF16, buffer=nl.sbuf)))
        return out

    assert np.isnan(run(nki.jit(reads_garbage), _x(4, 4))[0].astype(np.float32)).all()
    out, trace = run(nki.jit(roundtrip), TensorSpec((128, 4096), BF16), trace_only=True)
    assert out is None and trace.hbm_bytes == 2 * 128 * 4096 * 2
    assert trace.instrs[0].contig == 4096 * 2


def test_compat_hands_kernels_the_emulator_without_neuronxcc():
    from neuronmm_kernels import compat, emulator

    if compat.HAVE_NEURONXCC:
        pytest.skip("neuronxcc is installed: kernels get the real compiler")
    assert compat.nl is emulator.nl and compat.nisa is emulator.nisa and compat.nki is emulator.nki


def test_affine_write_must_use_the_loop_index():
    """neuronx-cc: "Unexpected output dependencies, missing indices in the dst access" (nki.errors docs)."""
    def racy(x):
        out = nl.ndarray((4, 4), BF16, buffer=nl.shared_hbm)
        for i in nl.affine_range(3):
            nl.store(out, nl.load(x))  # every iteration writes all of out
        return out

    _raises("err_unexpected_output_dependencies", racy, _x(4, 4))
    # found in trace-only (loop-sampled) runs too
    with pytest.raises(NKIRuleError, match="err_unexpected_output_dependencies"):
        run(nki.jit(racy), TensorSpec((4, 4), BF16), trace_only=True)

    def one_trip(x):  # a single iteration cannot race, but the compiler's rule is about the address
        out = nl.ndarray((4, 4), BF16, buffer=nl.shared_hbm)
        for _ in nl.affine_range(1):
            nl.store(out, nl.load(x))
        return out

    _raises("err_unexpected_output_dependencies", one_trip, _x(4, 4))

    def one_trip_sbuf(x):  # the same for an on-chip tensor declared outside the loop
        out = nl.ndarray((4, 4), BF16, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 4), BF16, buffer=nl.sbuf)
        for _ in nl.affine_range(1):
            t[...] = nl.load(x)
        nl.store(out, t)
        return out

    _raises("err_unexpected_output_dependencies", one_trip_sbuf, _x(4, 4))

    def outer_index_missing(x):  # the inner index alone is not enough: every enclosing affine loop counts
        out = nl.ndarray((2, 4), BF16, buffer=nl.shared_hbm)
        for _ in nl.affine_range(2):
            for j in nl.affine_range(2):
                nl.store(out[j:j + 1, :], nl.load(x[0:1, :]))
        return out

    _raises("err_unexpected_output_dependencies", outer_index_missing, _x(4, 4))

    def sequential_ok(x):
        out = nl.ndarray((4, 4), BF16, buffer=nl.shared_hbm)
        for i in nl.sequential_range(3):
            nl.store(out, nl.load(x))
        for _ in nl.sequential_range(1):
            nl.store(out, nl.load(x))
        return out

    run(nki.jit(sequential_ok), _x(4, 4))

    def reduction_ok(x):  # `+=` into a tensor declared outside is an associative reduction
        out = nl.ndarray((4, 4), BF16, buffer=nl.shared_hbm)
        acc = nl.zeros((4, 4), F32, buffer=nl.sbuf)
        for i in nl.affine_range(3):
            acc += nl.load(x)
        nl.store(out, nl.copy(acc, dtype=BF16))
        return out

    y, _ = run(nki.jit(reduction_ok), _x(4, 4))
    assert (y.astype(np.float32) == 3).all()


def test_sdk_2_25_surface():
    """tile_size.total_available_sbuf_size is a 2.26 addition; shared_identity_matrix is 2.25 (nki.language docs)."""
    assert not hasattr(nl.tile_size, "total_available_sbuf_size")

    def identity(x):
        out = nl.ndarray((128, 128), F32, buffer=nl.shared_hbm)
        nl.store(out, nl.load(nl.shared_identity_matrix(128, dtype=F32)))
        return out

    y, _ = run(nki.jit(identity), _x(1, 1))
    assert (y == np.identity(128)).all()


def _masked_exp(x):
    """Ragged rows handled by masks over arange indices (the AWS docs' idiom)."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    n, f = x.shape
    i_f = nl.arange(f)[None, :]
    for p in nl.affine_range((n + 127) // 128):
        i_p = p * 128 + nl.arange(128)[:, None]
        t = nl.load(x[i_p, i_f], mask=(i_p < n))
        nl.store(out[i_p, i_f], value=nl.exp(t, mask=(i_p < n)), mask=(i_p < n))
    return out


def test_arange_indexing_and_masks():
    x = (np.arange(300 * 5).reshape(300, 5) % 7 / 7).astype(np.float32)
    y, trace = run(nki.jit(_masked_exp), x)
    np.testing.assert_allclose(y, np.exp(x), rtol=1e-6)
    assert trace.hbm_bytes == 2 * x.nbytes  # the masked tail moves only its 44 rows

    def grid_copy(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        g = nl.mgrid[0:4, 0:6]
        nl.store(out[g.p, g.x], nl.load(x[g.p, g.x]))
        return out

    y, _ = run(nki.jit(grid_copy), x[:4, :].repeat(2, axis=1)[:, :6].copy())
    assert y.shape == (4, 6)


def test_arange_and_mask_rules():
    def unmasked_tail(x):
        i_p = nl.arange(128)[:, None]
        nl.load(x[i_p, nl.arange(5)[None, :]])

    _raises("err_tensor_access_out_of_bound", unmasked_tail, _x(100, 5))
    _raises("err_1d_arange_not_supported", lambda x: nl.load(x[nl.arange(4), 0]), _x(4, 4))
    _raises("err_unsupported_mixing_basic_advanced_tensor_indexing",
            lambda x: nl.load(x[nl.arange(4)[:, None], :]), _x(4, 4))

    def python_and(x):
        i = nl.arange(4)[:, None]
        nl.load(x[i, nl.arange(4)[None, :]], mask=(i < 3) and (i > 0))

    _raises("err_mask_boolean_operator", python_and, _x(4, 4))

    def if_on_arange(x):
        if nl.arange(4)[:, None] < 2:
            pass

    _raises("err_mask_boolean_operator", if_on_arange, _x(4, 4))


def test_held_matmul_results_occupy_psum_banks():
    def held(x):
        a = nl.load(x)
        results = [nisa.nc_matmul(a, a) for _ in range(4)]  # kept, not accumulated: 4 banks
        for _ in range(5):
            nl.zeros((128, 512), F32, buffer=nl.psum)

    _raises("psum_capacity", held, _x(128, 128))

    def consumed(x):
        out = nl.ndarray((1, 1), BF16, buffer=nl.shared_hbm)
        nl.store(out, 1.0)
        a = nl.load(x)
        acc = nl.zeros((128, 128), F32, buffer=nl.psum)
        for _ in nl.affine_range(20):
            acc += nisa.nc_matmul(a, a)  # each result is released into the accumulator
        for _ in range(7):
            nl.zeros((128, 512), F32, buffer=nl.psum)

        return out

    run(nki.jit(consumed), _x(128, 128))


def test_fp32_pe_transpose_is_refused():
    """It compiles, but trn1 returns a wrong result (AWS transposes fp32 with an identity matmul instead)."""
    _raises("pe_transpose_fp32_inexact", lambda x: nisa.nc_transpose(nl.load(x)), np.ones((4, 4), np.float32))

    def bf16_transpose(x):
        out = nl.ndarray((4, 4), F32, buffer=nl.shared_hbm)
        nl.store(out, nl.copy(nisa.nc_transpose(nl.load(x)), dtype=F32))
        return out

    y, _ = run(nki.jit(bf16_transpose), np.arange(16, dtype=np.float32).reshape(4, 4).astype(BF16))
    assert (y == np.arange(16).reshape(4, 4).T).all()


def test_affine_access_patterns_stride_free_dims_only():
    """Affine index expressions (AWS transpose2d tutorial form) alias the tensor; partitions keep step 1 from 0."""
    x = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)

    def strided(t):
        out = nl.ndarray((4, 2, 8), F32, buffer=nl.shared_hbm)
        i_p, i_j, i_f = nl.arange(4)[:, None, None], nl.arange(2)[None, :, None], nl.arange(8)[None, None, :]
        rows = nl.load(t)
        nl.store(out, nl.copy(rows[i_p, 2 * i_f + i_j]))  # free-dim stride 2 in SBUF
        return out

    y, _ = run(nki.jit(strided), x)
    assert np.array_equal(y, x.reshape(4, 8, 2).transpose(0, 2, 1))

    def partition_stride(t):
        rows = nl.load(t)
        nl.copy(rows[2 * nl.arange(2)[:, None], nl.arange(16)[None, :]])

    def partition_from_free_axis(t):
        rows = nl.load(t)
        nl.copy(rows[nl.arange(4)[:, None], nl.arange(4)[:, None] + nl.arange(8)[None, :]])

    _raises("err_unsupported_partition_access", partition_stride, x)
    _raises("err_unsupported_partition_access", partition_from_free_axis, x)
    _raises("err_tensor_access_out_of_bound", lambda t: nl.load(t[nl.arange(4)[:, None], 3 * nl.arange(8)[None, :]]), x)


def test_a_loop_without_trips_is_refused_but_static_range_may_have_none():
    """neuronx-cc compiles an affine/sequential loop's body once whatever its trip count (only static_range unrolls
    while tracing), so an empty loop is no way to skip code there: a Python `if` is."""

    def empty(kind):
        def k(x):
            out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
            for _ in kind(0):
                nl.load(x)
            nl.store(out, nl.load(x))
            return out
        return k

    _raises("zero_trip_loop", empty(nl.affine_range), _x(4, 4))
    _raises("zero_trip_loop", empty(nl.sequential_range), _x(4, 4))
    run(nki.jit(empty(nl.static_range)), _x(4, 4))
