"""The SDK-only bindings (TnxGraphBuilder, install_into_sdk) against stand-in tnx modules with tnx's real signatures.

Every stand-in function or method below copies its signature from transformers-neuronx v0.13.0 (tag commit
f4e3818; the newest public sync, main 1ade6d7, is the same in these places) and binds each call to it, so a
wrong argument order, name or count fails here as it would under the SDK. Values are recorded, not computed.
"""

from __future__ import annotations

import inspect
import sys
import types

import numpy as np
import pytest

from server.backends.neuron import tnx_patch
from server.backends.neuron.kernel_adapter import lowrank_mlp_into
from neuron_factors import random_layer_factors
from server.backends.neuron.layout import shard

HIDDEN, INTER, TP = 64, 160, 2
CALLS: list[tuple[str, dict]] = []


def _bound(name, fn):
    """fn, recording each call's arguments as bound to fn's own signature (a TypeError where tnx's would raise)."""
    sig = inspect.signature(fn)

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        CALLS.append((name, dict(bound.arguments)))
        return fn(*args, **kwargs)

    return call


class Value:
    """A pyhlo value: `sizes` and a `dtype` that `dtype[sizes]` turns into an HloShape-like value."""

    def __init__(self, sizes, dtype="bf16"):
        self.sizes, self.dtype = tuple(sizes), DType(dtype)


class DType:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, sizes):  # tnx writes dtype[a, b], dtype[list] and dtype[tuple] (hlo.py:1058, :2015)
        return Value(sizes if isinstance(sizes, (tuple, list)) else (sizes,), self.name)


def reshape(tensor, shape):  # hlo.py:2685
    return Value(shape, tensor.dtype.name)


def all_reduce_sum(tensor, tp_degree, dtype=None, replica_groups=None):  # hlo.py:1220
    return tensor


def gated_mlp_bsh(hidden, in0_weight, in1_weight, out_weight, in0_scales=None, in1_scales=None, out_scales=None,
                  in0_bias=None, in1_bias=None, out_bias=None, activation_function='silu', tp_degree=1,
                  neuron_config=None, return_partial=False):  # hlo.py:634-649
    return ("dense_mlp", in0_weight, in1_weight, out_weight)


def parse_dtype_replica_groups(neuron_config, tp_degree):  # utils.py:28
    return neuron_config.all_reduce_dtype, [list(range(tp_degree))]


def nki_call(func, *args, **kwargs):  # nki/compile.py:51; NkiHloKernel.__call__(*args, output_HloShapes=None) :141
    grid = kwargs.pop("grid", None)
    (shape,) = kwargs.pop("output_HloShapes")
    assert not kwargs and grid is None and isinstance(shape, Value)
    CALLS.append(("kernel", {"func": func, "inputs": [a.sizes for a in args], "output": shape.sizes}))
    return Value(shape.sizes, shape.dtype.name)


class DecoderLayer:
    """decoder.py:1269; add_parameter :1343-1345 appends, to_neuron (:1663-1694) shards and adds scales slots."""

    def __init__(self, layer_num):
        self.layer_num, self.extra_parameters = layer_num, []

    def add_parameter(self, param, sharding=None, allow_pad=False, allow_quantize=False,
                      out_feature_dim=1, allow_transform=False):
        self.extra_parameters.append((param, sharding, allow_pad, allow_quantize, out_feature_dim, allow_transform))

    def to_neuron(self):
        extras = []
        for param, dim, _pad, allow_quantize, _ofd, _tr in self.extra_parameters:
            param = param if dim is None else np.split(param.float().numpy(), TP, axis=dim)[0]  # core 0's shard
            extras.append(Value(param.shape))
            if allow_quantize:
                extras.append(None)  # no neuron_config.quant: a None scales slot
        self.extra_parameters = extras


class LlamaForSamplingNoEmbeddingHlo:
    """llama/hlo.py:31; `layer` has the real parameter list (:223-240) and calls gated_mlp_bsh as :303-322 do."""

    neuron_config = types.SimpleNamespace(quant=None, sequence_parallel_norm=False, is_sequence_parallel=False,
                                          fused_rmsnorm_mlp=False, fuse_mlp=False, attention_layout="BSH",
                                          all_reduce_dtype=None)

    def layer(self, hidden, last_token_id, pos_embed, cache_ids, start_ids, block_to_seq, mask, active_mask, core_id,
              block_tables, cached_mask, cached_to_contexted, active_to_contexted,
              attn_k_cache, attn_v_cache,
              pre_attn_ln_weight, pre_attn_ln_bias,
              attn_q_weight, attn_q_scales, attn_q_bias,
              attn_k_weight, attn_k_scales, attn_k_bias,
              attn_v_weight, attn_v_scales, attn_v_bias,
              attn_out_weight, attn_out_scales, attn_out_bias,
              post_attn_ln_weight, post_attn_ln_bias,
              pre_mlp_ln_weight, pre_mlp_ln_bias,
              mlp_in_weight, mlp_in_scales, mlp_in_bias,
              mlp_out_weight, mlp_out_scales, mlp_out_bias,
              post_mlp_ln_weight, post_mlp_ln_bias,
              in0_weight=None, in0_scales=None,
              in1_weight=None, in1_scales=None,
              out_weight=None, out_scales=None,
              is_first_last_layer=False):
        hlo = sys.modules["transformers_neuronx.hlo"]
        mlp = hlo.gated_mlp_bsh(hidden, in0_weight, in1_weight, out_weight, in0_scales=in0_scales,
                                in1_scales=in1_scales, out_scales=out_scales, activation_function='silu',
                                tp_degree=TP, neuron_config=self.neuron_config)
        return mlp, attn_k_cache, attn_v_cache


