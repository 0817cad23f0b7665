"""CPU fast path: Linear layers with weights pre-packed, for our panel GEMMs or for oneDNN.

`PanelLinear`: our own GEMM (csrc/small_gemm.cpp) over a panel layout made once at load, in bf16 on CPUs
with AVX512-BF16 (AMX tiles from a few rows where the CPU has AMX) and in fp32 on CPUs with AVX512F or AVX2;
the fp32 GEMM's panels may hold bf16 weights (a bf16 model on a CPU without native bf16: fp32 activations,
half the bytes of fp32 weights to stream).
At decode sizes it streams each weight at close to memory bandwidth where oneDNN spends ~20 µs a call on
dispatch (as long as reading a 0.6 MB matrix); at prefill sizes it is level with oneDNN or ahead of it (on
AVX2, ahead of MKL's sgemm at every size measured; docs/BENCHMARKS.md).
Elsewhere (bf16 without AVX512-BF16, a K the bf16 panels cannot pair): `PackedLinear`, oneDNN's packed GEMM,
about 2x faster than the default call for the skinny shapes of decoding (fp32 LM head [16, 576] x [576, 49152]:
8.7 ms vs 19.5 ms). Results equal F.linear up to summation order."""

from __future__ import annotations

import logging

import torch
from torch import nn

from server.models import fused_ops
from server.models.gemm_tuning import CHOICE_FILE, tune_bf16_kernels
from server.models.gguf_blocks import GgufBlocks, pack_block_panels
from server.models.hugepages import into_huge_pages
from server.models.int8_linear import fits_int8, pack_int8_panels
from server.models.llama import LlamaModel, StackedPair
from server.models.lowrank import LowRankLinear

log = logging.getLogger(__name__)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing applies to fp32, and to bf16 where oneDNN supports it, on CPU builds with mkldnn."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_EXACT_ROWS = 64
_LINEAR = torch.ops.mkldnn._linear_pointwise.default  # the overload, resolved once (a per-call lookup costs µs)


def _row_bucket(rows: int) -> int:
    """Row counts up to 64 as they are (decode batches), larger ones rounded up to a multiple of 16."""
    return rows if rows <= _EXACT_ROWS else (rows + 15) // 16 * 16


class _PrepackedLinear(nn.Module):
    """A bias-free y = x Wᵀ whose weight is held in one GEMM's own layout (named by `layout`)."""

    layout = ""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.layout}"


