"""Emulator state: buffers, tensors and views, loop indices, scopes, the hardware rules, the trace.

A tensor is a Storage (buffer, shape, dtype, NumPy backing array or None in trace-only mode)
seen through a View (per storage dim either an int or a [start, stop) range). SBUF/PSUM storages
keep the partition on axis 0, so a view is a tile when it keeps axis 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

PMAX = 128  # partitions
GEMM_STATIONARY_FMAX = 128
GEMM_MOVING_FMAX = 512
PSUM_FMAX = 512
PSUM_BANK_BYTES = 2048
PSUM_BANKS = 8
# usable per partition on NC-v2: 192 KiB physical minus the compiler's 16 KiB reserve (SDK 2.25 docs
# general/nki/nki_direct_allocation_guide.rst:154 and api/nki/compiler/sbuf.py:52, aws-neuron-sdk b0b4e3d6)
SBUF_BYTES_PER_PARTITION = 176 * 1024

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float16 = np.dtype(np.float16)
int32 = np.dtype(np.int32)
int8 = np.dtype(np.int8)
uint8 = np.dtype(np.uint8)


class NKIRuleError(Exception):
    """A kernel broke a hardware or language rule; `rule` names it (NKI error names where they exist)."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


class Buffer:
    """A memory space: HBM (linear), SBUF or PSUM (128 partitions)."""

    def __init__(self, name: str, on_chip: bool):
        self.name, self.on_chip = name, on_chip

    def __repr__(self) -> str:
        return f"nl.{self.name}"


SHARED_HBM = Buffer("shared_hbm", False)
PRIVATE_HBM = Buffer("private_hbm", False)
SBUF = Buffer("sbuf", True)
PSUM = Buffer("psum", True)


@dataclass
class Instr:
    """One traced instruction: engine ('pe', 'act', 'dve', 'pool', 'dma'), op and its cost inputs."""

    engine: str
    op: str
    parts: int = 0          # partitions touched
    free: int = 0           # elements per partition (moving free size N for matmul)
    stat_free: int = 0      # matmul stationary free size M
    nbytes: int = 0         # DMA bytes
    contig: int = 0         # DMA contiguous bytes per partition (HBM side)
    psum: bool = False      # reads or writes PSUM (Vector/Scalar share the PSUM port)
    fp32: bool = False      # matmul with fp32 operands (4x slower)
    flops: int = 0          # useful matmul flops (transposes count none)
    count: int = 1          # how many times it ran (loop sampling records one iteration for many)


@dataclass
class Trace:
    """Everything a kernel run did: instructions, HBM traffic, peak on-chip footprint."""

    instrs: list = field(default_factory=list)
    peak_sbuf_bytes: int = 0  # per partition
    peak_psum_banks: int = 0

    def count(self, op: str) -> int:
        """Number of executed instructions with this op name."""
        return sum(i.count for i in self.instrs if i.op == op)

    @property
    def hbm_bytes(self) -> int:
        """Bytes moved between HBM and on-chip memory by DMA."""
        return sum(i.nbytes * i.count for i in self.instrs if i.engine == "dma")

    @property
    def matmul_flops(self) -> int:
        """Useful matmul flops (2*K*M*N per nc_matmul, transposes excluded)."""
        return sum(i.flops * i.count for i in self.instrs)


