"""Structured pruning of the MLP's intermediate channels in blocks (issue 18's baseline against the SVD path).

Removing channel j of a Llama MLP removes row j of gate_proj and up_proj and column j of down_proj:
3·hidden parameters, one narrower matmul per projection, tile-aligned when whole blocks of `block` channels go.

Scores come from one calibration pass over the DENSE model (the C4 windows `neuronmm compress` uses, same
helpers): for every layer, h = act(gate x)·(up x) on the normed MLP inputs x, and its Gram G = HᵀH (float32 products
summed over batches in float64, compression.statistics.gram_float32: the down_proj input XᵀX the whitened SVD
computes in float64).

- "energy": s_j = E[h_j²]·‖down[:, j]‖², the expected squared contribution of channel j to the MLP output
  (the diagonal of the output error ‖H_S down_Sᵀ‖² of removing a set S; ignores cross terms).
- "obs": Optimal Brain Surgeon order with down_proj compensated: remove one channel at a time, the one with the
  least ‖W_j‖² / [G⁻¹]_jj, updating W and G⁻¹ (ZipLM-style). The cost is the output error after the least-squares
  refit of down_proj on the kept channels, so it only makes sense together with the refit.

Per layer the channels are ordered by removal; removing k blocks removes the first k·block of that order, at the
cumulative cost of those channels. Allocation under the whole-MLP budget (keep ≤ keep_ratio of the MLP):

- "uniform": every layer loses the same number of blocks; the remainder (blocks do not divide evenly over
  layers) goes one block each to the layers whose next block costs least.
- "global": the per-layer block counts minimising the summed cost (exact dynamic program over layers), the costs
  optionally weighted per layer by the output Fisher of down_proj (compression.sensitivity.output_fisher), which
  puts the squared output errors of different layers into one unit (model loss), as the SVD allocation does.

Optional refit: down_proj re-solved by (ridge) least squares on the kept channels, W_K = W·G_{:,K}·(G_KK + λI)⁻¹,
layer by layer on the pruned model's own activations (the target is what the layer's unpruned down_proj would
output on the same inputs, as the whitened SVD targets).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from compression.statistics import (capture_layer0_inputs, dense_mlp_grams, gram_float32, mlp_inputs,
                                   mlp_intermediate)
from server.models.compressed import linear_with

log = logging.getLogger(__name__)

Score = Literal["energy", "obs"]
Allocation = Literal["uniform", "global"]


@dataclass
class LayerStats:
    """One layer's MLP intermediate statistics on the calibration tokens (dense model)."""

    gram: torch.Tensor  # [intermediate, intermediate] HᵀH, h = act(gate x)·(up x); float64
    tokens: int

    @property
    def energy(self) -> torch.Tensor:
        """E[h_j²] per channel (mean over tokens), float64."""
        return self.gram.diagonal() / max(self.tokens, 1)


