"""The compressed MLP as graph-building calls, written against a small builder interface.

`lowrank_mlp_graph` is what replaces transformers-neuronx's `gated_mlp_bsh` for a compressed
layer: reshape the token-major hidden states to the kernel's [num_tokens, hidden], one
`nki_call` of the fused low-rank SwiGLU kernel on this core's factor shards, reshape back, and
(tp_degree > 1) one all-reduce sum over cores. The residual add stays where transformers-neuronx
does it (right after the MLP returns). `TnxGraphBuilder` binds the interface to the real SDK;
tests bind it to a recorder.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from server.backends.neuron.kernel_adapter import lowrank_mlp_into

NUM_FACTORS = 6  # gate_u, gate_v, up_u, up_v, down_u, down_v


class GraphBuilder(Protocol):
    """The graph operations the MLP patch needs (transformers-neuronx's hlo helpers in production)."""

    def sizes(self, t: Any) -> tuple[int, ...]:
        """Static shape of a graph value."""

    def reshape(self, t: Any, sizes: Sequence[int]) -> Any:
        """Same data, new static shape."""

    def nki_call(self, kernel: Any, *args: Any, output_like: Any, output_sizes: Sequence[int]) -> Any:
        """Embed an NKI kernel; its output has `output_like`'s dtype and `output_sizes`."""

    def all_reduce_sum(self, t: Any, tp_degree: int) -> Any:
        """Sum over the tensor-parallel cores."""


def check_factor_shapes(hidden: int, shapes: Sequence[tuple[int, ...]]) -> None:
    """Raise ValueError unless the six per-core factor shapes chain (hidden -> r -> I_k -> r -> hidden)."""
    if len(shapes) != NUM_FACTORS:
        raise ValueError(f"expected {NUM_FACTORS} factors, got {len(shapes)}")
    gu, gv, uu, uv, du, dv = shapes
    inter = gv[1]
    ok = (gu[0] == hidden and uu[0] == hidden and gu[1] == gv[0] and uu[1] == uv[0] and uv[1] == inter
          and du[0] == inter and du[1] == dv[0] and dv[1] == hidden)
    if not ok:
        raise ValueError(f"factor shapes do not chain for hidden {hidden}: {list(shapes)}")
    if any(r % 128 for r in (gu[1], uu[1], du[1])):
        raise ValueError(f"factor ranks must be multiples of 128: {gu[1]}, {uu[1]}, {du[1]}")


def lowrank_mlp_graph(builder: GraphBuilder, hidden: Any, factors: Sequence[Any], tp_degree: int) -> Any:
    """MLP output (before the residual add) for BSH hidden states [seqs, tokens, hidden]."""
    seqs, tokens, width = builder.sizes(hidden)
    check_factor_shapes(width, [builder.sizes(f) for f in factors])
    flat = (seqs * tokens, width)
    x = builder.reshape(hidden, flat)  # BSH is token-major: a free reshape, no transpose
    y = builder.nki_call(lowrank_mlp_into, x, *factors, output_like=hidden, output_sizes=flat)
    y = builder.reshape(y, (seqs, tokens, width))
    if tp_degree > 1:  # each core holds 1/tp of the intermediate dim: partial sums of y
        y = builder.all_reduce_sum(y, tp_degree)
    return y


class TnxGraphBuilder:
    """GraphBuilder over transformers-neuronx 0.13 (`hlo`, `utils`, `nki.compile.nki_call`); SDK only."""

    def __init__(self, neuron_config: Any):
        from transformers_neuronx import hlo, utils
        from transformers_neuronx.nki.compile import nki_call

        self._hlo, self._utils, self._nki_call = hlo, utils, nki_call
        self._neuron_config = neuron_config

    def sizes(self, t):
        return tuple(t.sizes)

    def reshape(self, t, sizes):
        return self._hlo.reshape(t, list(sizes))  # tnx v0.13.0 hlo.py:2685 reshape(tensor, shape)

    def nki_call(self, kernel, *args, output_like, output_sizes):
        # nki/compile.py:51-160: the output shapes are appended to the kernel's arguments; one output -> one value
        return self._nki_call(kernel, *args, output_HloShapes=[output_like.dtype[tuple(output_sizes)]])

    def all_reduce_sum(self, t, tp_degree):
        # the dense MLP's own reduction (hlo.py:728-733): the config's all_reduce_dtype and replica groups
        dtype, groups = self._utils.parse_dtype_replica_groups(self._neuron_config, tp_degree)
        return self._hlo.all_reduce_sum(t, tp_degree, dtype=dtype, replica_groups=groups)
