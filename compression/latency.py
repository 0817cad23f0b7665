"""Modeled trn1 latency of MLP matrices at chosen ranks (neuronmm_kernels.cost_model; MODELED, not measured)."""

from __future__ import annotations

from functools import lru_cache

from neuronmm_kernels.cost_model import model_dense_matmul, model_lowrank_matmul
from server.models.artifact import ModuleRecord

TILE = 128  # the kernels take ranks in whole 128-row tiles; a smaller multiple is modeled padded up to the tile


def padded(rank: int) -> int:
    """Rank rounded up to a whole 128 tile (what the lowrank kernel would run)."""
    return -(-rank // TILE) * TILE


@lru_cache(maxsize=None)
def matrix_us(num_tokens: int, in_f: int, out_f: int, rank: int | None) -> float:
    """Modeled µs of one projection: dense_matmul when rank is None, else the fused lowrank_matmul."""
    if rank is None:
        return model_dense_matmul(num_tokens, in_f, out_f).total_us
    return model_lowrank_matmul(num_tokens, in_f, padded(rank), out_f).total_us


def step_latency(num_tokens: int = 128):
    """A step_latency callable for compression.allocation.allocate: modeled µs a rank step adds."""
    def delta(s, old: int | None, new: int | None) -> float:
        return matrix_us(num_tokens, s.in_features, s.out_features, new) - \
            matrix_us(num_tokens, s.in_features, s.out_features, old)
    return delta


def model_latency(modules: dict[str, ModuleRecord], token_counts=(128, 1)) -> dict:
    """Modeled MLP matmul latency per layer and whole model (bf16, sum of per-projection kernel calls; SwiGLU excluded)."""
    out = {"note": "MODELED trn1 (neuronmm_kernels.cost_model), bf16, per-projection kernels, ranks padded to 128, "
                   "SwiGLU elementwise excluded", "tokens": {}}
    for t in token_counts:
        per_layer: dict[str, float] = {}
        for name, info in modules.items():
            if ".mlp." not in name:
                continue
            layer = name.split(".")[2]
            rank = None if info.dense else info.rank
            per_layer[layer] = per_layer.get(layer, 0.0) + matrix_us(t, info.in_features, info.out_features, rank)
        out["tokens"][str(t)] = {"model_us": round(sum(per_layer.values()), 2),
                                 "per_layer_us": {k: round(v, 2) for k, v in per_layer.items()}}
    return out
