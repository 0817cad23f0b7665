"""The `nl` (neuronxcc.nki.language) subset our kernels use, emulated with NumPy.

Engine choices mirror what the compiler usually picks on trn1: DMA for load/store, ScalarE (act)
for unary maths and nl.copy, VectorE (dve) for binary arithmetic and assignments between tiles.
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np

from . import core
from .core import (PSUM, SBUF, SHARED_HBM, PRIVATE_HBM, DynSlice, Instr, LoopIndex, NKIRuleError, Storage, Tensor,
                   check_tile, ctx)

bfloat16, float32, float16, int32, int8, uint8 = (core.bfloat16, core.float32, core.float16, core.int32,
                                                  core.int8, core.uint8)
tfloat32 = core.float32  # emulated as float32
bool_ = core.uint8
sbuf, psum, shared_hbm, private_hbm, hbm = SBUF, PSUM, SHARED_HBM, PRIVATE_HBM, PRIVATE_HBM

# SDK 2.25's tile_size: total_available_sbuf_size arrived in 2.26 (aws-neuron-sdk 0521004c,
# general/nki/nki_rn.rst:18), so a kernel for the 2.25 target must not read it.
tile_size = types.SimpleNamespace(pmax=core.PMAX, gemm_stationary_fmax=core.GEMM_STATIONARY_FMAX,
                                  gemm_moving_fmax=core.GEMM_MOVING_FMAX, psum_fmax=core.PSUM_FMAX,
                                  bn_stats_fmax=512)


class par_dim:  # noqa: N801 - NKI's name
    """Marks the partition dimension; only legal as the leading dimension (block dims are errors from 2.25)."""

    def __init__(self, n: int):
        self.n = int(n)


def arange(start: int, stop: int | None = None) -> core.IndexExpr:
    """Index values [start, stop) (or [0, start)); use as nl.arange(n)[:, None] or [None, :]."""
    lo, hi = (0, start) if stop is None else (start, stop)
    return core.IndexExpr(np.arange(core.as_int(lo), core.as_int(hi)))


class _Grid(tuple):
    """nl.mgrid result: unpacks into index expressions, or .p (partition), .x, .y, .z (free dims)."""

    p = property(lambda self: self[0])
    x = property(lambda self: self[1])
    y = property(lambda self: self[2])
    z = property(lambda self: self[3])


class _MGrid:
    def __getitem__(self, key) -> _Grid:
        key = key if isinstance(key, tuple) else (key,)
        n = len(key)
        out = []
        for i, k in enumerate(key):
            shape = [1] * n
            vals = np.arange(core.as_int(k.start or 0), core.as_int(k.stop))
            shape[i] = len(vals)
            out.append(core.IndexExpr(vals.reshape(shape)))
        return _Grid(out)


mgrid = _MGrid()


def ds(start, size: int) -> DynSlice:
    """The index range [start, start + size)."""
    return DynSlice(start, size)


# ---------------------------------------------------------------- loops

def _loop(kind: str, args, static: bool = False):
    c = ctx()
    trips = range(*(core.as_int(a) for a in args))
    if not trips and not static:
        # neuronx-cc traces an affine/sequential loop's body once, with a symbolic index, whatever its trip count
        # (only static_range unrolls at trace time), so an empty loop's body still compiles, zero-size or
        # out-of-bounds slices and all: run nothing here would pass a kernel that does not compile there
        raise core.NKIRuleError("zero_trip_loop", f"{kind}_range{tuple(args)} has no iterations; neuronx-cc still "
                                "compiles its body: skip the loop with a Python `if` instead")
    if c.sample_loops and not static and len(trips) > 2:
        # trace-only sampling: iterations differ only in addresses, so run the first one standing for
        # all but one, and the last one (bounds checks at both ends)
        plan = [(trips[0], len(trips) - 1), (trips[-1], 1)]
    else:
        plan = [(v, 1) for v in trips]
    uid, c.next_loop_uid = c.next_loop_uid, c.next_loop_uid + 1
    for v, weight in plan:
        c.push_scope()
        c.weight *= weight
        c.loops.append((uid, kind, v, len(c.scopes)))
        try:
            yield v if static else LoopIndex(v, frozenset((uid,)))
        finally:
            c.loops.pop()
            c.weight //= weight
            c.pop_scope()


def affine_range(*args, **_):
    """A loop without loop-carried dependencies (executed eagerly; the index refuses Python `if`)."""
    return _loop("affine", args)


def sequential_range(*args, **_):
    """A loop with loop-carried dependencies (executed in order)."""
    return _loop("sequential", args)


def static_range(*args, **_):
    """A fully unrolled loop: the body sees plain ints."""
    return _loop("static", args, static=True)


# ---------------------------------------------------------------- allocation

def _shape(shape) -> tuple:
    out = []
    for i, s in enumerate(shape):
        if isinstance(s, par_dim):
            if i != 0:
                raise NKIRuleError("err_leading_dimension_of_tensor_must_be_partition",
                                   "block dimensions before par_dim are errors from SDK 2.25; fold them into "
                                   "the free dims or allocate inside the loop")
            s = s.n
        out.append(int(s))
    return tuple(out)


def _new(shape, dtype, buffer, name="", fill=None, fresh: Instr | None = None) -> Tensor:
    c = ctx()
    buffer = SBUF if buffer is None else buffer
    shape = _shape(shape)
    if buffer.on_chip:
        if len(shape) < 2:
            raise NKIRuleError("err_insufficient_rank", f"SBUF/PSUM tensors need >= 2 dims, got {shape}")
        if shape[0] > core.PMAX:
            raise NKIRuleError("err_num_partition_exceed_arch_limit",
                               f"partition dim {shape[0]} exceeds architecture limitation of {core.PMAX}")
    elif buffer is SHARED_HBM and (len(c.scopes) > 1 or _caller_code() is not c.kernel_code):
        # SDK docs general/nki/api/nki.errors.rst:581-615 (err_shared_hbm_must_in_kernel_level): not in a
        # loop, not under an if, not in a function the kernel calls
        raise NKIRuleError("err_shared_hbm_scope", "nl.shared_hbm tensors can only be created in the kernel "
                           "function's own top level (not in a loop or a helper it calls)")
    st = Storage(shape, dtype, buffer, name=name, fill=fill)
    if buffer is SHARED_HBM and c.compute:
        st.written = np.zeros(shape, dtype=bool)
    c.allocate(st, check=fresh is None or buffer is not PSUM)
    t = Tensor(st)
    t.fresh = fresh
    return t


def _caller_code():
    """Code object of the first frame outside the emulator: the kernel code that made this call."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(__package__):
        frame = frame.f_back
    return None if frame is None else frame.f_code


