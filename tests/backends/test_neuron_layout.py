"""Factor layout and sharding: the sum over cores of the sharded MLP equals the unsharded maths."""

from __future__ import annotations

import numpy as np
import pytest

from server.backends.neuron.layout import SHARD_DIMS, compressed_layers, layer_keys, mlp_numpy, prepare_layer, shard


def _artifact(rng, hidden=96, inter=200, ranks=(100, 72, 130), layers=(0,)):
    t = {}
    for layer in layers:
        for proj, rank in zip(("gate", "up", "down"), ranks):
            in_dim, out_dim = (inter, hidden) if proj == "down" else (hidden, inter)
            a, b = layer_keys(layer, proj)
            t[a] = rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)
            t[b] = rng.standard_normal((out_dim, rank)) / np.sqrt(rank)
    return t


def _unpadded_mlp(x, t, layer=0):
    """LowRankLinear maths straight from the artifact: y = (x Aᵀ) Bᵀ per projection."""
    def lin(v, proj):
        a, b = (t[k] for k in layer_keys(layer, proj))
        return (v @ a.T) @ b.T
    g, u = lin(x, "gate"), lin(x, "up")
    return lin(g / (1 + np.exp(-g)) * u, "down")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sum_over_shards_equals_full_mlp(tp):
    rng = np.random.default_rng(tp)
    t = _artifact(rng)
    x = rng.standard_normal((7, 96))
    full = prepare_layer(t, 0, tp, dtype=np.float64)
    total = sum(mlp_numpy(x, shard(full, tp, k)) for k in range(tp))
    np.testing.assert_allclose(total, _unpadded_mlp(x, t), rtol=1e-10, atol=1e-12)


def test_layout_is_transposed_and_padded_to_tiles():
    t = _artifact(np.random.default_rng(0))
    f = prepare_layer(t, 0, tp_degree=2)
    assert f.gate_u.shape == (96, 128) and f.gate_v.shape == (128, 256)   # rank 100 -> 128, inter 200 -> 256
    assert f.up_u.shape == (96, 128) and f.down_u.shape == (256, 256) and f.down_v.shape == (256, 96)
    np.testing.assert_array_equal(f.gate_u[:, :100], t[layer_keys(0, "gate")[0]].T.astype(np.float32))
    assert not f.gate_u[:, 100:].any() and not f.gate_v[:, 200:].any() and not f.down_u[200:].any()
    assert f.intermediate == 200 and all(a.flags["C_CONTIGUOUS"] for a in f.as_tuple())


def test_shards_split_intermediate_and_replicate_the_rest():
    f = prepare_layer(_artifact(np.random.default_rng(1)), 0, tp_degree=2)
    s0, s1 = shard(f, 2, 0), shard(f, 2, 1)
    assert s0.gate_v.shape == (128, 128) and s0.down_u.shape == (128, 256)
    np.testing.assert_array_equal(np.concatenate([s0.up_v, s1.up_v], axis=1), f.up_v)
    np.testing.assert_array_equal(np.concatenate([s0.down_u, s1.down_u], axis=0), f.down_u)
    assert s1.gate_u is f.gate_u and s1.down_v is f.down_v
    assert [k for k, d in SHARD_DIMS.items() if d is None] == ["gate_u", "up_u", "down_v"]


def test_mismatched_factors_are_rejected():
    t = _artifact(np.random.default_rng(2))
    t[layer_keys(0, "up")[1]] = t[layer_keys(0, "up")[1]][:, :10]
    with pytest.raises(ValueError, match="do not share a rank"):
        prepare_layer(t, 0, 1)


def test_compressed_layers_needs_all_three_projections():
    t = _artifact(np.random.default_rng(3), layers=(0, 2))
    del t[layer_keys(2, "down")[1]]
    assert compressed_layers(t, num_layers=4) == [0]
