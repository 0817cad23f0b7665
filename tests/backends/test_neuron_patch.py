"""The transformers-neuronx patch against stand-ins shaped like tnx 0.13's DecoderLayer, Llama layer and hlo."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from server.backends.neuron import tnx_patch
from neuron_factors import random_layer_factors
from server.backends.neuron.layout import FACTOR_ORDER, SHARD_DIMS

HIDDEN, INTER = 64, 160


TP = 2


class FakeDecoderLayer:
    """tnx v0.13.0 decoder.py DecoderLayer: add_parameter (:1343) records, to_neuron (:1663-1694) shards and
    appends a scales slot (None without neuron_config.quant) after every allow_quantize parameter."""

    def __init__(self, layer_num):
        self.layer_num = layer_num
        self.extra_parameters = []

    def add_parameter(self, param, sharding=None, allow_pad=False, allow_quantize=False, out_feature_dim=1,
                      allow_transform=False):
        self.extra_parameters.append((param, sharding, allow_pad, allow_quantize, out_feature_dim, allow_transform))

    def to_neuron(self):
        extras = []
        for param, dim, _pad, allow_quantize, _ofd, _tr in self.extra_parameters:
            extras.append(param if dim is None else np.split(np.asarray(param), TP, axis=dim)[0])  # core 0's shard
            if allow_quantize:
                extras.append(None)
        self.extra_parameters = extras


class FakeLlamaHlo:
    """LlamaForSamplingNoEmbeddingHlo.layer (tnx v0.13.0 llama/hlo.py:223-238): fixed args, then the six MLP
    slots in0_weight, in0_scales, in1_weight, in1_scales, out_weight, out_scales; flat_compiler_layer
    (:312-322) calls gated_mlp_bsh with the scales as keywords."""

    neuron_config = SimpleNamespace(quant=None, sequence_parallel_norm=False, is_sequence_parallel=False,
                                    fused_rmsnorm_mlp=False, fuse_mlp=False, attention_layout="BSH")

    def __init__(self, hlo):
        self.hlo = hlo

    def layer(self, hidden, cache_ids, pre_mlp_ln_weight, in0_weight=None, in0_scales=None, in1_weight=None,
              in1_scales=None, out_weight=None, out_scales=None, is_first_last_layer=False):
        mlp = self.hlo.gated_mlp_bsh(hidden, in0_weight, in1_weight, out_weight, in0_scales=in0_scales,
                                     in1_scales=in1_scales, out_scales=out_scales, activation_function="silu",
                                     tp_degree=TP, neuron_config=self.neuron_config)
        return ("residual_add", mlp, hidden)


def _dense_gated_mlp(hidden, in0, in1, out, **kwargs):
    return ("dense_mlp", in0, in1, out)


def _factors():
    return random_layer_factors(HIDDEN, INTER, TP)


class ShapeBuilder:
    """GraphBuilder whose graph values are NumPy arrays; it records the calls the real graph would make."""

    def __init__(self, neuron_config):
        self.neuron_config, self.calls = neuron_config, []

    def sizes(self, t):
        return tuple(t.shape)  # a None here is the run-time break of a dense layer sent down the factor path

    def reshape(self, t, sizes):
        return np.zeros(sizes)

    def nki_call(self, kernel, *args, output_like, output_sizes):
        self.calls.append(("nki_call", [a.shape for a in args]))
        return np.zeros(output_sizes)

    def all_reduce_sum(self, t, tp_degree):
        self.calls.append(("all_reduce_sum", tp_degree))
        return t


@pytest.fixture
def patched():
    hlo = SimpleNamespace(gated_mlp_bsh=_dense_gated_mlp)
    builders = []
    state = tnx_patch.install(FakeDecoderLayer, FakeLlamaHlo, hlo, _factors(), HIDDEN, INTER,
                              to_tensor=lambda a: np.asarray(a, dtype=np.float32),
                              builder_factory=lambda nc: builders.append(ShapeBuilder(nc)) or builders[-1])
    yield SimpleNamespace(hlo=hlo, state=state, builders=builders)
    tnx_patch.uninstall(state)


def _load_layer(num):
    """LlamaForSampling.load_weights' dense MLP calls (tnx v0.13.0 llama/model.py:178-191, default branch)."""
    layer = FakeDecoderLayer(num)
    layer.add_parameter(np.zeros((HIDDEN, INTER)), sharding=1, allow_pad=True, allow_quantize=True,
                        allow_transform=True)  # gate_proj.weight.T (in0)
    layer.add_parameter(np.zeros((HIDDEN, INTER)), sharding=1, allow_pad=True, allow_quantize=True,
                        allow_transform=True)  # up_proj.weight.T (in1)
    layer.add_parameter(np.zeros((HIDDEN, INTER)), sharding=1, allow_pad=True, allow_quantize=True,
                        out_feature_dim=0)  # down_proj.weight (out)
    return layer


def test_compressed_layer_gets_six_sharded_factors_instead_of_dense(patched):
    layer = _load_layer(1)
    assert [p[0].shape for p in layer.extra_parameters] == \
        [(64, 128), (128, 256), (64, 128), (128, 256), (256, 128), (128, 64)]
    assert [p[1] for p in layer.extra_parameters] == [SHARD_DIMS[n] for n in FACTOR_ORDER]
    assert not any(p[3] for p in layer.extra_parameters)  # no allow_quantize: no scales slots
    layer.to_neuron()
    assert [p.shape for p in layer.extra_parameters] == \
        [(64, 128), (128, 128), (64, 128), (128, 128), (128, 128), (128, 64)]
    tnx_patch.verify_injection(patched.state, [1])


