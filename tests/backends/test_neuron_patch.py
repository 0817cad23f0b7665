"""The transformers-neuronx patch against stand-ins shaped like tnx 0.13's DecoderLayer, Llama layer and hlo."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from server.backends.neuron import tnx_patch
from server.backends.neuron.layout import FACTOR_ORDER, SHARD_DIMS, layer_keys, prepare_layer

HIDDEN, INTER = 64, 160


class FakeDecoderLayer:
    def __init__(self, layer_num):
        self.layer_num = layer_num
        self.extra_parameters = []

    def add_parameter(self, param, sharding=None, allow_pad=False):
        self.extra_parameters.append((param, sharding))


class FakeLlamaHlo:
    """Signature modelled on LlamaForSamplingNoEmbeddingHlo.layer: fixed args, then in0/in1/out."""

    def __init__(self, hlo):
        self.hlo = hlo

    def layer(self, hidden, cache_ids, pre_mlp_ln_weight, in0_weight=None, in1_weight=None, out_weight=None,
              is_first_last_layer=False):
        mlp = self.hlo.gated_mlp_bsh(hidden, in0_weight, in1_weight, out_weight, activation_function="silu",
                                     tp_degree=2, neuron_config="nc")
        return ("residual_add", mlp, hidden)


def _dense_gated_mlp(hidden, in0, in1, out, **kwargs):
    return ("dense_mlp", in0, in1, out)


def _factors():
    rng = np.random.default_rng(0)
    t = {}
    for proj in ("gate", "up", "down"):
        in_dim, out_dim = (INTER, HIDDEN) if proj == "down" else (HIDDEN, INTER)
        a, b = layer_keys(1, proj)
        t[a], t[b] = rng.standard_normal((128, in_dim)), rng.standard_normal((out_dim, 128))
    return {1: prepare_layer(t, 1, tp_degree=2)}


@pytest.fixture
def patched(monkeypatch):
    hlo = SimpleNamespace(gated_mlp_bsh=_dense_gated_mlp)
    built = []
    monkeypatch.setattr(tnx_patch, "lowrank_mlp_graph",
                        lambda builder, hidden, factors, tp: built.append((builder, factors, tp)) or "lowrank_mlp")
    state = tnx_patch.install(FakeDecoderLayer, FakeLlamaHlo, hlo, _factors(), HIDDEN, INTER,
                              to_tensor=lambda a: ("tensor", a.shape), builder_factory=lambda nc: ("builder", nc))
    yield SimpleNamespace(hlo=hlo, state=state, built=built)
    tnx_patch.uninstall(state)


def _load_layer(num):
    layer = FakeDecoderLayer(num)
    layer.add_parameter(np.zeros((HIDDEN, INTER)), sharding=1, allow_pad=True)   # gate (in0)
    layer.add_parameter(np.zeros((HIDDEN, INTER)), sharding=1, allow_pad=True)   # up (in1)
    layer.add_parameter(np.zeros((INTER, HIDDEN)), sharding=0, allow_pad=True)   # down (out)
    return layer


def test_compressed_layer_gets_six_sharded_factors_instead_of_dense(patched):
    layer = _load_layer(1)
    assert [p[0][1] if isinstance(p[0], tuple) else p[0].shape for p in layer.extra_parameters] == \
        [(64, 128), (128, 256), (64, 128), (128, 256), (256, 128), (128, 64)]
    assert [p[1] for p in layer.extra_parameters] == [SHARD_DIMS[n] for n in FACTOR_ORDER]
    tnx_patch.verify_injection(patched.state, [1])


def test_dense_layer_keeps_its_weights(patched):
    layer = _load_layer(0)
    assert [p[0].shape for p in layer.extra_parameters] == [(HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]
    _load_layer(1)
    with pytest.raises(tnx_patch.PatchError, match=r"layers \[0\]"):
        tnx_patch.verify_injection(patched.state, [0, 1])


def test_layer_with_factors_builds_lowrank_mlp_and_keeps_residual(patched):
    model = FakeLlamaHlo(patched.hlo)
    out = model.layer("h", "cache", "ln", "f0", "f1", "f2", "f3", "f4", "f5", True)
    assert out == ("residual_add", "lowrank_mlp", "h")
    builder, factors, tp = patched.built[0]
    assert builder == ("builder", "nc") and factors == ("f0", "f1", "f2", "f3", "f4", "f5") and tp == 2


def test_dense_layer_builds_dense_mlp_and_context_is_cleared(patched):
    model = FakeLlamaHlo(patched.hlo)
    model.layer("h", "cache", "ln", "f0", "f1", "f2", "f3", "f4", "f5")
    assert model.layer("h", "cache", "ln", "w0", "w1", "w2") == ("residual_add", ("dense_mlp", "w0", "w1", "w2"), "h")
    assert len(patched.built) == 1


def test_uninstall_restores_originals():
    hlo = SimpleNamespace(gated_mlp_bsh=_dense_gated_mlp)
    before = (FakeDecoderLayer.add_parameter, FakeLlamaHlo.layer)
    state = tnx_patch.install(FakeDecoderLayer, FakeLlamaHlo, hlo, {}, HIDDEN, INTER, lambda a: a, lambda nc: None)
    assert FakeLlamaHlo.layer is not before[1]
    tnx_patch.uninstall(state)
    assert (FakeDecoderLayer.add_parameter, FakeLlamaHlo.layer, hlo.gated_mlp_bsh) == (*before, _dense_gated_mlp)


def test_layer_without_in0_weight_is_refused():
    class Other:
        def layer(self, hidden, weight):
            return hidden

    with pytest.raises(tnx_patch.PatchError, match="in0_weight"):
        tnx_patch.patched_layer(Other.layer)
