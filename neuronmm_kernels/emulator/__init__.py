"""A NumPy emulator of the neuronxcc.nki subset our kernels use, with hardware-rule checks and a trace.

Entry points: `run(kernel, *arrays, trace_only=False, **kwargs) -> (outputs, trace)`, the
namespaces `nki`, `nl`, `nisa` (what compat.py hands kernels when neuronxcc is absent),
`TensorSpec` (shape + dtype input for trace-only runs) and `NKIRuleError` (carries `.rule`).
"""

from . import api as nki
from . import isa as nisa
from . import language as nl
from .api import TensorSpec, run
from .core import NKIRuleError, Trace

nki.language, nki.isa = nl, nisa

__all__ = ["nki", "nl", "nisa", "run", "TensorSpec", "NKIRuleError", "Trace"]