def shared_identity_matrix(n: int, dtype=uint8, **_) -> Tensor:
    """An n x n identity in HBM (a compiler-shared constant, SDK 2.25 nki.language); nl.load it to use it."""
    st = Storage((n, n), dtype, SHARED_HBM, name="identity",
                 data=np.identity(n).astype(dtype) if ctx().compute else None)
    st.is_param = True  # a constant: kernels read it, never write it
    return Tensor(st)


def ndarray(shape, dtype, *, buffer=None, name="", **_) -> Tensor:
    """An uninitialised tensor (NaN-filled so reads of unwritten data show)."""
    return _new(shape, dtype, buffer, name)


def zeros(shape, dtype, *, buffer=None, name="", **_) -> Tensor:
    """A zero-filled on-chip tensor (a PSUM accumulator, or an SBUF memset on GpSimd)."""
    buffer = SBUF if buffer is None else buffer
    if not buffer.on_chip:
        raise NKIRuleError("err_hbm_tensor_with_init_value", "HBM tensors cannot be created with an init value")
    t = _new(shape, dtype, buffer, name, fill=0)
    if buffer is SBUF:  # PSUM zeros fold into the first matmul of the accumulation group
        ctx().record(Instr("pool", "memset", parts=t.shape[0], free=t.free_size()))
    return t


def _release(t: Tensor) -> None:
    """A fresh op result written straight into its destination never occupied memory of its own."""
    c = ctx()
    scope = c.scopes[-1]
    for i in range(len(scope) - 1, -1, -1):
        if scope[i] is t.st:
            del scope[i]
            if t.st.buffer is SBUF:
                c.sbuf_live -= t.st.bytes_per_partition
            elif t.st.buffer is PSUM:
                c.psum_banks_live -= t.st.banks
            return


# ---------------------------------------------------------------- data movement