@pytest.fixture
def sdk(monkeypatch):
    """transformers_neuronx.{hlo, utils, decoder, llama.hlo, nki.compile} as stand-ins, for this test only."""
    names = ["transformers_neuronx"] + [f"transformers_neuronx.{m}" for m in (
        "hlo", "utils", "decoder", "llama", "llama.hlo", "nki", "nki.compile")]
    mods = {name: types.ModuleType(name) for name in names}
    hlo = mods["transformers_neuronx.hlo"]
    for fn in (reshape, all_reduce_sum, gated_mlp_bsh):
        setattr(hlo, fn.__name__, _bound(fn.__name__, fn))
    mods["transformers_neuronx.utils"].parse_dtype_replica_groups = _bound("parse_dtype_replica_groups",
                                                                           parse_dtype_replica_groups)
    mods["transformers_neuronx.nki.compile"].nki_call = nki_call
    mods["transformers_neuronx.decoder"].DecoderLayer = DecoderLayer
    mods["transformers_neuronx.llama.hlo"].LlamaForSamplingNoEmbeddingHlo = LlamaForSamplingNoEmbeddingHlo
    for parent, child in (("transformers_neuronx", "hlo"), ("transformers_neuronx", "utils"),
                          ("transformers_neuronx", "decoder"), ("transformers_neuronx", "llama"),
                          ("transformers_neuronx", "nki"), ("transformers_neuronx.llama", "hlo"),
                          ("transformers_neuronx.nki", "compile")):
        setattr(mods[parent], child, mods[f"{parent}.{child}"])
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    CALLS.clear()
    return mods


def _factors():
    return random_layer_factors(HIDDEN, INTER, TP)


def _load_layer(num):
    """LlamaForSampling.load_weights' dense MLP (llama/model.py:178-191): gate.T, up.T, then down [hidden, inter]."""
    import torch

    layer = DecoderLayer(num)
    layer.add_parameter(torch.zeros(HIDDEN, INTER), sharding=1, allow_pad=True, allow_quantize=True,
                        allow_transform=True)
    layer.add_parameter(torch.zeros(HIDDEN, INTER), sharding=1, allow_pad=True, allow_quantize=True,
                        allow_transform=True)
    layer.add_parameter(torch.zeros(HIDDEN, INTER), sharding=1, allow_pad=True, allow_quantize=True,
                        out_feature_dim=0)
    layer.to_neuron()
    return layer


def _build(layer, tokens=(2, 3)):
    """decoder.py:953: layer_builder(hidden, *12 inputs, *2 caches, *26 weights + extras, is_first_last_layer=...)."""
    hlo_builder = LlamaForSamplingNoEmbeddingHlo()
    hidden = Value((*tokens, HIDDEN))
    args = [hidden] + ["tensor"] * 12 + ["k_cache", "v_cache"] + [None] * 26 + layer.extra_parameters
    return hlo_builder.layer(*args, is_first_last_layer=True)


def test_install_into_sdk_routes_the_real_layer_signature(sdk):
    dense_mlp = sdk["transformers_neuronx.hlo"].gated_mlp_bsh
    core0 = [f.shape for f in shard(_factors()[1], TP, 0).as_tuple()]
    state = tnx_patch.install_into_sdk(_factors(), HIDDEN, INTER)
    try:
        dense, compressed = _load_layer(0), _load_layer(1)
        tnx_patch.verify_injection(state, [1])
        assert [v.sizes for v in compressed.extra_parameters] == core0  # six tensors, no scales slots
        mlp, k_cache, v_cache = _build(dense)
        assert mlp[0] == "dense_mlp" and (k_cache, v_cache) == ("k_cache", "v_cache")
        mlp, _, _ = _build(compressed)
        assert mlp.sizes == (2, 3, HIDDEN)
    finally:
        tnx_patch.uninstall(state)
    names = [name for name, _ in CALLS]
    assert names == ["gated_mlp_bsh", "reshape", "kernel", "reshape", "parse_dtype_replica_groups", "all_reduce_sum"]
    kernel = dict(CALLS)["kernel"]
    assert kernel["func"] is lowrank_mlp_into and kernel["output"] == (6, HIDDEN)
    assert kernel["inputs"] == [(6, HIDDEN)] + core0
    reduce = dict(CALLS)["all_reduce_sum"]
    assert reduce["tp_degree"] == TP and reduce["replica_groups"] == [[0, 1]] and reduce["dtype"] is None
    assert sdk["transformers_neuronx.hlo"].gated_mlp_bsh is dense_mlp


def test_graph_builder_calls_match_tnx_signatures(sdk):
    from server.backends.neuron.mlp_graph import TnxGraphBuilder

    nc = types.SimpleNamespace(all_reduce_dtype="float32")
    builder = TnxGraphBuilder(nc)
    x = builder.reshape(Value((4, 1, HIDDEN)), (4, HIDDEN))
    assert builder.sizes(x) == (4, HIDDEN)
    y = builder.nki_call(lowrank_mlp_into, x, Value((HIDDEN, 128)), output_like=Value((4, 1, HIDDEN)),
                         output_sizes=(4, HIDDEN))
    assert y.sizes == (4, HIDDEN) and y.dtype.name == "bf16"
    builder.all_reduce_sum(Value((4, 1, HIDDEN)), 8)
    assert dict(CALLS)["all_reduce_sum"]["dtype"] == "float32"
    assert dict(CALLS)["parse_dtype_replica_groups"] == {"neuron_config": nc, "tp_degree": 8}
