"""Measured allocation scores: the rise of the next-token loss on held-out calibration windows when one MLP matrix
(or one matrix on top of a chosen allocation) is replaced by its whitened rank-r truncation.

The dense model runs over the scoring windows once, layer by layer; at layer i the post-attention residual and the
MLP input are kept, so each option of a layer-i matrix costs only that layer's MLP and layers i+1.. (plus the LM
head), on the same tokens for every option (paired differences). The factors are those of compression.whiten
(damped Cholesky of the dense calibration XᵀX, SVD of W·L): whitened_factors at the largest option rank, sliced
(the SVD's leading rows/columns are the factors of every smaller rank).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from compression.allocation import DENSE, Spectrum, allocate_exact, rank_options
from compression.statistics import (MLP, capture_layer0_inputs, dense_mlp_grams, mlp_inputs, run_layer,
                                    single_threaded_lapack)
from compression.whiten import damped_cholesky, plain_factors, whitened_factors
from server.models.lowrank import LowRankLinear

log = logging.getLogger(__name__)

KINDS = tuple(k.removesuffix("_proj") for k in MLP)  # gate, up, down


@dataclass
class Factors:
    """One matrix's factors at its largest option rank; rank r is A[:r], B[:, :r]."""

    in_features: int
    out_features: int
    options: list[int | None]  # low-rank options (multiples of the rank multiple that save parameters), then dense
    A: torch.Tensor  # [max rank, in] float32
    B: torch.Tensor  # [out, max rank] float32

    def module(self, rank: int, dtype: torch.dtype) -> LowRankLinear:
        return LowRankLinear(self.A[:rank].to(dtype), self.B[:, :rank].to(dtype))


def mlp_factors(model: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int, rank_multiple: int,
                whitened: bool = True) -> dict[str, Factors]:
    """{module name: Factors} for gate/up/down of every layer, from the DENSE model's calibration activations."""
    out: dict[str, Factors] = {}
    for i, layer, xtx, xtx_down in dense_mlp_grams(model, hidden, kwargs, batch_size, "measured (dense factors)"):
        L = damped_cholesky(xtx)[0] if whitened else None  # gate and up share one XᵀX: one Cholesky
        Ld = damped_cholesky(xtx_down)[0] if whitened else None
        for kind, chol in (("gate", L), ("up", L), ("down", Ld)):
            linear = getattr(layer.mlp, f"{kind}_proj")
            out_f, in_f = linear.weight.shape
            options = rank_options(Spectrum("", in_f, out_f, np.zeros(0)), rank_multiple)
            top = max((r for r in options if r is not DENSE), default=0)
            W = linear.weight.detach()
            with single_threaded_lapack():
                A, B = whitened_factors(W, chol, top) if whitened else plain_factors(W, top)
            out[f"model.layers.{i}.mlp.{kind}_proj"] = Factors(in_f, out_f, options, A.float(), B.float())
    return out


