"""The `nki` namespace of the emulator: jit, simulate_kernel, and run (outputs plus trace)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

from . import core
from .core import SHARED_HBM, Context, NKIRuleError, Storage, Tensor, Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a kernel input, enough for a trace-only run (no data)."""

    shape: tuple
    dtype: np.dtype

    def __class_getitem__(cls, item):
        shape, dtype = item
        return cls(tuple(shape), np.dtype(dtype))


class Kernel:
    """An nki.jit-decorated function: calling it with NumPy arrays runs the emulator."""

    def __init__(self, func, mode: str = "auto", **options):
        self.func, self.mode, self.options = func, mode, options
        functools.update_wrapper(self, func)

    def __call__(self, *args, **kwargs):
        outputs, _ = run(self, *args, **kwargs)
        return outputs

    def __getitem__(self, grid):
        raise NKIRuleError("emulator_unsupported", "SPMD grids are not emulated (trn1 runs them serially anyway)")


def jit(func=None, mode: str = "auto", **options):
    """Decorate a kernel; works as @jit and @jit(mode=...)."""
    if func is None:
        return lambda f: Kernel(f, mode, **options)
    return Kernel(func, mode, **options)


def simulate_kernel(kernel, *args, **kwargs):
    """Run a kernel on NumPy inputs and return its outputs as NumPy arrays."""
    return run(kernel, *args, **kwargs)[0]


def baremetal(kernel=None, **_):
    """Needs a Neuron device; not available in the emulator."""
    raise NKIRuleError("emulator_unsupported", "nki.baremetal needs neuronxcc and a Neuron device")


def benchmark(kernel=None, **_):
    """Needs a Neuron device; use neuronmm_kernels.cost_model for modeled latency."""
    raise NKIRuleError("emulator_unsupported", "nki.benchmark needs a Neuron device; see cost_model.model_kernel")


def _as_param(arg, compute: bool) -> Tensor:
    if isinstance(arg, TensorSpec):
        if compute:
            raise ValueError("TensorSpec inputs need trace_only=True")
        st = Storage(arg.shape, arg.dtype, SHARED_HBM, name="input", data=None)
    else:
        a = np.ascontiguousarray(arg)
        st = Storage(a.shape, a.dtype, SHARED_HBM, name="input", data=a.copy() if compute else None)
    st.is_param = True
    return Tensor(st)


def run(kernel, *args, trace_only: bool = False, sample_loops: bool | None = None,
        **kwargs) -> tuple[object, Trace]:
    """Execute an emulator kernel on NumPy arrays (or TensorSpecs when trace_only) -> (outputs, trace).

    outputs mirrors the kernel's return value (an array or a tuple of arrays; None in trace-only
    mode). trace lists every instruction with its engine and cost inputs; trace_only checks all
    rules and records the trace without arithmetic, so large shapes are cheap.
    """
    func = getattr(kernel, "func", kernel)
    if not isinstance(kernel, Kernel) and hasattr(kernel, "func"):
        raise TypeError("run() needs a kernel built with the emulator's nki.jit (neuronxcc is installed?)")
    if sample_loops and not trace_only:
        raise ValueError("sample_loops needs trace_only=True (sampled runs compute no outputs)")
    c = Context(compute=not trace_only, sample_loops=trace_only if sample_loops is None else sample_loops)
    c.kernel_code = getattr(func, "__code__", None)
    outer = core._CTX  # a kernel may trace another at trace time (the tile selector): restore it after
    core.set_ctx(c)
    try:
        params = [_as_param(a, c.compute) if isinstance(a, (np.ndarray, TensorSpec)) else a for a in args]
        result = func(*params, **kwargs)
        outs = result if isinstance(result, tuple) else (result,)
        arrays = []
        for o in outs:
            if not isinstance(o, Tensor) or o.buffer is not SHARED_HBM:
                raise NKIRuleError("err_kernel_output", f"kernels return nl.shared_hbm tensors, got {o!r}")
            if o.st.written is not None and not o.st.written.all():
                raise NKIRuleError("err_tensor_output_not_written_to",
                                   f"{int((~o.st.written).sum())} elements of output {o.shape} never written")
            arrays.append(None if o.st.data is None else o.st.data.copy())
        while len(c.scopes) > 1:
            c.pop_scope()
        c.pop_scope()
    finally:
        core.set_ctx(outer)
    log.debug("kernel %s: %d instructions", getattr(func, "__name__", func), len(c.trace.instrs))
    value = tuple(arrays) if isinstance(result, tuple) else arrays[0]
    return (None if trace_only else value), c.trace
