"""Swap transformers-neuronx's Llama MLP for our NKI low-rank MLP, layer by layer.

Three small patches, all reversible (`uninstall`) and inert for layers without factors:
1. `DecoderLayer.add_parameter` during weight loading: `LlamaForSampling.load_weights` adds a
   layer's MLP as three extra parameters (gate_proj.weight.T and up_proj.weight.T, [hidden,
   intermediate], sharding 1; down_proj.weight [hidden, intermediate], sharding 1, or its
   transpose, sharding 0), the only such-shaped extra parameters of a Llama layer. For a
   compressed layer they are dropped before they reach the device, and our six prepared factors
   take their place with the sharding dims of layout.SHARD_DIMS (tnx splits them over the cores
   in the layer's `to_neuron`).
2. The Llama layer builder: tnx passes a layer's MLP extras as six positional slots, `in0_weight,
   in0_scales, in1_weight, in1_scales, out_weight, out_scales` (tnx v0.13.0 llama/hlo.py:236-238):
   each dense weight is added with allow_quantize=True, so DecoderLayer.to_neuron appends a
   scales slot after it, None unless neuron_config.quant (decoder.py:1672-1692). Our factors are
   added without allow_quantize, so a compressed layer's six slots are six tensors while a dense
   layer's are (gate, None, up, None, down, None). A layer called with six tensors parks them in
   a context variable and calls the original layer with all six slots None.
3. `hlo.gated_mlp_bsh`: while factors are parked, build `lowrank_mlp_graph` instead.
Weight quantization (neuron_config.quant) fills the scales slots and would make a dense layer
look like a compressed one, so it is refused with factors present (`check_neuron_config`), as is
sequence parallelism, where tnx's gated_mlp_bsh reduce-scatters instead of all-reducing.
Also refused: fuse_mlp (the MLP is then not loaded through add_parameter) and the HSB layout (its
layers call hlo.gated_mlp). Written against transformers-neuronx's public source: tag v0.13.0
(f4e3818) and main (1ade6d7, the last public sync), the same in every function used here.
0.13.1216 (SDK 2.25) is not public; the SDK's release notes list no tnx change after 0.13.380
(aws-neuron-sdk b0b4e3d6 release-notes/torch/transformers-neuronx/index.rst:93) and keep tnx in
maintenance from 2.24 (release-notes/2.25.0/index.rst:259). Not run against the SDK here.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from server.backends.neuron.layout import FACTOR_ORDER, SHARD_DIMS, LayerFactors
from server.backends.neuron.mlp_graph import NUM_FACTORS, lowrank_mlp_graph

log = logging.getLogger(__name__)

_ACTIVE_FACTORS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("neuronmm_mlp_factors", default=None)
_DENSE_MLP_PARAMS = 3  # gate (in0), up (in1), down (out)
_SLOT_NAMES = ("in0_weight", "in0_scales", "in1_weight", "in1_scales", "out_weight", "out_scales")
_MLP_SLOTS = len(_SLOT_NAMES)


class PatchError(RuntimeError):
    """transformers-neuronx did not look the way the patch expects."""


@dataclass
class PatchState:
    """What was patched (to undo it) and what the loader saw (to check it)."""

    restore: list[tuple[Any, str, Any]] = field(default_factory=list)
    dropped: dict[int, int] = field(default_factory=dict)  # layer -> dense MLP params dropped
    injected: list[int] = field(default_factory=list)


def _replace(state: PatchState, owner: Any, name: str, new: Any) -> None:
    state.restore.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def _shape(param: Any) -> tuple[int, ...]:
    return tuple(getattr(param, "shape", ()))


def patched_add_parameter(original: Callable, factors: dict[int, LayerFactors], hidden: int, intermediate: int,
                          to_tensor: Callable, state: PatchState) -> Callable:
    """add_parameter that swaps a compressed layer's dense MLP weights for its six factors."""
    dense = {(hidden, intermediate), (intermediate, hidden)}

    @functools.wraps(original)
    def add_parameter(self, param, *args, **kwargs):
        layer = getattr(self, "layer_num", None)
        if layer not in factors or _shape(param) not in dense:
            return original(self, param, *args, **kwargs)
        state.dropped[layer] = state.dropped.get(layer, 0) + 1
        if state.dropped[layer] == _DENSE_MLP_PARAMS:  # the third dense weight: put the factors in their place
            for name in FACTOR_ORDER:
                original(self, to_tensor(getattr(factors[layer], name)), sharding=SHARD_DIMS[name])
            state.injected.append(layer)
        return None

    return add_parameter


def _is_factor_slots(extra: tuple) -> bool:
    """Six tensors in the MLP slots: a compressed layer (a dense one has None scales in slots 1, 3, 5)."""
    return len(extra) >= NUM_FACTORS and all(a is not None and not isinstance(a, bool) for a in extra[:NUM_FACTORS])


