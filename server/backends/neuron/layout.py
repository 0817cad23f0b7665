"""Compressed-MLP factors -> the kernel's on-device layout, sharded over NeuronCores (prepared once at load).

Sharding: the intermediate dimension, not the rank. gate/up are followed by SiLU(gate)*up, which is
not linear, so a rank-sharded gate/up would need an all-reduce of the [tokens, intermediate]
pre-activations before the SiLU (a second, larger collective per layer). With the intermediate
dimension split, each core owns whole columns of h = SiLU(x U_g V_g) * (x U_u V_u): gate_v and up_v
are split by columns, down_u by rows, and y = sum over cores of h_k down_u_k down_v. That is one
all-reduce of [tokens, hidden] per layer, the same collective the dense Megatron MLP pays. The
price: gate_u, up_u and down_v are replicated (hidden x rank each) and x U is computed on every core.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.models.artifact import factor_keys

TILE = 128  # partition tile: the kernel wants ranks (and we keep shard widths) in multiples of it
PROJECTIONS = ("gate", "up", "down")
# Dimension tnx splits each factor along (None = replicated); mirrors the layout described above.
SHARD_DIMS = {"gate_u": None, "gate_v": 1, "up_u": None, "up_v": 1, "down_u": 0, "down_v": None}
FACTOR_ORDER = ("gate_u", "gate_v", "up_u", "up_v", "down_u", "down_v")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_to(a: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    if a.shape == shape:
        return np.ascontiguousarray(a)
    out = np.zeros(shape, dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


@dataclass
class LayerFactors:
    """One layer's six kernel operands (U = Aᵀ [in, rank], V = Bᵀ [rank, out]), zero-padded."""

    gate_u: np.ndarray
    gate_v: np.ndarray
    up_u: np.ndarray
    up_v: np.ndarray
    down_u: np.ndarray
    down_v: np.ndarray
    intermediate: int  # the model's true intermediate size (before padding)

    def as_tuple(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, name) for name in FACTOR_ORDER)


def layer_keys(layer: int, proj: str) -> tuple[str, str]:
    """Artifact keys of one projection's factors (A [rank, in], B [out, rank])."""
    return factor_keys(f"model.layers.{layer}.mlp.{proj}_proj")


def compressed_layers(tensors: dict[str, np.ndarray], num_layers: int) -> list[int]:
    """Layers whose three MLP projections all have factors in the artifact."""
    return [i for i in range(num_layers) if all(k in tensors for p in PROJECTIONS for k in layer_keys(i, p))]


def prepare_layer(tensors: dict[str, np.ndarray], layer: int, tp_degree: int, dtype=np.float32) -> LayerFactors:
    """Transpose A, B into U, V; pad ranks to 128 and the intermediate dim to 128 * tp_degree with zeros.

    Zero padding is exact: a zero rank column of U meets a zero row of V; a padded intermediate
    column has gate 0, SiLU(0) = 0, so h is 0 there, and down_u's padded rows are zero too.
    """
    mats = {}
    for proj in PROJECTIONS:
        a_key, b_key = layer_keys(layer, proj)
        a, b = np.asarray(tensors[a_key]), np.asarray(tensors[b_key])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"layer {layer} {proj}: A {a.shape} and B {b.shape} do not share a rank")
        mats[proj] = (a.T.astype(dtype), b.T.astype(dtype))  # U [in, rank], V [rank, out]
    hidden, inter = mats["gate"][0].shape[0], mats["gate"][1].shape[1]
    if mats["up"][1].shape[1] != inter or mats["down"][0].shape[0] != inter or mats["down"][1].shape[1] != hidden:
        raise ValueError(f"layer {layer}: gate/up/down factor shapes disagree on hidden or intermediate size")
    inter_pad = _round_up(inter, TILE * tp_degree)
    out = {}
    for proj, (u, v) in mats.items():
        rank = _round_up(u.shape[1], TILE)
        in_dim = inter_pad if proj == "down" else hidden
        out_dim = hidden if proj == "down" else inter_pad
        out[f"{proj}_u"] = _pad_to(u, (in_dim, rank))
        out[f"{proj}_v"] = _pad_to(v, (rank, out_dim))
    return LayerFactors(intermediate=inter, **out)


def shard(factors: LayerFactors, tp_degree: int, rank: int) -> LayerFactors:
    """Core `rank`'s slice: contiguous equal chunks along SHARD_DIMS (what tnx does with `sharding=`).

    tnx v0.13.0 parallel.py:101-132 (shard_along_on_cpu): core k gets [k*n/tp, (k+1)*n/tp) of that dim;
    decoder.py:1688 (duplicate_or_shard_along) copies a parameter whose sharding is None to every core.
    """
    parts = {}
    for name in FACTOR_ORDER:
        a = getattr(factors, name)
        dim = SHARD_DIMS[name]
        if dim is None:
            parts[name] = a
            continue
        if a.shape[dim] % tp_degree:
            raise ValueError(f"{name}: dim {dim} of {a.shape} does not split over {tp_degree} cores")
        step = a.shape[dim] // tp_degree
        index = [slice(None)] * 2
        index[dim] = slice(rank * step, (rank + 1) * step)
        parts[name] = np.ascontiguousarray(a[tuple(index)])
    return LayerFactors(intermediate=factors.intermediate, **parts)


def mlp_numpy(x: np.ndarray, f: LayerFactors) -> np.ndarray:
    """The kernel's maths in float64 NumPy: (silu(x Ug Vg) * (x Uu Vu)) Ud Vd."""
    x = x.astype(np.float64)
    g = (x @ f.gate_u.astype(np.float64)) @ f.gate_v.astype(np.float64)
    u = (x @ f.up_u.astype(np.float64)) @ f.up_v.astype(np.float64)
    h = g / (1.0 + np.exp(-g)) * u
    return (h @ f.down_u.astype(np.float64)) @ f.down_v.astype(np.float64)