def test_dense_layer_keeps_its_weights_and_scales_slots(patched):
    layer = _load_layer(0)
    layer.to_neuron()
    assert [None if p is None else p.shape for p in layer.extra_parameters] == \
        [(HIDDEN, INTER // TP), None, (HIDDEN, INTER // TP), None, (HIDDEN, INTER // TP), None]
    _load_layer(1)
    with pytest.raises(tnx_patch.PatchError, match=r"layers \[0\]"):
        tnx_patch.verify_injection(patched.state, [0, 1])


def test_mixed_dense_and_lowrank_layers_build_through_the_real_graph(patched):
    """Layer 0 stays dense, layer 1 is compressed: each gets its own MLP, and the factor path runs for real."""
    model, hidden = FakeLlamaHlo(patched.hlo), np.zeros((2, 3, HIDDEN))
    layers = [_load_layer(0), _load_layer(1)]
    for layer in layers:
        layer.to_neuron()
    dense = model.layer(hidden, "cache", "ln", *layers[0].extra_parameters, is_first_last_layer=True)
    assert dense[1][0] == "dense_mlp" and dense[1][1].shape == (HIDDEN, INTER // TP) and not patched.builders
    lowrank = model.layer(hidden, "cache", "ln", *layers[1].extra_parameters, is_first_last_layer=False)
    assert lowrank[1].shape == (2, 3, HIDDEN) and lowrank[2] is hidden
    (builder,) = patched.builders
    assert builder.neuron_config is FakeLlamaHlo.neuron_config
    assert builder.calls == [("nki_call", [(6, HIDDEN), (64, 128), (128, 128), (64, 128), (128, 128), (128, 128),
                                           (128, 64)]), ("all_reduce_sum", TP)]
    again = model.layer(hidden, "cache", "ln", *layers[0].extra_parameters)  # context cleared after the build
    assert again[1][0] == "dense_mlp"


@pytest.mark.parametrize("setting", ["quant", "is_sequence_parallel", "sequence_parallel_norm", "fused_rmsnorm_mlp",
                                     "fuse_mlp"])
def test_unsupported_tnx_settings_are_refused_for_compressed_layers(patched, setting, monkeypatch):
    monkeypatch.setattr(FakeLlamaHlo, "neuron_config",
                        SimpleNamespace(**{**vars(FakeLlamaHlo.neuron_config), setting: True}))
    layer = _load_layer(1)
    layer.to_neuron()
    with pytest.raises(tnx_patch.PatchError, match=setting.replace("is_", "")[:8]):
        FakeLlamaHlo(patched.hlo).layer(np.zeros((1, 1, HIDDEN)), "c", "ln", *layer.extra_parameters)


@pytest.mark.parametrize("layout", ["HSB", SimpleNamespace(value="HSB")])  # a str or tnx's constants.Layout enum
def test_hsb_attention_layout_is_refused(layout):
    """tnx builds an HSB layer's MLP with hlo.gated_mlp, which the patch does not replace (llama/hlo.py:303)."""
    with pytest.raises(tnx_patch.PatchError, match="attention_layout 'HSB'"):
        tnx_patch.check_neuron_config(SimpleNamespace(attention_layout=layout))
    tnx_patch.check_neuron_config(SimpleNamespace(attention_layout=SimpleNamespace(value="BSH")))


def test_return_partial_skips_the_all_reduce(patched):
    layer = _load_layer(1)
    layer.to_neuron()
    token = tnx_patch._ACTIVE_FACTORS.set(tuple(layer.extra_parameters))
    try:
        patched.hlo.gated_mlp_bsh(np.zeros((1, 1, HIDDEN)), None, None, None, tp_degree=TP, return_partial=True)
    finally:
        tnx_patch._ACTIVE_FACTORS.reset(token)
    assert [c[0] for c in patched.builders[0].calls] == ["nki_call"]


def test_uninstall_restores_originals():
    hlo = SimpleNamespace(gated_mlp_bsh=_dense_gated_mlp)
    before = (FakeDecoderLayer.add_parameter, FakeLlamaHlo.layer)
    state = tnx_patch.install(FakeDecoderLayer, FakeLlamaHlo, hlo, {}, HIDDEN, INTER, lambda a: a, lambda nc: None)
    assert FakeLlamaHlo.layer is not before[1]
    tnx_patch.uninstall(state)
    assert (FakeDecoderLayer.add_parameter, FakeLlamaHlo.layer, hlo.gated_mlp_bsh) == (*before, _dense_gated_mlp)


def test_layer_without_the_six_mlp_slots_is_refused():
    class Other:
        def layer(self, hidden, weight):
            return hidden

    class ThreeSlots:  # the pre-quantization signature the first version of the patch assumed
        def layer(self, hidden, in0_weight=None, in1_weight=None, out_weight=None):
            return hidden

    for cls in (Other, ThreeSlots):
        with pytest.raises(tnx_patch.PatchError, match="in0_weight"):
            tnx_patch.patched_layer(cls.layer)
