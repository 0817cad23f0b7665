"""The MLP patch against recording and NumPy-executing graph builders (tp_degree 1 and 2)."""

from __future__ import annotations

import numpy as np
import pytest

from neuronmm_kernels import reference as ref
from neuronmm_kernels.compat import nki, nl
from server.backends.neuron.kernel_adapter import lowrank_mlp_into
from server.backends.neuron.layout import layer_keys, mlp_numpy, prepare_layer, shard
from server.backends.neuron.mlp_graph import lowrank_mlp_graph


class Recorder:
    """GraphBuilder that records each call with its shapes; values are just shapes."""

    def __init__(self):
        self.calls = []

    def sizes(self, t):
        return tuple(t)

    def reshape(self, t, sizes):
        self.calls.append(("reshape", tuple(t), tuple(sizes)))
        return tuple(sizes)

    def nki_call(self, kernel, *args, output_like, output_sizes):
        self.calls.append(("nki_call", kernel, [tuple(a) for a in args], tuple(output_sizes)))
        return tuple(output_sizes)

    def all_reduce_sum(self, t, tp_degree):
        self.calls.append(("all_reduce_sum", tuple(t), tp_degree))
        return t


def _shard_shapes(hidden, inter, rank, tp):
    i = inter // tp
    return [(hidden, rank), (rank, i), (hidden, rank), (rank, i), (i, rank), (rank, hidden)]


@pytest.mark.parametrize("tp", [1, 2])
def test_call_sequence_and_shapes(tp):
    rec = Recorder()
    factors = _shard_shapes(2048, 8192, 1664, tp)
    out = lowrank_mlp_graph(rec, (4, 1, 2048), factors, tp_degree=tp)
    expected = [("reshape", (4, 1, 2048), (4, 2048)),
                ("nki_call", lowrank_mlp_into, [(4, 2048)] + factors, (4, 2048)),
                ("reshape", (4, 2048), (4, 1, 2048))]
    if tp > 1:
        expected.append(("all_reduce_sum", (4, 1, 2048), tp))
    assert rec.calls == expected and out == (4, 1, 2048)


def test_prefill_bucket_flattens_all_tokens():
    rec = Recorder()
    lowrank_mlp_graph(rec, (1, 512, 2048), _shard_shapes(2048, 8192, 1664, 2), tp_degree=2)
    assert rec.calls[1][2][0] == (512, 2048) and [c[0] for c in rec.calls].count("all_reduce_sum") == 1


@pytest.mark.parametrize("bad", [
    lambda s: s[:5],                                            # a factor missing
    lambda s: [s[0], (s[1][0], 99)] + s[2:],                    # gate_v width disagrees with up_v
    lambda s: [(s[0][0], 100), (100, s[1][1])] + s[2:],          # rank not a multiple of 128
    lambda s: s[:5] + [(s[5][0], 1000)],                         # down_v does not return to hidden
])
def test_inconsistent_factor_shapes_fail_before_any_call(bad):
    rec = Recorder()
    with pytest.raises(ValueError):
        lowrank_mlp_graph(rec, (2, 3, 256), bad(_shard_shapes(256, 512, 128, 1)), tp_degree=1)
    assert rec.calls == []


class NumpyCores:
    """GraphBuilder executing on NumPy, one value per NeuronCore; nki_call runs the kernel (emulated)."""

    def sizes(self, t):
        return t[0].shape

    def reshape(self, t, sizes):
        return [a.reshape(sizes) for a in t]

    def nki_call(self, kernel, *args, output_like, output_sizes):
        @nki.jit
        def entry(*inputs):  # gives the outputs-as-arguments kernel an output buffer, as nki_call does
            y = nl.ndarray(tuple(output_sizes), dtype=inputs[0].dtype, buffer=nl.shared_hbm)
            kernel(*inputs, y)
            return y
        return [nki.simulate_kernel(entry, *per_core) for per_core in zip(*args)]

    def all_reduce_sum(self, t, tp_degree):
        total = sum(a.astype(np.float32) for a in t).astype(t[0].dtype)
        return [total] * tp_degree


@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_kernel_graph_matches_full_mlp(tp):
    rng = np.random.default_rng(7)
    hidden, inter = 256, 320
    t = {}
    for proj, rank in (("gate", 128), ("up", 128), ("down", 100)):
        in_dim, out_dim = (inter, hidden) if proj == "down" else (hidden, inter)
        a, b = layer_keys(0, proj)
        t[a] = rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)
        t[b] = rng.standard_normal((out_dim, rank)) / np.sqrt(rank)
    full = prepare_layer(t, 0, tp, dtype=ref.BF16)
    shards = [shard(full, tp, k).as_tuple() for k in range(tp)]
    hidden_states = rng.standard_normal((2, 3, hidden)).astype(ref.BF16)
    out = lowrank_mlp_graph(NumpyCores(), [hidden_states] * tp, list(zip(*shards)), tp_degree=tp)
    want = mlp_numpy(hidden_states.reshape(6, hidden), prepare_layer(t, 0, 1, dtype=np.float64)).reshape(2, 3, hidden)
    got = out[0].astype(np.float32)
    # bf16 operands and bf16 partial sums: compare against the float64 maths at bf16-scale tolerance
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
    assert all(np.array_equal(o, out[0]) for o in out)


def test_adapter_runs_the_kernel_body_with_the_selected_tiles(monkeypatch):
    """Decode shapes get the decode schedule (U moving), prefill shapes the prefill one: no fixed schedule."""
    from server.backends.neuron import kernel_adapter

    seen = []
    monkeypatch.setattr(kernel_adapter, "lowrank_mlp_body", lambda *args, **tiles: seen.append((args, tiles)))
    for tokens in (1, 512):
        x = np.zeros((tokens, 2048))
        factors = [np.zeros(s) for s in _shard_shapes(2048, 4096, 768, 1)]
        y = np.zeros((tokens, 2048))
        lowrank_mlp_into(x, *factors, y)
        assert seen[-1][0][-1] is y and seen[-1][1] == kernel_adapter.mlp_tiles(tokens, 2048, 4096, (768,) * 3)
    assert seen[0][1].get("u_moving") is True and not seen[1][1].get("u_moving")