def check_neuron_config(neuron_config: Any) -> None:
    """Raise PatchError for tnx settings the low-rank MLP does not mirror."""
    if neuron_config is None:
        return
    if getattr(neuron_config, "quant", None):  # scales slots filled: dense and factor layers look alike
        raise PatchError("neuron_config.quant (weight quantization) cannot be combined with low-rank MLP factors")
    # sequence_parallel_norm: tnx sets is_sequence_parallel for graphs above its threshold
    # (layers/transformer.py:56-59) and gated_mlp_bsh then reduce-scatters along tokens (hlo.py:730);
    # refused up front (the flag) as well as per graph, so no bucket compiles before the error
    if getattr(neuron_config, "sequence_parallel_norm", False) or getattr(neuron_config, "is_sequence_parallel",
                                                                          False):
        raise PatchError("sequence_parallel_norm is not supported with low-rank MLP factors "
                         "(tnx reduce-scatters the MLP output there; the patch only all-reduces)")
    if getattr(neuron_config, "fused_rmsnorm_mlp", False):  # llama/hlo.py:394 calls its own MLP kernel
        raise PatchError("fused_rmsnorm_mlp bypasses gated_mlp_bsh; disable it to serve low-rank MLP factors")
    # fuse_mlp loads the MLP with add_mlp_input/add_mlp_output, not add_parameter (llama/model.py:161-169): the
    # factors would never be injected, which verify_injection only finds after every bucket has compiled
    if getattr(neuron_config, "fuse_mlp", False):
        raise PatchError("fuse_mlp loads the MLP without add_parameter; disable it to serve low-rank MLP factors")
    # HSB builds the MLP with hlo.gated_mlp, not gated_mlp_bsh (llama/hlo.py:303); the factor graph is BSH-only
    layout = getattr(neuron_config, "attention_layout", "BSH")
    if getattr(layout, "value", layout) != "BSH":
        raise PatchError(f"attention_layout {getattr(layout, 'value', layout)!r}: low-rank MLP factors need 'BSH'")


def patched_layer(original: Callable) -> Callable:
    """The Llama layer builder, routing a layer whose six MLP slots hold factors to the low-rank MLP."""
    params = list(inspect.signature(original).parameters)
    start = params.index("in0_weight") if "in0_weight" in params else len(params)
    if tuple(params[start:start + _MLP_SLOTS]) != _SLOT_NAMES:
        raise PatchError("llama layer builder has no in0_weight, in0_scales, ..., out_scales parameters "
                         "(transformers-neuronx version?)")
    num_fixed = params.index("in0_weight") - 1  # positional args before in0_weight, excluding self

    @functools.wraps(original)
    def layer(self, *args, **kwargs):
        extra = args[num_fixed:]
        if _is_factor_slots(extra):
            check_neuron_config(getattr(self, "neuron_config", None))
            token = _ACTIVE_FACTORS.set(tuple(extra[:NUM_FACTORS]))
            try:
                return original(self, *args[:num_fixed], *([None] * _MLP_SLOTS), *extra[_MLP_SLOTS:], **kwargs)
            finally:
                _ACTIVE_FACTORS.reset(token)
        return original(self, *args, **kwargs)

    return layer


def patched_gated_mlp(original: Callable, builder_factory: Callable[[Any], Any]) -> Callable:
    """gated_mlp_bsh that builds the low-rank kernel path while a compressed layer is being built."""

    @functools.wraps(original)
    def gated_mlp_bsh(hidden, in0_weight, in1_weight, out_weight, *args, **kwargs):
        factors = _ACTIVE_FACTORS.get()
        if factors is None:
            return original(hidden, in0_weight, in1_weight, out_weight, *args, **kwargs)
        if kwargs.get("return_partial"):  # the caller reduces (tnx hlo.py:728): leave the partial sums
            tp_degree = 1
        else:
            tp_degree = kwargs.get("tp_degree", 1)
        return lowrank_mlp_graph(builder_factory(kwargs.get("neuron_config")), hidden, factors, tp_degree)

    return gated_mlp_bsh


def install(decoder_layer_cls: Any, llama_hlo_cls: Any, hlo_module: Any, factors: dict[int, LayerFactors],
            hidden: int, intermediate: int, to_tensor: Callable, builder_factory: Callable) -> PatchState:
    """Apply the three patches to the given classes/module; returns the state for `uninstall`."""
    # Where tnx looks each one up (v0.13.0): add_parameter on the layer instance at each call (llama/model.py:182);
    # gated_mlp_bsh as a module attribute at each layer build (llama/hlo.py:303); `layer` once, when LlamaForSampling
    # binds builder.layer into its decoders (decoder.py:242): so install before from_pretrained, and the compiled
    # model keeps the patched layer after uninstall (harmless: it only parks factors, built once in to_neuron).
    state = PatchState()
    _replace(state, decoder_layer_cls, "add_parameter",
             patched_add_parameter(decoder_layer_cls.add_parameter, factors, hidden, intermediate, to_tensor, state))
    _replace(state, llama_hlo_cls, "layer", patched_layer(llama_hlo_cls.layer))
    _replace(state, hlo_module, "gated_mlp_bsh", patched_gated_mlp(hlo_module.gated_mlp_bsh, builder_factory))
    return state


def uninstall(state: PatchState) -> None:
    """Undo `install` (last patch first)."""
    for owner, name, value in reversed(state.restore):
        setattr(owner, name, value)
    state.restore.clear()


def verify_injection(state: PatchState, expected_layers: list[int]) -> None:
    """Raise PatchError unless every compressed layer dropped 3 dense weights and got its factors."""
    wrong = [i for i in expected_layers if state.dropped.get(i) != _DENSE_MLP_PARAMS or i not in state.injected]
    if wrong:
        raise PatchError(f"MLP factor injection failed for layers {wrong[:8]} (dropped {state.dropped}); "
                         "transformers-neuronx weight loading differs from v0.13")


def install_into_sdk(factors: dict[int, LayerFactors], hidden: int, intermediate: int) -> PatchState:
    """`install` on the real transformers-neuronx classes (needs the SDK)."""
    import torch
    from transformers_neuronx import decoder, hlo
    from transformers_neuronx.llama import hlo as llama_hlo

    from server.backends.neuron.mlp_graph import TnxGraphBuilder

    def to_tensor(a):
        return torch.from_numpy(a).to(torch.bfloat16)

    return install(decoder.DecoderLayer, llama_hlo.LlamaForSamplingNoEmbeddingHlo, hlo, factors, hidden,
                   intermediate, to_tensor, TnxGraphBuilder)