def load(src: Tensor, *, mask=None, dtype=None, **_) -> Tensor:
    """HBM -> a new SBUF tile (axis 0 of the view becomes the partition axis); mask shrinks the DMA."""
    rect = _mask_rect(mask, src.shape)
    full, src = src, (src if rect is None else src.restrict(rect))
    src.check_alive()
    if src.buffer.on_chip:
        raise NKIRuleError("err_unsupported_memory", f"nl.load reads HBM, got {src}")
    if src.ndim < 2:
        raise NKIRuleError("err_insufficient_rank", f"a loaded tile needs 2 dims, got {src.shape}")
    nbytes = math.prod(src.shape) * src.dtype.itemsize
    instr = ctx().record(Instr("dma", "load", parts=src.shape[0], free=math.prod(src.shape[1:]), nbytes=nbytes,
                               contig=min(core.hbm_contiguous_bytes(src), nbytes // src.shape[0])))
    out = _new(full.shape, dtype or src.dtype, SBUF, fresh=instr)
    (out if rect is None else out.restrict(rect)).write(src.read())
    return out


def store(dst: Tensor, value, *, mask=None, **_) -> None:
    """An SBUF tile (or scalar) -> HBM; mask limits what is written."""
    rect = _mask_rect(mask, dst.shape)
    if rect is not None:
        dst = dst.restrict(rect)
        if isinstance(value, Tensor) and tuple(value.shape) != tuple(dst.shape):
            value = value.restrict(rect)
    dst.check_alive()
    if dst.buffer.on_chip:
        raise NKIRuleError("err_unsupported_memory", f"nl.store writes HBM, got {dst}")
    if dst.shape[0] > core.PMAX:
        raise NKIRuleError("err_num_partition_exceed_arch_limit", f"store of {dst.shape[0]} partitions > 128")
    if isinstance(value, Tensor):
        check_tile(value, "nl.store value")
        if value.buffer is PSUM:  # "nl.store supports PSUM" is a 2.26 NKI release note (aws-neuron-sdk
            # 0521004c general/nki/nki_rn.rst:33); the 2.25 notes have no NKI section saying so
            raise NKIRuleError("err_store_from_psum", "nl.store of a PSUM tile needs SDK >= 2.26; nl.copy it "
                               "to SBUF first (target SDK 2.25)")
        _check_fits(dst, value.shape)
    nbytes = math.prod(dst.shape) * dst.dtype.itemsize
    ctx().record(Instr("dma", "store", parts=dst.shape[0], free=math.prod(dst.shape[1:]), nbytes=nbytes,
                       contig=min(core.hbm_contiguous_bytes(dst), nbytes // dst.shape[0])))
    dst.write(value.read() if isinstance(value, Tensor) else value)


def _no_mask(mask) -> None:
    if mask is not None:
        raise NKIRuleError("emulator_unsupported", "masks on this instruction are not emulated")


def _mask_rect(mask, shape) -> tuple | None:
    """The sub-rectangle of an instruction's index grid that a mask keeps (None: no mask)."""
    if mask is None:
        return None
    if not isinstance(mask, core.Mask):
        raise NKIRuleError("err_mask_type", f"mask must be a comparison of index expressions, got {mask!r}")
    try:
        m = np.broadcast_to(mask.v, tuple(shape))
    except ValueError:
        raise NKIRuleError("err_mask_shape", f"mask {mask.v.shape} does not fit the instruction {shape}") from None
    rect = []
    for a in range(m.ndim):
        hit = np.nonzero(m.any(axis=tuple(i for i in range(m.ndim) if i != a)))[0]
        rect.append((int(hit[0]), int(hit[-1]) + 1) if len(hit) else (0, 0))
    if m.sum() != math.prod(r1 - r0 for r0, r1 in rect):
        raise NKIRuleError("emulator_unsupported", "only masks selecting a rectangle are emulated")
    if any(r1 == r0 for r0, r1 in rect):
        raise NKIRuleError("emulator_unsupported", "a mask that selects nothing")
    return tuple(rect)


def _masked_write(out: Tensor, values, rect) -> None:
    """Write an op's full result, or only the mask's rectangle of it."""
    if rect is None or values is None:
        out.write(values)
        return
    sel = tuple(slice(r0, r1) for r0, r1 in rect)
    out.restrict(rect).write(np.broadcast_to(values, out.shape)[sel])


def _check_fits(dst: Tensor, src_shape) -> None:
    if tuple(dst.shape) == tuple(src_shape):
        return
    try:
        ok = np.broadcast_shapes(tuple(src_shape), tuple(dst.shape)) == tuple(dst.shape)
    except ValueError:
        ok = False
    if not ok:
        raise NKIRuleError("err_store_dst_shape_smaller_than_other_shape",
                           f"cannot write shape {tuple(src_shape)} into {tuple(dst.shape)}")


def assign(dst: Tensor, value, reduction: bool = False) -> None:
    """`dst[...] = value`: an op result lands in dst directly; a tile is copied (VectorE)."""
    c = ctx()
    if not dst.buffer.on_chip:
        raise NKIRuleError("err_unsupported_memory", f"assignment into HBM {dst}; use nl.store")
    check_tile(dst, "assignment destination")
    if not isinstance(value, Tensor):
        c.record(Instr("dve", "memset", parts=dst.shape[0], free=dst.free_size(), psum=dst.buffer is PSUM))
        dst.write(value, reduction)
        return
    _check_fits(dst, value.shape)
    if value.fresh is not None:
        instr = value.fresh
        if instr.engine == "pe":
            if dst.buffer is not PSUM:
                raise NKIRuleError("matmul_dst_in_psum", f"Matmult dst tensor is not psum: {dst}")
            _check_psum_tile(dst)
        elif instr.engine == "dma" and dst.buffer is not SBUF:
            raise NKIRuleError("err_unsupported_memory", f"nl.load writes SBUF, not {dst.buffer}")
        elif dst.buffer is PSUM:
            instr.psum = True
        value.fresh = None
        _release(value)
    else:
        check_tile(value, "assignment source")
        c.record(Instr("dve", "tensor_copy", parts=dst.shape[0], free=dst.free_size(),
                       psum=PSUM in (dst.buffer, value.buffer)))
    dst.write(value.read(), reduction)


def _check_psum_tile(t: Tensor) -> None:
    """A matmul/transpose result tile holds <= 512 fp32 per partition inside one 2 KiB bank."""
    if t.dtype != float32:
        raise NKIRuleError("matmul_psum_fp32", f"matmul/transpose output in PSUM is fp32 on trn1, got {t.dtype}")
    free = t.free_size()
    if free > core.PSUM_FMAX:
        raise NKIRuleError("psum_tile_bank", f"PSUM tile free size {free} > {core.PSUM_FMAX}")
    dims = t.st.shape
    strides = [math.prod(dims[d + 1:]) for d in range(1, len(dims))]  # element strides of dims 1..n
    first = sum(int(s) * (ix[0] if isinstance(ix, tuple) else ix) for s, ix in zip(strides, t.index[1:]))
    last = first + sum(int(s) * ((ix[1] - 1 - ix[0]) if isinstance(ix, tuple) else 0)
                       for s, ix in zip(strides, t.index[1:]))
    if first * 4 // core.PSUM_BANK_BYTES != last * 4 // core.PSUM_BANK_BYTES:
        raise NKIRuleError("psum_tile_bank", f"PSUM tile {t} crosses a {core.PSUM_BANK_BYTES} B bank")


def accumulate(dst: Tensor, value) -> None:
    """`dst += value`: matmul results accumulate in PSUM (fp32); anything else is a VectorE add."""
    if isinstance(value, Tensor) and value.fresh is not None and value.fresh.engine == "pe":
        if dst.buffer is not PSUM:
            raise NKIRuleError("matmul_dst_in_psum", f"Matmult dst tensor is not psum: {dst}")
        check_tile(dst, "accumulator")
        _check_psum_tile(dst)
        if tuple(dst.shape) != tuple(value.shape):
            raise NKIRuleError("err_shape_mismatch", f"accumulating {value.shape} into {dst.shape}")
        value.fresh = None
        _release(value)
        a, b = dst.read(), value.read()
        dst.write(None if a is None else a + b, reduction=True)
        return
    res = _binary("add", dst, value, dtype=dst.dtype)
    assign(dst, res, reduction=True)


# ---------------------------------------------------------------- compute

def _result_dtype(x, y):
    dx = x.dtype if isinstance(x, Tensor) else (float32 if isinstance(x, float) else core.int32)
    dy = y.dtype if isinstance(y, Tensor) else (float32 if isinstance(y, float) else core.int32)
    if dx == dy:
        return dx
    if dx.kind == "i" and dy.kind != "i":
        return dy
    if dy.kind == "i" and dx.kind != "i":
        return dx
    return float32


def _binary(name: str, x, y, *, dtype=None, mask=None) -> Tensor:
    tiles = [t for t in (x, y) if isinstance(t, Tensor)]
    for t in tiles:
        check_tile(t, f"nl.{name}")
    if len(tiles) == 2:
        if x.shape[0] != y.shape[0]:
            raise NKIRuleError("err_num_partition_mismatch", f"nl.{name}: {x.shape} vs {y.shape}")
        if x.buffer is PSUM and y.buffer is PSUM:
            raise NKIRuleError("err_both_inputs_in_psum", f"nl.{name}: both inputs in PSUM")
    try:
        shape = np.broadcast_shapes(*(t.shape for t in tiles))
    except ValueError:
        raise NKIRuleError("err_shape_mismatch", f"nl.{name}: shapes {[t.shape for t in tiles]}") from None
    rect = _mask_rect(mask, shape)
    out_dtype = np.dtype(dtype) if dtype is not None else _result_dtype(x, y)
    any_psum = any(t.buffer is PSUM for t in tiles)
    fast = any_psum or (all(t.dtype == bfloat16 for t in tiles) and out_dtype == bfloat16)
    instr = ctx().record(Instr("dve", "tensor_tensor" if len(tiles) == 2 else "tensor_scalar", parts=shape[0],
                               free=math.prod(shape[1:]) * (1 if fast or len(tiles) == 1 else 2), psum=any_psum))
    out = _new(shape, out_dtype, SBUF, fresh=instr)
    vals = [t.read() if isinstance(t, Tensor) else t for t in (x, y)]
    if ctx().compute:
        _masked_write(out, _BINARY[name](np.float32(vals[0]) if not isinstance(vals[0], np.ndarray) else vals[0],
                                         vals[1]), rect)
    return out


def _unary(name: str, fn):
    def op(x: Tensor, *, dtype=None, mask=None, **_) -> Tensor:
        check_tile(x, f"nl.{name}")
        rect = _mask_rect(mask, x.shape)
        instr = ctx().record(Instr("act", name, parts=x.shape[0], free=x.free_size(), psum=x.buffer is PSUM))
        out = _new(x.shape, dtype or x.dtype, SBUF, fresh=instr)
        v = x.read()
        _masked_write(out, None if v is None else fn(v), rect)
        return out

    op.__name__ = name
    op.__doc__ = f"Elementwise {name} on ScalarE; returns a new SBUF tile."
    op._np = fn  # used by nisa.activation
    return op


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


copy = _unary("copy", lambda v: v)
silu = _unary("silu", _silu)
exp = _unary("exp", np.exp)
sigmoid = _unary("sigmoid", _sigmoid)
relu = _unary("relu", lambda v: np.maximum(v, 0))
tanh = _unary("tanh", np.tanh)
square = _unary("square", np.square)

_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
           "minimum": np.minimum, "divide": np.divide}


def _binary_api(name: str):
    def op(x, y, *, dtype=None, mask=None, **_) -> Tensor:
        return _binary(name, x, y, dtype=dtype, mask=mask)

    op.__name__ = name
    op.__doc__ = f"Elementwise {name} on VectorE; returns a new SBUF tile."
    op._binary = name
    return op


add = _binary_api("add")
subtract = _binary_api("subtract")
multiply = _binary_api("multiply")
maximum = _binary_api("maximum")
minimum = _binary_api("minimum")
divide = _binary_api("divide")


def matmul(x: Tensor, y: Tensor, *, transpose_x: bool = False, mask=None) -> Tensor:
    """x @ y into a new PSUM tile; only the transpose_x=True form (x given as [K, M]) is emulated."""
    from .isa import nc_matmul

    _no_mask(mask)
    if not transpose_x:
        raise NKIRuleError("emulator_unsupported", "nl.matmul(transpose_x=False) inserts a PE transpose; pass "
                           "x as [K, M] with transpose_x=True or call nisa.nc_matmul")
    return nc_matmul(x, y)
