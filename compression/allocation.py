"""Per-matrix rank allocation: spread a whole-MLP parameter budget over matrices by whitened truncation loss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from compression.rank import low_rank_params, saves_parameters

DENSE = None  # a rank of None means "keep the matrix dense"
TIE_TOL = 0.02  # candidates whose gain per parameter is within 2 % of the best count as a tie (latency decides)


@dataclass
class Spectrum:
    """One matrix: its name, shape, per-component output errors σᵢ and loss weight.

    σᵢ: the singular values of W·L when whitened; when plain, σᵢ(W)·‖X vᵢ‖ (compression.sensitivity.
    plain_output_sigma). Either way Σ_{i>r}σᵢ² is the squared output error of the rank-r truncation.

    weight None: the truncation loss is normalised by Σσᵢ² (each matrix's relative output error). weight w: the
    loss is w·Σ_{i>r}σᵢ², w being the model loss per unit of squared output error (a Fisher estimate), which makes
    losses of different matrices comparable in units of the model's own loss.
    """

    name: str
    in_features: int
    out_features: int
    sigma: np.ndarray
    weight: float | None = None


def _squared_tail(sigma: np.ndarray) -> np.ndarray:
    """tail[r] = Σ_{i>r} σᵢ² for r = 0..len(σ): the squared output error of the rank-r truncation."""
    sq = np.asarray(sigma, dtype=np.float64) ** 2
    return np.concatenate([np.cumsum(sq[::-1])[::-1], [0.0]])


def normalised_tail(sigma: np.ndarray) -> np.ndarray:
    """tail[r] = Σ_{i>r} σᵢ² / Σσᵢ² for r = 0..len(σ): the relative activation error squared at rank r."""
    tail = _squared_tail(sigma)
    return tail / tail[0] if tail[0] > 0 else np.zeros_like(tail)


def truncation_loss(s: Spectrum) -> np.ndarray:
    """loss[r] for r = 0..len(σ): the normalised tail, or weight · Σ_{i>r}σᵢ² when the spectrum has a weight."""
    return normalised_tail(s.sigma) if s.weight is None else s.weight * _squared_tail(s.sigma)


def budget_for(spectra: list[Spectrum], keep_ratio: float) -> int:
    """The whole-MLP budget: keep_ratio of the dense parameters Σ in·out, rounded down."""
    return int(keep_ratio * sum(s.in_features * s.out_features for s in spectra))


def _next_step(s: Spectrum, rank: int | None, m: int) -> tuple[int, int | None] | None:
    """(parameter cost, new rank) of one step up from rank; the step goes dense when the next rank would not pay."""
    if rank is DENSE:
        return None
    nxt = rank + m
    if saves_parameters(s.in_features, s.out_features, nxt):
        return m * (s.in_features + s.out_features), nxt
    return s.in_features * s.out_features - low_rank_params(s.in_features, s.out_features, rank), DENSE


def allocate(spectra: list[Spectrum], keep_ratio: float, rank_multiple: int,
             step_latency: Callable[[Spectrum, int, int | None], float] | None = None) -> dict:
    """Greedy ranks: every matrix starts at rank_multiple; repeatedly take the step with the largest drop in
    truncation loss (see truncation_loss) per parameter that still fits the budget, until none fits.

    step_latency(spectrum, old_rank, new_rank) -> modeled µs added by a step; when given, among steps whose gain per
    parameter is within TIE_TOL of the best, the one the cost model says is cheapest wins (a tie-break only: it never
    trades quality for latency beyond that tolerance). Returns {"ranks": {name: rank or None}, "budget", "used",
    "loss": {name: truncation loss at the chosen rank}}.
    """
    if rank_multiple < 1:
        raise ValueError(f"rank_multiple must be >= 1, got {rank_multiple}")
    m = rank_multiple
    budget = budget_for(spectra, keep_ratio)
    tails = {s.name: truncation_loss(s) for s in spectra}
    ranks: dict[str, int | None] = {}
    used = 0
    for s in spectra:
        if saves_parameters(s.in_features, s.out_features, m):
            ranks[s.name] = m
            used += low_rank_params(s.in_features, s.out_features, m)
        else:  # not even the smallest rank pays: the matrix stays dense
            ranks[s.name] = DENSE
            used += s.in_features * s.out_features
    if used > budget:
        raise ValueError(f"keep_ratio {keep_ratio} leaves {budget} parameters, below the {used} that rank "
                         f"{m} in every matrix needs")

    def tail(name: str, rank: int | None) -> float:
        t = tails[name]
        return 0.0 if rank is DENSE else float(t[min(rank, len(t) - 1)])

    while True:
        cands = []
        for s in spectra:
            step = _next_step(s, ranks[s.name], m)
            if step is None or used + step[0] > budget:
                continue
            cost, new = step
            gain = tail(s.name, ranks[s.name]) - tail(s.name, new)
            cands.append((gain / cost, cost, new, s))
        if not cands:
            break
        best = max(c[0] for c in cands)
        if step_latency is not None and best > 0:
            tied = [c for c in cands if c[0] >= best * (1 - TIE_TOL)]
            pick = min(tied, key=lambda c: (step_latency(c[3], ranks[c[3].name], c[2]), -c[0]))
        else:
            pick = max(cands, key=lambda c: c[0])
        _, cost, new, s = pick
        ranks[s.name] = new
        used += cost
    return {"ranks": ranks, "budget": budget, "used": used,
            "loss": {s.name: float(f"{tail(s.name, ranks[s.name]):.6g}") for s in spectra}}


def params_used(spectra: list[Spectrum], ranks: dict[str, int | None]) -> int:
    """Parameters the chosen ranks use (dense matrices count in·out)."""
    return sum(s.in_features * s.out_features if ranks[s.name] is DENSE
               else low_rank_params(s.in_features, s.out_features, ranks[s.name]) for s in spectra)


MAX_DP_CELLS = 50_000_000  # options × capacity cells the exact DP may touch before it coarsens its parameter unit


def rank_options(s: Spectrum, rank_multiple: int) -> list[int | None]:
    """Every rank a matrix may take: the multiples of rank_multiple that save parameters, then dense (always)."""
    limit = min(s.in_features, s.out_features)
    ranks = [r for r in range(rank_multiple, limit, rank_multiple) if saves_parameters(s.in_features, s.out_features, r)]
    return ranks + [DENSE]


def _option_cost(s: Spectrum, rank: int | None) -> int:
    return s.in_features * s.out_features if rank is DENSE else low_rank_params(s.in_features, s.out_features, rank)


def _option_loss(loss: np.ndarray, rank: int | None) -> float:
    return 0.0 if rank is DENSE else float(loss[min(rank, len(loss) - 1)])


def allocate_exact(spectra: list[Spectrum], keep_ratio: float, rank_multiple: int,
                   max_cells: int = MAX_DP_CELLS, scores: dict[str, dict[int | None, float]] | None = None) -> dict:
    """Ranks minimising the summed loss of the chosen options under the whole-MLP budget: a multiple-choice knapsack
    over rank_options per matrix, solved by dynamic programming over the budget in parameter units.

    The loss of an option is its truncation loss (see truncation_loss; dense 0), or with `scores` the given
    {name: {rank or None: loss}} (e.g. the measured rise of the model's loss, compression.measured), which must hold
    every option of every matrix (the spectra then only give the shapes). The unit is the gcd of every option's
    parameter count, so the DP is exact; when options × capacity would exceed max_cells the unit is coarsened and
    costs are rounded UP to it (still never over budget, no longer guaranteed optimal; "exact" is then False).
    Returns allocate's dict plus "exact", "unit" and "total_loss".
    """
    if rank_multiple < 1:
        raise ValueError(f"rank_multiple must be >= 1, got {rank_multiple}")
    budget = budget_for(spectra, keep_ratio)
    options = [rank_options(s, rank_multiple) for s in spectra]
    costs = [[_option_cost(s, r) for r in opts] for s, opts in zip(spectra, options)]

    def option_loss(s: Spectrum, rank: int | None) -> float:
        if scores is None:
            return _option_loss(truncation_loss(s), rank)
        if rank not in scores.get(s.name, {}):
            raise ValueError(f"no score for {s.name} at {'dense' if rank is DENSE else f'rank {rank}'}")
        return float(scores[s.name][rank])

    losses = [[option_loss(s, r) for r in opts] for s, opts in zip(spectra, options)]
    unit = 0
    for row in costs:
        for c in row:
            unit = math.gcd(unit, c)
    unit = max(unit, 1)
    num_options = sum(len(o) for o in options)
    exact = (budget // unit + 1) * num_options <= max_cells
    if not exact:  # the smallest unit that keeps the table within max_cells
        unit = max(unit, -(-budget * num_options // max_cells))
    capacity = budget // unit
    units = [[-(-c // unit) for c in row] for row in costs]  # ceil: a coarse unit never under-counts a cost
    if sum(min(row) for row in units) > capacity:
        cheapest = sum(min(row) for row in costs)
        raise ValueError(f"keep_ratio {keep_ratio} leaves {budget} parameters, below the {cheapest} that the smallest "
                         f"option of every matrix (rank {rank_multiple} or dense) needs")
    # best[c]: least total loss of the matrices so far using at most c units; choice[k, c]: matrix k's option there.
    best = np.zeros(capacity + 1)
    choice = np.zeros((len(spectra), capacity + 1), dtype=np.int32)
    for k in range(len(spectra)):
        nxt = np.full(capacity + 1, np.inf)
        for j, (w, loss) in enumerate(zip(units[k], losses[k])):
            if w > capacity:
                continue
            cand = np.full(capacity + 1, np.inf)
            cand[w:] = best[:capacity + 1 - w] + loss
            better = cand < nxt
            nxt[better] = cand[better]
            choice[k, better] = j
        best = nxt
    ranks: dict[str, int | None] = {}
    c = capacity
    for k in range(len(spectra) - 1, -1, -1):
        j = int(choice[k, c])
        ranks[spectra[k].name] = options[k][j]
        c -= units[k][j]
    ranks = {s.name: ranks[s.name] for s in spectra}
    loss = {s.name: option_loss(s, ranks[s.name]) for s in spectra}
    return {"ranks": ranks, "budget": budget, "used": params_used(spectra, ranks), "exact": exact, "unit": unit,
            "total_loss": float(sum(loss.values())), "loss": {k: float(f"{v:.6g}") for k, v in loss.items()}}