class PackedLinear(_PrepackedLinear):
    """y = x Wᵀ with W held in oneDNN's blocked layout, in W's dtype (no bias; inference only)."""

    layout = "onednn-packed"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= _EXACT_ROWS:  # the decode hot path: one call, nothing else
            return _LINEAR(x.contiguous(), self.packed, None, "none", [], "")
        # oneDNN builds (and caches) a primitive per distinct row count; with continuous batching every
        # step has a new count, and the churn grew the server's RSS by ~35 MB per 1,000 mixed requests
        # without levelling off. Rounding prefill-sized row counts up keeps the set of shapes small (RSS
        # levels off) at <= 15 padded rows; decode-sized counts stay exact, as padding them costs time.
        rows = x.shape[:-1].numel()
        padded = _row_bucket(rows)
        flat = x.reshape(rows, x.shape[-1])
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
        out = _LINEAR(flat, self.packed, None, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


# activation dtype -> (pack op, GEMM op) names in csrc/small_gemm.cpp; each is built only where the CPU has its
# instructions (bf16: AVX512-BF16; fp32: AVX512F or AVX2). The fp32 ops' panels hold fp32 or bf16 weights.
_PANEL_OPS = {torch.bfloat16: ("pack_panels", "panel_linear"), torch.float32: ("pack_panels_f32", "panel_linear_f32")}


def _panel_weight(weight: torch.Tensor, panel_dtype: torch.dtype | None) -> torch.Tensor:
    """The weight in the dtype its panels hold: its own, or bf16 under fp32 activations."""
    if panel_dtype is None or panel_dtype == weight.dtype:
        return weight.detach().contiguous()
    if (weight.dtype, panel_dtype) != (torch.float32, torch.bfloat16):
        raise ValueError(f"panels of {panel_dtype} weights under {weight.dtype} activations are not built")
    return weight.detach().to(panel_dtype).contiguous()


def _layout(x_dtype: torch.dtype, panels: torch.Tensor) -> str:
    if x_dtype == panels.dtype:
        return f"{'bf16' if x_dtype == torch.bfloat16 else 'fp32'} panels"
    return "bf16 weights in fp32 panels"


def panels_available(device: torch.device, dtype: torch.dtype) -> bool:
    """The panel GEMM for `dtype` is in this CPU's fused-ops build (bf16 with AVX512-BF16, fp32 with AVX512F or AVX2)."""
    return (device.type == "cpu" and dtype in _PANEL_OPS and fused_ops.load()
            and hasattr(torch.ops.neuronmm, _PANEL_OPS[dtype][1]))


class PanelLinear(_PrepackedLinear):
    """y = x Wᵀ with W [N, K] held as column panels for csrc/small_gemm.cpp: bf16 (K even) or fp32 (no bias), or
    int8 for csrc/int8_gemm.cpp (K a multiple of 64), or an fp32 W as the GGUF blocks it decodes from.

    x comes in W's dtype; `panel_dtype` bf16 under an fp32 W stores the panels in bf16 (W rounded to it); `blocks`
    (codes, scales, offsets; gguf_blocks.GgufBlocks.find) stores an fp32 W as GGUF block panels."""

    def __init__(self, weight: torch.Tensor, panel_dtype: torch.dtype | None = None, int8: bool = False,
                 blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        super().__init__(weight)
        pack, gemm = _PANEL_OPS[weight.dtype]
        self.x_dtype = weight.dtype
        if int8:
            self.panels = pack_int8_panels(weight)
            self.layout = "int8 panels"
            gemm = "panel_linear_int8"
        elif blocks is not None:
            self.panels = pack_block_panels(*blocks)
            self.layout = "GGUF block panels"
        else:
            self.panels = getattr(torch.ops.neuronmm, pack)(_panel_weight(weight, panel_dtype))
            self.layout = _layout(weight.dtype, self.panels)
        self._gemm = getattr(torch.ops.neuronmm, gemm).default  # the overload, resolved once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's flat batches: one call, nothing else
            return self._gemm(x, self.panels, self.out_features)
        out = self._gemm(x.reshape(-1, self.in_features), self.panels, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def panel_tensors(self) -> list[torch.Tensor]:
        return [self.panels]

    def factored_args(self) -> tuple[torch.Tensor, list[int], list[torch.Tensor | None], list[int]]:
        """This GEMM as factored_linear's arguments (one split passing its output through), for the C++ layer loop."""
        return self.panels, [self.out_features], [None], [self.out_features]

    def set_panel_tensors(self, tensors: list[torch.Tensor]) -> None:
        (self.panels,) = tensors


class FactoredPanelLinear(nn.Module):
    """y = [t_0 B_0ᵀ | t_1 B_1ᵀ | ...] with t = x Fᵀ split per part, in one call (csrc `factored_linear`).

    A LowRankLinear is one part (F = A); gate and up sharing their first GEMM (a StackedPair) are two, a
    dense part passing its slice of t through (no B). The intermediate t never leaves the cache, and a
    layer's factored projections cost one call instead of a GEMM per factor, a split and a concatenation.
    """

    def __init__(self, first: torch.Tensor, splits: list[int], seconds: list[torch.Tensor | None],
                 panel_dtype: torch.dtype | None = None, int8: bool = False):
        super().__init__()
        op = getattr(torch.ops.neuronmm, _PANEL_OPS[first.dtype][0])
        pack = pack_int8_panels if int8 else lambda w: op(_panel_weight(w, panel_dtype))
        self.x_dtype = first.dtype
        self.in_features = first.shape[1]
        self.splits = list(splits)
        self.outs = [s if b is None else b.shape[0] for s, b in zip(splits, seconds)]
        self.out_features = sum(self.outs)
        self.first = pack(first)
        self.seconds = [None if b is None else pack(b) for b in seconds]
        self.layout = f"factored {'int8 panels' if int8 else _layout(first.dtype, self.first)}"
        self._op = torch.ops.neuronmm.factored_linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self._op(flat, self.first, self.splits, self.seconds, self.outs)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def panel_tensors(self) -> list[torch.Tensor]:
        return [self.first] + [b for b in self.seconds if b is not None]

    def factored_args(self) -> tuple[torch.Tensor, list[int], list[torch.Tensor | None], list[int]]:
        """factored_linear's arguments, for the C++ layer loop."""
        return self.first, self.splits, self.seconds, self.outs

    def set_panel_tensors(self, tensors: list[torch.Tensor]) -> None:
        it = iter(tensors)
        self.first = next(it)
        self.seconds = [None if b is None else next(it) for b in self.seconds]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, splits={self.splits}, out={self.outs}, {self.layout}"


def _factored(module: nn.Module, use_panels: bool, panel_dtype: torch.dtype | None,
              int8: bool) -> FactoredPanelLinear | None:
    """A LowRankLinear or a StackedPair as one FactoredPanelLinear, where the panel GEMM takes its dtype; int8 panels
    where asked and every GEMM's K fits them."""
    if not use_panels or not hasattr(torch.ops.neuronmm, "factored_linear"):
        return None
    if isinstance(module, LowRankLinear) and module.bias is None:
        first, splits, seconds = module.A, [module.rank], [module.B]
    elif isinstance(module, StackedPair):
        first, splits = module.A.weight, module.splits
        seconds = [None if b is None else b.weight for b in (module.B0, module.B1)]
    else:
        return None
    even = all(n % 2 == 0 for n in [first.shape[1], *splits])  # bf16 panels pair the inner dimension
    if first.dtype not in _PANEL_OPS or (first.dtype == torch.bfloat16 and not even):
        return None
    ks = [first.shape[1]] + [s for s, b in zip(splits, seconds) if b is not None]  # each GEMM's inputs
    return FactoredPanelLinear(first, splits, seconds, panel_dtype, int8=int8 and all(map(fits_int8, ks)))


def _pack_weight(weight: torch.Tensor, use_panels: bool, panel_dtype: torch.dtype | None, int8: bool,
                 blocks: GgufBlocks | None) -> nn.Module:
    """One weight packed: panels where they apply (bf16 panels pair K, so K even; int8 ones where asked and K fits
    them; GGUF block panels where asked and the GGUF holds the weight exactly), else oneDNN's layout."""
    if use_panels and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0):
        found = blocks.find(weight) if blocks is not None else None
        return PanelLinear(weight, panel_dtype, int8=int8 and fits_int8(weight.shape[1]), blocks=found)
    return PackedLinear(weight)


def _packed(module: nn.Module, use_panels: bool, panel_dtype: torch.dtype | None, int8: bool,
            blocks: GgufBlocks | None) -> nn.Module | None:
    """The packed replacement of one module, or None to leave it (and pack what is inside it)."""
    factored = _factored(module, use_panels, panel_dtype, int8)
    if factored is not None:
        return factored
    if type(module) is nn.Linear and module.bias is None:
        return _pack_weight(module.weight, use_panels, panel_dtype, int8, blocks)
    if isinstance(module, LowRankLinear) and module.bias is None:
        return nn.Sequential(_pack_weight(module.A, use_panels, panel_dtype, int8, blocks),
                             _pack_weight(module.B, use_panels, panel_dtype, int8, blocks))
    return None


def _replace(parent: nn.Module, use_panels: bool, panel_dtype: torch.dtype | None, int8: bool,
             blocks: GgufBlocks | None) -> int:
    count = 0
    for name, child in list(parent.named_children()):
        replacement = _packed(child, use_panels, panel_dtype, int8, blocks)
        if replacement is not None:
            setattr(parent, name, replacement)
            count += 1
        else:
            count += _replace(child, use_panels, panel_dtype, int8, blocks)
    return count


def pack_linears(model: nn.Module, use_panels: bool = False, panel_dtype: torch.dtype | None = None,
                 int8: bool = False, blocks: GgufBlocks | None = None) -> int:
    """Replace every bias-free Linear / LowRankLinear / StackedPair under `model` by its packed form; returns the count.

    use_panels: panels for our GEMMs (see panels_available; factored modules become one call), else oneDNN's layout.
    panel_dtype: bf16 under an fp32 model stores the panels' weights in bf16 (the model's weights must already
    hold bf16 values for that to lose nothing; see TorchRunner); None: the model's dtype.
    int8: int8 panels (csrc/int8_gemm.cpp; the caller checks int8_available) for every panel GEMM whose K fits them.
    blocks: a GGUF's quantised rows; every fp32 weight they hold exactly becomes GGUF block panels (factored
    modules' factors, which no GGUF holds, stay fp32).
    """
    if (int8 or blocks is not None) and not use_panels:
        raise ValueError("int8 weights and GGUF blocks need the panel GEMMs (use_panels)")
    count = _replace(model, use_panels, panel_dtype, int8, blocks)
    for llama in (m for m in model.modules() if isinstance(m, LlamaModel)):
        llama.unbind()  # its bound layer calls name the modules just replaced
    panel_layers = [m for m in model.modules() if isinstance(m, (PanelLinear, FactoredPanelLinear))]
    if panel_layers:  # one huge-page mapping for all panels: a step streams every one of them
        panels = [m.panel_tensors() for m in panel_layers]
        placed = iter(into_huge_pages([t for group in panels for t in group]))
        for layer, group in zip(panel_layers, panels):
            layer.set_panel_tensors([next(placed) for _ in group])
        if any(layer.x_dtype == torch.bfloat16 for layer in panel_layers):  # the bf16 GEMM's paths, timed here
            library = fused_ops.library_dir()  # once a CPU: kept beside the fused ops' build for it
            tune_bf16_kernels(library / CHOICE_FILE if library is not None else None)
    if int8:
        quantised = sum("int8" in layer.layout for layer in panel_layers)
        log.info("int8 weights in %d of %d panel GEMM layers%s", quantised, len(panel_layers),
                 "" if quantised == len(panel_layers) else " (the others' K is not a multiple of 64)")
    if blocks is not None:
        exact = sum(layer.layout == "GGUF block panels" for layer in panel_layers)
        log.info("GGUF blocks in %d of %d panel GEMM layers%s", exact, len(panel_layers),
                 "" if exact == len(panel_layers) else " (the GGUF does not hold the others' weights exactly)")
    log.info("packed %d linear layers (%s)", count, "panels" if use_panels else "oneDNN")
    return count