@dataclass
class RemovalOrder:
    """A layer's channels in the order they are removed, and cost[k] of removing the first k (cost[0] = 0)."""

    order: torch.Tensor  # [max_remove] long
    cost: np.ndarray  # [max_remove + 1] float64, mean squared MLP-output error per token

    def block_costs(self, block: int) -> np.ndarray:
        """cost of removing k whole blocks, k = 0..len(order) // block."""
        return self.cost[: (len(self.order) // block) * block + 1: block]


@dataclass
class PrunePlan:
    """Kept channel indices (sorted) per layer plus the allocation's record."""

    keep: list[torch.Tensor]
    removed_blocks: list[int]
    record: dict = field(default_factory=dict)


def _refit_inputs(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int,
                  keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(G = HᵀH of the layer's unpruned intermediate h on hidden, residual, h[..., keep] per batch).

    Attention runs once; the kept columns of h are what the pruned gate/up will compute (their rows are unchanged),
    so the layer's pruned output needs only down_proj on them, not a second MLP pass.
    """
    residual, normed = mlp_inputs(layer, hidden, kwargs, batch_size)
    g, kept = None, []
    for x in normed.split(batch_size):
        h = mlp_intermediate(layer.mlp, x)
        g = gram_float32(h) if g is None else g + gram_float32(h)
        kept.append(h[..., keep])
    return g, residual, kept


def layer_stats(model: nn.Module, windows: torch.Tensor, batch_size: int) -> list[LayerStats]:
    """HᵀH of every layer's MLP intermediate activations on windows, on the dense model (one sequential pass)."""
    with torch.no_grad():
        hidden, kwargs = capture_layer0_inputs(model, windows, batch_size)
    return [LayerStats(xtx_down, windows.numel()) for _, _, _, xtx_down in
            dense_mlp_grams(model, hidden, kwargs, batch_size, "prune: channel statistics", gram_float32,
                            input_gram=False)]


def energy_scores(stats: LayerStats, down_weight: torch.Tensor) -> torch.Tensor:
    """s_j = E[h_j²]·‖down[:, j]‖² (float64): channel j's expected squared contribution to the MLP output."""
    return stats.energy * down_weight.detach().to(torch.float64).pow(2).sum(0)


def energy_order(stats: LayerStats, down_weight: torch.Tensor, max_remove: int) -> RemovalOrder:
    """Lowest energy score first (stable sort: ties keep the channel order)."""
    scores = energy_scores(stats, down_weight)
    order = torch.sort(scores, stable=True).indices[:max_remove]
    return RemovalOrder(order, np.concatenate([[0.0], np.cumsum(scores[order].numpy())]))


def _damped(g: torch.Tensor, damp: float) -> torch.Tensor:
    g = g.to(torch.float64)
    lam = damp * float(g.diagonal().mean()) if g.numel() else 0.0
    return g + lam * torch.eye(g.shape[0], dtype=g.dtype)


def obs_order(stats: LayerStats, down_weight: torch.Tensor, max_remove: int, damp: float = 1e-2) -> RemovalOrder:
    """Greedy OBS: repeatedly drop the channel whose removal, with down_proj re-solved on the rest, adds the least
    output error ‖W_j‖²/[G⁻¹]_jj; W ← W − W_j (G⁻¹)_{j,:}/[G⁻¹]_jj, G⁻¹ ← G⁻¹ − (G⁻¹)_{:,j}(G⁻¹)_{j,:}/[G⁻¹]_jj.

    G is damped by damp·mean diag (the same ridge the refit uses). Costs are per token.
    """
    W = down_weight.detach().to(torch.float64).clone()  # [hidden, n], columns of the channels still alive
    Hinv = torch.linalg.inv(_damped(stats.gram, damp))
    alive = torch.arange(W.shape[1])  # original index of each column of W / row of Hinv
    order, cost = [], [0.0]
    tokens = max(stats.tokens, 1)
    for step in range(min(max_remove, len(alive))):
        if step and step % 128 == 0:  # drop the removed rows/columns: later steps work on smaller matrices
            live = (Hinv.diagonal() != 0).nonzero().flatten()
            W, Hinv, alive = W[:, live].contiguous(), Hinv[live][:, live].contiguous(), alive[live]
        diag = Hinv.diagonal()
        err = W.pow(2).sum(0) / torch.where(diag != 0, diag, 1.0)
        err[diag == 0] = math.inf
        j = int(torch.argmin(err))
        d = float(Hinv[j, j])
        row = Hinv[j].clone()
        W.addr_(W[:, j].clone(), row, alpha=-1.0 / d)
        Hinv.addr_(row, row, alpha=-1.0 / d)  # Hinv symmetric: column j = row j
        W[:, j] = 0.0
        Hinv[j, :] = 0.0
        Hinv[:, j] = 0.0
        order.append(int(alive[j]))
        cost.append(cost[-1] + float(err[j]) / tokens)
    return RemovalOrder(torch.tensor(order, dtype=torch.long), np.asarray(cost))


def removal_orders(model: nn.Module, stats: list[LayerStats], score: Score, max_remove: int,
                   damp: float = 1e-2) -> list[RemovalOrder]:
    """Each layer's removal order under `score` (at most max_remove channels a layer)."""
    out = []
    for layer, st in tqdm(list(zip(model.model.layers, stats)), desc=f"prune: {score} order", unit="layer"):
        down = layer.mlp.down_proj.weight
        out.append(energy_order(st, down, max_remove) if score == "energy" else obs_order(st, down, max_remove, damp))
    return out


def budget_blocks(num_layers: int, hidden: int, intermediate: int, keep_ratio: float, block: int) -> tuple[int, int]:
    """(blocks to remove, parameter budget): the fewest whole blocks whose removal keeps the MLP within
    int(keep_ratio · Σ in·out), the budget the SVD allocation uses (compression.allocation.budget_for)."""
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    if block < 1 or intermediate % block:
        raise ValueError(f"intermediate size {intermediate} is not a multiple of the block {block}")
    total = num_layers * 3 * hidden * intermediate
    budget = int(keep_ratio * total)
    per_block = 3 * hidden * block
    kept = budget // per_block  # whole blocks the budget pays for
    return num_layers * (intermediate // block) - kept, budget


def allocate_blocks(costs: list[np.ndarray], remove: int, method: Allocation,
                    weights: list[float] | None = None) -> list[int]:
    """Blocks removed per layer, summing to `remove`. costs[l][k]: cost of removing k blocks of layer l, for
    k = 0..the most layer l may lose (len(costs[l]) - 1).

    weights: per-layer multipliers of the costs (e.g. output Fisher), used by both methods' choices.
    """
    L = len(costs)
    w = [1.0] * L if weights is None else [float(x) for x in weights]
    limit = [len(c) - 1 for c in costs]
    if remove < 0 or remove > sum(limit):
        raise ValueError(f"cannot remove {remove} blocks: the layers allow {sum(limit)}")
    if method == "uniform":
        base, extra = divmod(remove, L)
        if base > min(limit):
            raise ValueError(f"uniform: {base} blocks a layer exceeds a layer's limit {min(limit)}")
        counts = [base] * L
        room = [i for i in range(L) if limit[i] > base]
        room.sort(key=lambda i: (w[i] * (costs[i][base + 1] - costs[i][base]), i))
        if extra > len(room):
            raise ValueError(f"uniform: {extra} extra blocks, only {len(room)} layers have room")
        for i in room[:extra]:
            counts[i] += 1
        return counts
    if method != "global":
        raise ValueError(f"unknown allocation {method!r}")
    # Exact DP: best[r] = least weighted cost of the layers so far removing exactly r blocks.
    best = np.full(remove + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((L, remove + 1), dtype=np.int64)
    for i in range(L):
        nxt = np.full(remove + 1, np.inf)
        for k in range(min(limit[i], remove) + 1):
            cand = np.full(remove + 1, np.inf)
            cand[k:] = best[: remove + 1 - k] + w[i] * costs[i][k]
            better = cand < nxt
            nxt[better] = cand[better]
            choice[i, better] = k
        best = nxt
    counts, r = [0] * L, remove
    for i in range(L - 1, -1, -1):
        counts[i] = int(choice[i, r])
        r -= counts[i]
    return counts


def make_plan(orders: list[RemovalOrder], intermediate: int, hidden: int, keep_ratio: float, block: int,
              method: Allocation, weights: list[float] | None = None, min_keep_blocks: int = 1) -> PrunePlan:
    """Per-layer kept channels for the budget: allocation over each layer's block costs."""
    remove, budget = budget_blocks(len(orders), hidden, intermediate, keep_ratio, block)
    most = intermediate // block - min_keep_blocks  # each layer keeps at least min_keep_blocks blocks
    costs = [o.block_costs(block)[: most + 1] for o in orders]
    counts = allocate_blocks(costs, remove, method, weights)
    keep = []
    for o, k in zip(orders, counts):
        mask = torch.ones(intermediate, dtype=torch.bool)
        mask[o.order[: k * block]] = False
        keep.append(mask.nonzero().flatten())
    w = [1.0] * len(orders) if weights is None else weights
    used = sum(3 * hidden * len(k) for k in keep)
    record = {"allocation": method, "block": block, "keep_ratio": keep_ratio, "mlp_budget": budget,
              "mlp_params_before": len(orders) * 3 * hidden * intermediate, "mlp_params_used": used,
              "blocks_removed": remove, "intermediate_sizes": [len(k) for k in keep],
              "weighted": weights is not None,
              "total_cost": float(sum(wi * c[k] for wi, c, k in zip(w, costs, counts)))}
    return PrunePlan(keep, counts, record)


@torch.no_grad()
def prune_mlp(mlp: nn.Module, keep: torch.Tensor, down_weight: torch.Tensor | None = None) -> None:
    """Slice a Llama MLP in place to the channels `keep` (new nn.Linear modules); down_weight replaces
    down_proj's kept columns when given (a refit)."""
    keep = keep.to(mlp.gate_proj.weight.device)
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    mlp.gate_proj = linear_with(g.weight[keep], None if g.bias is None else g.bias[keep])
    mlp.up_proj = linear_with(u.weight[keep], None if u.bias is None else u.bias[keep])
    new_down = d.weight[:, keep] if down_weight is None else down_weight.to(d.weight)
    mlp.down_proj = linear_with(new_down, d.bias)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(keep)


def refit_down(weight: torch.Tensor, keep: torch.Tensor, g: torch.Tensor, damp: float = 1e-2) -> torch.Tensor:
    """W_K [out, |K|] = (W·G_{:,K} + λW_K)(G_KK + λI)⁻¹: down_proj on the kept channels re-solved so H_K W_Kᵀ ≈ H Wᵀ
    (ridge toward the plain slice W_K, λ = damp·mean diag G_KK)."""
    W = weight.detach().to(torch.float64)
    g = g.to(torch.float64)
    gkk = g[keep][:, keep]
    lam = damp * float(gkk.diagonal().mean()) if len(keep) else 0.0
    rhs = W @ g[:, keep] + lam * W[:, keep]  # [out, |K|]
    return torch.linalg.solve(gkk + lam * torch.eye(len(keep), dtype=g.dtype), rhs.T).T


def output_rel_error(weight: torch.Tensor, new: torch.Tensor, keep: torch.Tensor, g: torch.Tensor) -> float:
    """‖H_K newᵀ − H Wᵀ‖_F / ‖H Wᵀ‖_F from G = HᵀH."""
    W = weight.detach().to(torch.float64)
    full = torch.zeros_like(W)
    full[:, keep] = new.to(torch.float64)
    D = W - full
    g = g.to(torch.float64)
    num, den = float(((D @ g) * D).sum()), float(((W @ g) * W).sum())
    return math.sqrt(max(num, 0.0) / den) if den > 0 else 0.0


@torch.no_grad()
def apply_plan(model: nn.Module, plan: PrunePlan, windows: torch.Tensor | None = None, batch_size: int = 8,
               refit: bool = False, damp: float = 1e-2) -> dict:
    """Prune every layer's MLP to plan.keep in place. With refit, layer by layer on windows: G of the layer's
    (unpruned) intermediate on the already-pruned model's activations, slice, re-solve down_proj, advance.

    Returns {"refit": ..., "rel_error": [[before, after] per layer]} (output errors on calibration tokens)."""
    layers = model.model.layers
    if not refit:
        for layer, keep in zip(layers, plan.keep):
            if len(keep) != layer.mlp.gate_proj.out_features:
                prune_mlp(layer.mlp, keep)
        return {"refit": False}
    if windows is None:
        raise ValueError("refit needs calibration windows")
    hidden, kwargs = capture_layer0_inputs(model, windows, batch_size)
    errors = []
    for layer, keep in tqdm(list(zip(layers, plan.keep)), desc="prune: refit down_proj", unit="layer"):
        mlp = layer.mlp
        if len(keep) != mlp.gate_proj.out_features:
            g, residual, kept = _refit_inputs(layer, hidden, kwargs, batch_size, keep)
            W = mlp.down_proj.weight
            new = refit_down(W, keep, g, damp)
            errors.append([round(output_rel_error(W, W[:, keep], keep, g), 6),
                           round(output_rel_error(W, new, keep, g), 6)])
            prune_mlp(mlp, keep, new)
            hidden = torch.cat([r + mlp.down_proj(h) for r, h in zip(residual.split(batch_size), kept)])
        else:
            residual, normed = mlp_inputs(layer, hidden, kwargs, batch_size)
            errors.append([0.0, 0.0])
            hidden = torch.cat([r + mlp(x) for r, x in zip(residual.split(batch_size), normed.split(batch_size))])
    return {"refit": True, "damp": damp, "rel_error": errors}


def mlp_parameters(model: nn.Module) -> int:
    """Parameters in the MLP linears (gate/up/down) of every layer."""
    return sum(p.numel() for layer in model.model.layers for p in layer.mlp.parameters())