class Context:
    """State of one kernel run (set while the kernel body executes)."""

    def __init__(self, compute: bool, sample_loops: bool = False):
        self.compute = compute
        self.sample_loops = sample_loops
        self.kernel_code = None  # the kernel function's code: shared_hbm tensors are created only there
        self.weight = 1  # product of the sampled loops' trip weights around the current instruction
        self.loops: list[tuple] = []  # enclosing loop iterations: (loop uid, kind, iteration, scope depth)
        self.next_loop_uid = 0
        self.trace = Trace()
        self.scopes: list[list[Storage]] = [[]]
        self.sbuf_live = 0
        self.psum_banks_live = 0

    def record(self, instr: Instr) -> Instr:
        instr.count = self.weight
        self.trace.instrs.append(instr)
        return instr

    def allocate(self, st: "Storage", check: bool = True) -> None:
        """Count a new tensor as live in the current scope; check=False for PSUM matmul results
        that are usually consumed at once (accumulated or assigned), which releases them."""
        self.scopes[-1].append(st)
        if st.buffer is SBUF:
            self.sbuf_live += st.bytes_per_partition
            if self.sbuf_live > SBUF_BYTES_PER_PARTITION:
                raise NKIRuleError("sbuf_capacity", f"live SBUF {self.sbuf_live} B per partition exceeds "
                                   f"{SBUF_BYTES_PER_PARTITION} B (allocating {st.name or 'tensor'} {st.shape})")
            self.trace.peak_sbuf_bytes = max(self.trace.peak_sbuf_bytes, self.sbuf_live)
        elif st.buffer is PSUM:
            self.psum_banks_live += st.banks
            if check and self.psum_banks_live > PSUM_BANKS:
                raise NKIRuleError("psum_capacity", f"{self.psum_banks_live} live PSUM banks exceed "
                                   f"{PSUM_BANKS} x {PSUM_BANK_BYTES} B per partition (allocating {st.shape})")
            if check:  # a result about to be consumed never holds a bank of its own
                self.trace.peak_psum_banks = max(self.trace.peak_psum_banks, self.psum_banks_live)

    def push_scope(self) -> None:
        self.scopes.append([])

    def pop_scope(self) -> None:
        for st in self.scopes.pop():
            st.alive = False
            if st.buffer is SBUF:
                self.sbuf_live -= st.bytes_per_partition
            elif st.buffer is PSUM:
                self.psum_banks_live -= st.banks


_CTX: Context | None = None


def ctx() -> Context:
    """The running kernel's context; NKI calls outside a kernel are an error."""
    if _CTX is None:
        raise NKIRuleError("err_nki_api_outside_of_nki_kernel", "NKI API called outside an nki.jit kernel")
    return _CTX


def set_ctx(c: Context | None) -> None:
    global _CTX
    _CTX = c


# ---------------------------------------------------------------- loop indices