@dataclass
class Scores:
    """Per matrix and option: the mean next-token loss (nats/token) on the scoring windows with that option, minus
    the loss of the context (dense model, or the allocation being refined) with that matrix at `reference` rank."""

    base_loss: float  # loss of the context itself
    tokens: int  # scored next-token predictions
    delta: dict[str, dict[int | None, float]]
    reference: dict[str, int | None] = field(default_factory=dict)  # the context's rank per matrix (None: dense)

    def to_json(self) -> dict:
        return {"base_loss": self.base_loss, "tokens": self.tokens,
                "reference": {k: v for k, v in self.reference.items()},
                "delta": {k: [[r, d] for r, d in v.items()] for k, v in self.delta.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Scores":
        return cls(data["base_loss"], data["tokens"],
                   {k: {r: d for r, d in v} for k, v in data["delta"].items()}, dict(data.get("reference", {})))


def _set(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent, child = name.rsplit(".", 1)
    mlp = model.get_submodule(parent)
    old = getattr(mlp, child)
    setattr(mlp, child, module)
    return old


class LossFrom:
    """The model's mean next-token loss on `ids`, resumed inside layer i from that layer's post-attention residual
    and MLP input (so layers before i, and layer i's attention, are not run again)."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, kwargs: dict):
        self.model, self.ids, self.kwargs = model, ids, kwargs
        self.tokens = ids.shape[0] * (ids.shape[1] - 1)

    def __call__(self, i: int, residual: torch.Tensor, normed: torch.Tensor) -> float:
        layers = self.model.model.layers
        h = residual + layers[i].mlp(normed)
        for layer in layers[i + 1:]:
            h = run_layer(layer, h, self.kwargs)
        return self.head_loss(h)

    def head_loss(self, h: torch.Tensor) -> float:
        """Mean next-token cross-entropy from the last layer's output, one window at a time (bounds the logits)."""
        total = 0.0
        for w in range(h.shape[0]):
            logits = self.model.lm_head(self.model.model.norm(h[w:w + 1]))[0, :-1].float()
            total += float(F.cross_entropy(logits, self.ids[w, 1:], reduction="sum"))
        return total / self.tokens


def _run(layers, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    for layer in layers:
        hidden = run_layer(layer, hidden, kwargs)
    return hidden


def allocation_loss(model: nn.Module, ids: torch.Tensor, factors: dict[str, Factors],
                    ranks: dict[str, int | None]) -> float:
    """Mean next-token loss on `ids` with every matrix of `ranks` at its rank (factors of `factors`; None: dense)."""
    return measure(model, ids, factors, ranks, only=set()).base_loss


def scoring_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model to score with: itself in its own dtype, else a copy cast to dtype (the original is untouched)."""
    if next(model.parameters()).dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def measure(model: nn.Module, ids: torch.Tensor, factors: dict[str, Factors],
            context: dict[str, int | None] | None = None, desc: str = "measured (loss per option)",
            only: set[str] | None = None) -> Scores:
    """Scores of every low-rank option (and dense) of every matrix in `factors` (or in `only`), on the windows
    `ids` [n, T], computed in the model's own dtype (see scoring_model) with the factors cast to it.

    context None: every other matrix dense, the reference is dense (delta 0 by definition, not run). context
    {name: rank or None}: every matrix sits at its context rank (factors of the same Factors) while one of its
    options is tried; the reference is its context rank (delta 0 there; dense is then scored like any option).
    only=set(): no option is scored, base_loss is the context's loss. The model is left as it was given (every
    module swapped in is swapped back).
    """
    context = {name: DENSE for name in factors} if context is None else context
    only = set(factors) if only is None else only
    m, dtype = model, next(model.parameters()).dtype
    saved: dict[str, nn.Module] = {}
    delta: dict[str, dict[int | None, float]] = {}
    try:
        for name, rank in context.items():
            if rank is not DENSE:
                saved[name] = _set(m, name, factors[name].module(rank, dtype))
        dense_modules = {name: saved.get(name, m.get_submodule(name)) for name in factors}
        with torch.no_grad():
            hidden, kwargs = capture_layer0_inputs(m, ids, ids.shape[0])
            loss_from = LossFrom(m, ids, kwargs)
            base = None
            layers = m.model.layers
            if not only:
                return Scores(loss_from.head_loss(_run(layers, hidden, kwargs)), loss_from.tokens, {}, dict(context))
            todo = sum(len(factors[name].options) - 1 for name in only)
            bar = tqdm(total=todo, desc=desc, unit="option")
            for i, layer in enumerate(layers):
                if not any(name.startswith(f"model.layers.{i}.") for name in only):
                    hidden = run_layer(layer, hidden, kwargs)
                    continue
                residual, normed = mlp_inputs(layer, hidden, kwargs, ids.shape[0])
                if base is None:
                    base = loss_from(i, residual, normed)
                for kind in KINDS:
                    name = f"model.layers.{i}.mlp.{kind}_proj"
                    if name not in only:
                        continue
                    f, ref = factors[name], context[name]
                    delta[name] = {ref: 0.0}
                    for rank in f.options:
                        if rank == ref:
                            continue
                        module = dense_modules[name] if rank is DENSE else f.module(rank, dtype)
                        current = _set(m, name, module)
                        try:
                            delta[name][rank] = loss_from(i, residual, normed) - base
                        finally:
                            _set(m, name, current)
                        bar.update(1)
                hidden = residual + layer.mlp(normed)
            bar.close()
    finally:
        for name, module in saved.items():
            _set(m, name, module)
    return Scores(float(base), loss_from.tokens, delta, dict(context))


def mlp_shapes(model: nn.Module) -> list[Spectrum]:
    """Every MLP matrix of the model as a shape-only Spectrum (no singular values), in layer order."""
    return [Spectrum(name, mod.in_features, mod.out_features, np.zeros(0)) for name, mod in model.named_modules()
            if name.rsplit(".", 1)[-1] in MLP]


def _counts(ranks: dict[str, int | None]) -> dict[str, dict[str, int]]:
    """{kind: {"dense" or rank: how many matrices}} for a manifest-sized summary of an allocation."""
    out: dict[str, dict[str, int]] = {}
    for name, rank in ranks.items():
        row = out.setdefault(name.rsplit(".", 1)[-1], {})
        key = "dense" if rank is DENSE else str(rank)
        row[key] = row.get(key, 0) + 1
    order = lambda item: (item[0] == "dense", int(item[0]) if item[0] != "dense" else 0)  # noqa: E731
    return {kind: dict(sorted(row.items(), key=order)) for kind, row in out.items()}


def _no_cache(_name: str, make: Callable[[], dict]) -> dict:
    return make()


def allocate_measured(model: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int, ids: torch.Tensor,
                      keep_ratio: float, rank_multiple: int, *, whitened: bool = True,
                      dtype: torch.dtype = torch.bfloat16, rounds: int = 0,
                      cached: Callable[[str, Callable[[], dict]], dict] = _no_cache) -> dict:
    """Ranks for the whole-MLP budget chosen by the exact knapsack (allocate_exact) on MEASURED loss rises.

    hidden/kwargs: the calibration hidden states entering layer 0 (they give the whitening statistics); ids: the
    scoring windows. Round 0 scores each option of each matrix alone in the dense model; round k >= 1 re-scores every
    option with all other matrices at round k-1's ranks and solves again (stops early when nothing changes). Each
    round's allocation has its loss on the scoring windows measured (the next round's context loss, or one more
    pass for the last), and the round with the lowest measured loss wins (with rounds=0 the one allocation is not
    measured). cached(name, make) lets the caller keep
    each step's JSON result (names: "round0", "round1", ..., "loss<k>"); the factors are computed only when a step
    is not cached.

    Returns allocate_exact's dict for the chosen round plus "rounds" (per round: context loss, predicted loss,
    measured loss, changes, counts), "chosen_round", "dense_loss", "tokens" and "deltas" (round 0's table).
    """
    shapes = mlp_shapes(model)
    state: dict = {}

    def factors() -> dict[str, Factors]:
        if "factors" not in state:
            state["factors"] = mlp_factors(model, hidden, kwargs, batch_size, rank_multiple, whitened)
            state["model"] = scoring_model(model, dtype)
        return state["factors"]

    history: list[dict] = []
    results: list[dict] = []
    context: dict[str, int | None] | None = None
    for k in range(rounds + 1):
        def score(ctx=context, k=k) -> dict:
            fac = factors()
            return measure(state["model"], ids, fac, ctx, desc=f"measured (round {k}: loss per option)").to_json()

        scores = Scores.from_json(cached(f"round{k}", score))
        if k:
            history[-1]["measured_loss"] = scores.base_loss
        result = allocate_exact(shapes, keep_ratio, rank_multiple, scores=scores.delta)
        changed = len(shapes) if context is None else sum(result["ranks"][n] != context[n] for n in context)
        history.append({"context": "dense" if context is None else f"round {k - 1} allocation",
                        "context_loss": scores.base_loss,
                        "predicted_loss": scores.base_loss + result["total_loss"], "changed": changed,
                        "mlp_params_used": result["used"], "counts": _counts(result["ranks"])})
        results.append({**result, "scores": scores})
        if context is not None and changed == 0:
            history[-1]["measured_loss"] = scores.base_loss  # the same allocation as the context
            break
        context = result["ranks"]
    if "measured_loss" not in history[-1] and len(history) > 1:  # one candidate alone needs no comparison
        last = len(history) - 1

        def final_loss(ranks=context) -> dict:
            fac = factors()
            return {"loss": allocation_loss(state["model"], ids, fac, ranks)}

        history[-1]["measured_loss"] = cached(f"loss{last}", final_loss)["loss"]
    best = min(range(len(history)), key=lambda j: history[j].get("measured_loss", 0.0))
    first = results[0]["scores"]
    chosen = {key: val for key, val in results[best].items() if key != "scores"}
    return {**chosen, "rounds": history, "chosen_round": best, "dense_loss": first.base_loss,
            "tokens": first.tokens, "deltas": first.delta}