class LoopIndex:
    """A loop-index value: + - * % // with ints; refuses Python `if`. `deps` names the loops it derives from.

    % and // are legal on loop indices: AWS's own kernels index with them (nki-samples 6905a68,
    src/nki_samples/tutorials/attention_fwd_performance/attention_kernels.py:1041, `i_tile_q % 2`).
    """

    __slots__ = ("value", "deps")

    def __init__(self, value: int, deps: frozenset = frozenset()):
        self.value, self.deps = value, deps

    def __bool__(self):
        raise NKIRuleError("err_control_flow_condition_depending_on_loop_index",
                           "Python `if`/bool on a loop index is undefined in NKI; use masks or static Python ints")

    def __index__(self) -> int:
        return self.value

    def _bin(self, other, fn):
        if isinstance(other, LoopIndex):
            return LoopIndex(fn(self.value, other.value), self.deps | other.deps)
        if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
            return LoopIndex(fn(self.value, int(other)), self.deps)
        return NotImplemented

    def __add__(self, o): return self._bin(o, lambda a, b: a + b)
    def __radd__(self, o): return self._bin(o, lambda a, b: b + a)
    def __sub__(self, o): return self._bin(o, lambda a, b: a - b)
    def __rsub__(self, o): return self._bin(o, lambda a, b: b - a)
    def __mod__(self, o): return self._bin(o, lambda a, b: a % b)
    def __floordiv__(self, o): return self._bin(o, lambda a, b: a // b)

    def __mul__(self, o):
        if isinstance(o, LoopIndex):
            raise NKIRuleError("err_non_affine_index", "product of two loop indices is not affine")
        return self._bin(o, lambda a, b: a * b)

    __rmul__ = __mul__

    def _cmp(self, *_):
        raise NKIRuleError("err_control_flow_condition_depending_on_loop_index",
                           "comparing a loop index in Python control flow is undefined in NKI")

    __lt__ = __le__ = __gt__ = __ge__ = _cmp

    def __repr__(self) -> str:
        return f"LoopIndex({self.value})"


def loop_deps(*keys) -> frozenset:
    """The loops that index values (ints, loop indices, slices, nl.ds, arange expressions) derive from."""
    out = frozenset()
    for k in keys:
        if isinstance(k, (LoopIndex, IndexExpr)):
            out |= k.deps
        elif isinstance(k, DynSlice):
            out |= loop_deps(k.start)
        elif isinstance(k, slice):
            out |= loop_deps(k.start, k.stop)
    return out


def as_int(v) -> int:
    """A static int or loop-index value as a Python int (for address arithmetic)."""
    return v.value if isinstance(v, LoopIndex) else int(v)


class DynSlice:
    """nl.ds(start, size): the range [start, start + size)."""

    def __init__(self, start, size: int):
        self.start, self.size = start, size


class IndexExpr:
    """An affine index expression over nl.arange/nl.mgrid values (a broadcastable int array)."""

    __slots__ = ("v", "deps")

    def __init__(self, v, deps: frozenset = frozenset()):
        self.v = np.asarray(v, dtype=np.int64)
        self.deps = deps

    @property
    def shape(self) -> tuple:
        return self.v.shape

    def __getitem__(self, key) -> "IndexExpr":
        return IndexExpr(self.v[key], self.deps)  # e.g. nl.arange(128)[:, None]

    @staticmethod
    def _val(o):
        if isinstance(o, IndexExpr):
            return o.v
        if isinstance(o, LoopIndex) or (isinstance(o, (int, np.integer)) and not isinstance(o, bool)):
            return as_int(o)
        return None

    def _bin(self, o, fn):
        ov = self._val(o)
        return NotImplemented if ov is None else IndexExpr(fn(self.v, ov), self.deps | loop_deps(o))

    def __add__(self, o): return self._bin(o, np.add)
    def __radd__(self, o): return self._bin(o, lambda a, b: b + a)
    def __sub__(self, o): return self._bin(o, np.subtract)
    def __rsub__(self, o): return self._bin(o, lambda a, b: b - a)

    def __mul__(self, o):
        if isinstance(o, IndexExpr):
            raise NKIRuleError("err_non_affine_index", "product of two index expressions is not affine")
        return self._bin(o, np.multiply)

    __rmul__ = __mul__

    def _non_affine(self, *_):
        raise NKIRuleError("err_unsupported_expression_in_mask", "% and // of an index expression are not affine")

    __mod__ = __rmod__ = __floordiv__ = __rfloordiv__ = _non_affine

    def _cmp(self, o, fn):
        ov = self._val(o)
        return NotImplemented if ov is None else Mask(fn(self.v, ov))

    def __lt__(self, o): return self._cmp(o, np.less)
    def __le__(self, o): return self._cmp(o, np.less_equal)
    def __gt__(self, o): return self._cmp(o, np.greater)
    def __ge__(self, o): return self._cmp(o, np.greater_equal)

    def __bool__(self):
        raise NKIRuleError("err_control_flow_condition_depending_on_arange",
                           "Python control flow on an arange/mgrid value; use mask= instead")


class Mask:
    """A compile-time predicate over an instruction's index grid; combine with & (not `and`)."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = np.asarray(v, dtype=bool)

    def __and__(self, o):
        if not isinstance(o, Mask):
            return NotImplemented
        return Mask(self.v & o.v)

    __rand__ = __and__

    def __bool__(self):
        raise NKIRuleError("err_mask_boolean_operator", "masks combine with &, not `and`/`or`/`not`")


# ---------------------------------------------------------------- storage and views

def _nan_fill(shape, dtype: np.dtype) -> np.ndarray:
    if dtype.kind in "fV" or dtype == bfloat16:
        return np.full(shape, np.nan, dtype=dtype)
    return np.full(shape, np.iinfo(dtype).min if dtype.kind == "i" else np.iinfo(dtype).max, dtype=dtype)


class Storage:
    """A tensor allocation in one buffer; data is None in trace-only mode."""

    def __init__(self, shape, dtype, buffer: Buffer, name: str = "", data=None, fill=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.buffer, self.name = buffer, name
        self.alive = True
        self.is_param = False
        self.written: np.ndarray | None = None
        c = ctx()
        self.alloc_depth = len(c.scopes)
        if data is not None:
            self.data = data
        elif not c.compute:
            self.data = None
        elif fill is None:
            self.data = _nan_fill(self.shape, self.dtype)
        else:
            self.data = np.full(self.shape, fill, dtype=self.dtype)

    @property
    def bytes_per_partition(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def banks(self) -> int:
        return -(-self.bytes_per_partition // PSUM_BANK_BYTES)


def _norm_key(key, ndim: int) -> list:
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        i = next(j for j, k in enumerate(key) if k is Ellipsis)
        key = key[:i] + (slice(None),) * (ndim - len(key) + 1) + key[i + 1:]
    if len(key) > ndim:
        raise NKIRuleError("err_index_rank", f"{len(key)} indices for a {ndim}-d tensor")
    return list(key) + [slice(None)] * (ndim - len(key))


class Tensor:
    """A view of a Storage: the object kernels index, load, store and compute on."""

    __array_priority__ = 100  # keep numpy from hijacking operators

    def __init__(self, storage: Storage, index: list | None = None):
        self.st = storage
        self.index = index if index is not None else [(0, s) for s in storage.shape]
        self.fresh: Instr | None = None  # set on an op's result until it is first assigned
        self.oob = False  # an advanced-index view reaching past the tensor: legal only under a mask
        self.deps: frozenset = frozenset()  # loops whose indices address this view (output-dependency rule)

    # --- shape
    @property
    def shape(self) -> tuple:
        return tuple(e - s for ix in self.index if isinstance(ix, tuple) for s, e in [ix])

    @property
    def dtype(self):
        return self.st.dtype

    @property
    def buffer(self) -> Buffer:
        return self.st.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_tile(self) -> bool:
        return self.st.buffer.on_chip and isinstance(self.index[0], tuple)

    def np_index(self) -> tuple:
        return tuple(slice(ix[0], ix[1]) if isinstance(ix, tuple) else ix for ix in self.index)

    def __repr__(self) -> str:
        return f"Tensor({self.st.name or '?'}, {self.buffer}, shape={self.shape}, {self.dtype})"

    # --- indexing
    def __getitem__(self, key) -> "Tensor":
        self.check_alive()
        kept = [d for d, ix in enumerate(self.index) if isinstance(ix, tuple)]
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, IndexExpr) for k in keys):
            view = self._advanced(key, kept)
            view.deps = self.deps | loop_deps(*keys)
            return view
        key = _norm_key(key, len(kept))
        new = list(self.index)
        for d, k in zip(kept, key):
            lo, hi = self.index[d]
            n = hi - lo
            if isinstance(k, (int, np.integer, LoopIndex)) and not isinstance(k, bool):
                v = as_int(k)
                if not 0 <= v < n:
                    raise NKIRuleError("err_tensor_access_out_of_bound", f"index {v} out of [0, {n}) on {self}")
                new[d] = lo + v
                continue
            if isinstance(k, DynSlice):
                start, stop = as_int(k.start), as_int(k.start) + int(k.size)
            elif isinstance(k, slice):
                if k.step not in (None, 1):
                    raise NKIRuleError("emulator_unsupported", "strided slices are not emulated")
                start = 0 if k.start is None else as_int(k.start)
                stop = n if k.stop is None else as_int(k.stop)
            else:
                raise NKIRuleError("emulator_unsupported",
                                   f"index {k!r}: the emulator implements basic indexing (ints, loop indices, "
                                   "slices, nl.ds) only")
            if not 0 <= start < stop <= n:
                raise NKIRuleError("err_tensor_access_out_of_bound",
                                   f"range [{start}, {stop}) out of [0, {n}) on {self}")
            new[d] = (lo + start, lo + stop)
        view = Tensor(self.st, new)
        view.deps = self.deps | loop_deps(*keys)
        return view

    def _advanced(self, key, kept: list) -> "Tensor":
        """Index with affine arange/mgrid expressions: each must step by 1 along its own result axis."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != len(kept) or any(isinstance(k, (slice, DynSlice)) or k is Ellipsis for k in key):
            raise NKIRuleError("err_unsupported_mixing_basic_advanced_tensor_indexing",
                               "index every dim with ints, loop indices or arange expressions (no slices)")
        exprs = [k for k in key if isinstance(k, IndexExpr)]
        if any(e.v.ndim < 2 for e in exprs):
            raise NKIRuleError("err_1d_arange_not_supported", "use nl.arange(n)[:, None] / [None, :]")
        grid = np.broadcast_shapes(*(e.shape for e in exprs))
        in_order = len(exprs) == len(grid) and all(
            _owns_unit_axis(e, grid) and int(np.argmax(_affine_coefficients(np.broadcast_to(e.v, grid)))) == a
            for a, e in enumerate(exprs))
        if not in_order:  # not one +1 step per result axis, in order: a general access pattern
            return self._strided(key, kept, grid)
        new, oob = list(self.index), False
        axis = 0
        for d, k in zip(kept, key):
            lo, hi = self.index[d]
            if not isinstance(k, IndexExpr):
                v = as_int(k)
                if not 0 <= v < hi - lo:
                    raise NKIRuleError("err_tensor_access_out_of_bound", f"index {v} out of [0, {hi - lo})")
                new[d] = lo + v
                continue
            full = np.broadcast_to(k.v, grid)
            line = np.moveaxis(full, axis, 0).reshape(grid[axis], -1)
            start, size = int(line[0, 0]), grid[axis]
            oob |= start < 0 or start + size > hi - lo
            new[d] = (lo + start, lo + start + size)
            axis += 1
        t = Tensor(self.st, new)
        t.oob = oob
        return t

    def _strided(self, key, kept: list, grid: tuple) -> "Tensor":
        """A general affine access pattern (AWS's transpose2d tutorial indexes `in_tile[i_p0, i_f1*sz_f2+i_f2]`:
        aws-neuron-sdk 2086a70 general/nki/examples/transpose2d/transpose2d_nki_kernels.py): per result
        axis one element stride over the storage, as a view that aliases it (numpy as_strided).

        On-chip tensors keep the partition rule: result axis 0 walks the partitions with step 1 from
        partition 0 of the view, and no other axis moves across partitions (free-dim strides only).
        Every element must lie inside the view (no masks on this form). An HBM output may be written
        through such a pattern too (nl.store's dst takes arange/mgrid index expressions like nl.load's
        src: SDK docs nki/api/generated/nki.language.store.html, `nl.store(out_tensor[i_b, i_p, i_f],
        ...)`; the feature-major Yᵀ stores put `pack` adjacent HBM rows on each partition); its
        written-mask is aliased the same way, so unwritten output elements are still caught.
        """
        n = len(grid)
        st_strides = [math.prod(self.st.shape[d + 1:]) for d in range(len(self.st.shape))]
        base, strides = 0, [0] * n
        for d, ix in enumerate(self.index):
            lo, hi = (ix, ix + 1) if not isinstance(ix, tuple) else ix
            pos = kept.index(d) if d in kept else None
            k = key[pos] if pos is not None else 0
            full = np.broadcast_to(k.v if isinstance(k, IndexExpr) else np.int64(as_int(k)), grid)
            coef = _affine_coefficients(full)
            if full.min() < 0 or full.max() >= hi - lo:
                raise NKIRuleError("err_tensor_access_out_of_bound",
                                   f"affine index on dim {d} reaches [{int(full.min())}, {int(full.max())}] outside "
                                   f"[0, {hi - lo}) of {self}")
            if self.st.buffer.on_chip and d == 0 and (lo + int(full.flat[0]) != 0 or coef[0] != (grid[0] > 1) or any(coef[1:])):
                raise NKIRuleError("err_unsupported_partition_access",
                                   "an on-chip access pattern must walk partitions 0.. with step 1 on its first axis")
            if self.st.buffer.on_chip and d != 0 and n and coef[0]:
                raise NKIRuleError("err_unsupported_partition_access", "only the first axis may index partitions")
            base += st_strides[d] * (lo + int(full.flat[0]))
            strides = [s + st_strides[d] * c for s, c in zip(strides, coef)]
        alias = StridedStorage(self.st, grid, strides, base)
        return Tensor(alias)

    def restrict(self, rect: tuple) -> "Tensor":
        """The sub-view selected by rect (per result axis (start, stop)); bounds checked here."""
        new, axis = list(self.index), 0
        for d, ix in enumerate(self.index):
            if isinstance(ix, tuple):
                r0, r1 = rect[axis]
                new[d] = (ix[0] + r0, ix[0] + r1)
                if new[d][0] < 0 or new[d][1] > self.st.shape[d]:
                    raise NKIRuleError("err_tensor_access_out_of_bound", f"masked access still outside {self}")
                axis += 1
        view = Tensor(self.st, new)
        view.deps = self.deps
        return view

    def __setitem__(self, key, value) -> None:
        from .language import assign  # local import: language builds on core

        dst = self[key]
        if isinstance(value, Tensor) and value.st is dst.st and value.index == dst.index:
            return  # `a[...] += b` writes back the same view it already updated
        assign(dst, value)

    # --- data access
    def check_alive(self) -> None:
        if self.oob:
            raise NKIRuleError("err_tensor_access_out_of_bound",
                               f"{self} reaches past the tensor; add a mask that excludes the excess")
        if not self.st.alive:
            raise NKIRuleError("err_local_variable_used_out_of_scope",
                               f"{self} was created inside a loop body that has ended")

    def read(self) -> np.ndarray | None:
        """The view's values as float32 (None in trace-only mode)."""
        self.check_alive()
        if self.st.data is None:
            return None
        return np.asarray(self.st.data[self.np_index()], dtype=np.float32)

    def write(self, values, reduction: bool = False) -> None:
        """Store values into the view with the storage dtype's rounding (RNE for bf16).

        Plain writes (not `+=` reductions) must pass the output-dependency rule (_check_dependency).
        """
        self.check_alive()
        if self.st.is_param:
            raise NKIRuleError("err_cannot_update_immutable_parameter", f"kernel parameter {self} is immutable")
        if not reduction:
            self._check_dependency()
        if self.st.data is None or values is None:
            return
        self.st.data[self.np_index()] = np.broadcast_to(np.asarray(values), self.shape).astype(self.st.dtype)
        if self.st.written is not None:
            self.st.written[self.np_index()] = True

    def _check_dependency(self) -> None:
        """neuronx-cc's output-dependency rule, checked statically like the compiler does.

        A plain write (not a `+=` reduction) inside an affine_range loop to a tensor declared
        outside that loop must use the loop's index in its address, or iterations (which may run
        in parallel) would race: "Unexpected output dependencies, missing indices in the dst
        access" (SDK 2.26 docs general/nki/api/nki.errors.rst:777-810, aws-neuron-sdk commit
        0521004c; aws-neuron-sdk issues #1052, #1055). A one-trip loop is no exception: the rule is
        about the address expression, not the trip count. sequential_range loops are exempt.
        """
        c = ctx()
        missing = [(uid, it) for uid, kind, it, depth in c.loops
                   if kind == "affine" and depth > self.st.alloc_depth and uid not in self.deps]
        if missing:
            raise NKIRuleError("err_unexpected_output_dependencies",
                               f"Unexpected output dependencies, missing indices in the dst access: write to {self} "
                               f"in affine_range loop(s) {[u for u, _ in missing]} (iteration {missing[0][1]}) does "
                               "not use their index; index the destination by the loop variable, use "
                               "sequential_range, or drop the loop")

    def partition_start(self) -> int:
        return self.index[0][0]

    def free_size(self) -> int:
        return math.prod(self.shape[1:])

    # --- operators map to nl calls
    def __add__(self, o): from .language import add; return add(self, o)
    def __radd__(self, o): from .language import add; return add(o, self)
    def __sub__(self, o): from .language import subtract; return subtract(self, o)
    def __mul__(self, o): from .language import multiply; return multiply(self, o)
    def __rmul__(self, o): from .language import multiply; return multiply(o, self)

    def __iadd__(self, o):
        from .language import accumulate

        accumulate(self, o)
        return self

    def __bool__(self):
        raise NKIRuleError("err_ambiguous_tensor_truth_value", f"truth value of {self} is undefined")


def _owns_unit_axis(e: IndexExpr, grid: tuple) -> bool:
    """The basic advanced-index form: the expression varies along exactly one result axis, by +1."""
    coef = _affine_coefficients(np.broadcast_to(e.v, grid))
    return sorted(coef) == [0] * (len(grid) - 1) + [1]


def _affine_coefficients(full: np.ndarray) -> list:
    """Per-axis step of an index array over its grid; raises unless it is affine (NKI indices are)."""
    coef = []
    for a in range(full.ndim):
        d = np.diff(full, axis=a) if full.shape[a] > 1 else np.zeros((1,), dtype=np.int64)
        c = int(d.flat[0]) if d.size else 0
        if d.size and not (d == c).all():
            raise NKIRuleError("err_non_affine_index", "index expression is not affine in the arange values")
        coef.append(c)
    return coef


class StridedStorage(Storage):
    """An affine access pattern over another storage: same memory (never allocated twice), own shape and strides."""

    def __init__(self, base: Storage, shape, strides, offset: int):
        data = None
        if base.data is not None:
            flat = base.data.reshape(-1)
            item = flat.itemsize
            data = np.lib.stride_tricks.as_strided(flat[offset:], shape=tuple(shape),
                                                   strides=tuple(int(s) * item for s in strides))
        self.base = base
        self.elem_strides = tuple(int(s) for s in strides)
        super().__init__(shape, base.dtype, base.buffer, name=base.name, data=data)
        self.is_param = base.is_param
        self.alloc_depth = base.alloc_depth
        if base.written is not None:  # a kernel output: writes through the pattern mark the elements they reach
            flat = base.written.reshape(-1)
            self.written = np.lib.stride_tricks.as_strided(flat[offset:], shape=tuple(shape),
                                                           strides=tuple(int(s) * flat.itemsize for s in strides))

    @property
    def alive(self) -> bool:
        return self.base.alive

    @alive.setter
    def alive(self, value) -> None:  # Storage.__init__ sets it; liveness follows the base storage
        pass


def hbm_contiguous_bytes(t: Tensor) -> int:
    """Longest contiguous HBM run of a view, in bytes (row-major storage, or a strided view's strides)."""
    strides = getattr(t.st, "elem_strides", None)
    if strides is not None:
        run, expected = 1, 1
        for d in range(len(t.st.shape) - 1, -1, -1):
            ix = t.index[d]
            ext = ix[1] - ix[0] if isinstance(ix, tuple) else 1
            if ext == 1:
                continue
            if strides[d] != expected:
                break
            run *= ext
            expected *= ext
            if ext != t.st.shape[d]:
                break
        return run * t.dtype.itemsize
    run = t.dtype.itemsize
    for d in range(len(t.st.shape) - 1, -1, -1):
        ix = t.index[d]
        ext = ix[1] - ix[0] if isinstance(ix, tuple) else 1
        run *= ext
        if ext != t.st.shape[d]:
            break
    return run


def check_tile(t: Tensor, what: str) -> None:
    """Compute operands are SBUF/PSUM tiles (partition on axis 0, P <= 128, legal start partition)."""
    if not isinstance(t, Tensor):
        raise NKIRuleError("err_type", f"{what}: expected a tile, got {type(t).__name__}")
    t.check_alive()
    if not t.buffer.on_chip:
        raise NKIRuleError("err_unsupported_memory", f"{what}: {t} is in HBM; compute reads SBUF/PSUM tiles")
    if not t.is_tile:
        raise NKIRuleError("err_failed_to_infer_tile_from_local_tensor",
                           f"{what}: {t} has no partition axis first")
    if t.ndim < 2:
        raise NKIRuleError("err_insufficient_rank", f"{what}: tiles need at least 2 dims, got {t.shape}")
    p, start = t.shape[0], t.partition_start()
    if p > PMAX:
        raise NKIRuleError("err_num_partition_exceed_arch_limit", f"{what}: {p} partitions > {PMAX}")
    ok = start == 0 if p > 64 else (start in (0, 64) if p > 32 else start % 32 == 0)
    if not ok:
        raise NKIRuleError("err_start_partition", f"{what}: {p} partitions cannot start at partition {start}")
