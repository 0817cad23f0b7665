"""What recovery trains: LoRA on the two factors of a LowRankLinear (A ← A + s·Pa·Qa, B ← B + s·Pb·Qb, the
paper's U, V updates; train=lora) or the factors A, B themselves (train=factors). A structurally pruned
artifact's narrower Linears are trained the same way: LoRA on the weight (W ← W + s·P·Q) or the weight itself.

Our own ~40-line adapter instead of peft: peft wraps nn.Linear (and a fixed list of layer types),
while LowRankLinear holds two raw factor tensors used by two F.linear calls; adapting each factor
directly keeps the merge exact (A' = A + s·Pa·Qa has A's shape) and adds no wrapper/unwrap step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from server.models.compressed import linear_with
from server.models.lowrank import LowRankLinear


class FactorLoRA(nn.Module):
    """A trainable low-rank update P·Q (P [rows, r] zero-initialised, Q [r, cols]) of a frozen factor."""

    def __init__(self, rows: int, cols: int, adapter_rank: int, scale: float, generator: torch.Generator):
        super().__init__()
        bound = 1.0 / math.sqrt(cols)  # kaiming-uniform-like range, as LoRA initialises its down matrix
        q = (torch.rand(adapter_rank, cols, generator=generator) * 2 - 1) * bound
        self.P = nn.Parameter(torch.zeros(rows, adapter_rank))
        self.Q = nn.Parameter(q)
        self.scale = scale

    def delta(self) -> torch.Tensor:
        """The update s·P·Q [rows, cols]."""
        return self.scale * (self.P @ self.Q)


class AdaptedLowRank(nn.Module):
    """A LowRankLinear whose factors A [rank, in] and B [out, rank] each carry a FactorLoRA."""

    def __init__(self, base: LowRankLinear, adapter_rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        scale = alpha / adapter_rank
        self.lora_A = FactorLoRA(base.A.shape[0], base.A.shape[1], adapter_rank, scale, generator)
        self.lora_B = FactorLoRA(base.B.shape[0], base.B.shape[1], adapter_rank, scale, generator)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapted (A, B), differentiable w.r.t. the adapters."""
        dtype = self.base.A.dtype
        return (self.base.A + self.lora_A.delta().to(dtype), self.base.B + self.lora_B.delta().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        A, B = self.factors()
        return F.linear(F.linear(x, A), B, self.base.bias)

    def merged(self) -> LowRankLinear:
        """A plain LowRankLinear with the adapters folded in (same shapes as the base)."""
        with torch.no_grad():
            A, B = self.factors()
            bias = None if self.base.bias is None else self.base.bias.detach().clone()
            return LowRankLinear(A.detach().clone(), B.detach().clone(), bias)


class AdaptedLinear(nn.Module):
    """A (pruned) Linear whose weight W [out, in] carries a FactorLoRA: y = x (W + s·P·Q)ᵀ + b."""

    def __init__(self, base: nn.Linear, adapter_rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.lora = FactorLoRA(base.out_features, base.in_features, adapter_rank, alpha / adapter_rank, generator)

    def weight(self) -> torch.Tensor:
        """The adapted weight, differentiable w.r.t. the adapter."""
        return self.base.weight + self.lora.delta().to(self.base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.base.bias)

    def merged(self) -> nn.Linear:
        """A plain Linear with the adapter folded in (the base's shape, frozen)."""
        with torch.no_grad():
            return linear_with(self.weight(), self.base.bias)


Trainable = LowRankLinear | nn.Linear


def _targets(model: nn.Module, names: list[str] | None) -> list[tuple[str, Trainable]]:
    """Freeze `model`; the modules recovery trains by name: `names` (an artifact's replaced modules: LowRankLinear
    or pruned Linear), or every LowRankLinear when None. ValueError when there are none."""
    for p in model.parameters():
        p.requires_grad_(False)
    if names is None:
        targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, LowRankLinear)]
    else:
        targets = [(name, model.get_submodule(name)) for name in names]
        wrong = [name for name, mod in targets if not isinstance(mod, (LowRankLinear, nn.Linear))]
        if wrong:
            raise ValueError(f"cannot recover {wrong[0]}: neither LowRankLinear nor Linear")
    if not targets:
        raise ValueError("model has no low-rank or pruned modules to recover")
    return targets


def attach_adapters(model: nn.Module, adapter_rank: int, alpha: float, seed: int,
                    names: list[str] | None = None) -> dict[str, AdaptedLowRank | AdaptedLinear]:
    """Freeze `model` and wrap every target (see _targets) in its adapter (seeded init); returns them by name."""
    generator = torch.Generator().manual_seed(seed)
    adapted = {}
    for name, mod in _targets(model, names):
        kind = AdaptedLowRank if isinstance(mod, LowRankLinear) else AdaptedLinear
        device = next(mod.parameters()).device
        wrapper = kind(mod, adapter_rank, alpha, generator).to(device)
        _set_module(model, name, wrapper)
        adapted[name] = wrapper
    return adapted


def unfreeze_factors(model: nn.Module, names: list[str] | None = None) -> dict[str, Trainable]:
    """Freeze `model` except the targets' tensors: A and B of a LowRankLinear, the weight of a pruned Linear
    (train=factors); returns those modules by name."""
    targets = _targets(model, names)
    for _, mod in targets:
        for tensor in (mod.A, mod.B) if isinstance(mod, LowRankLinear) else (mod.weight,):
            tensor.requires_grad_(True)
    return dict(targets)


def prepare_training(model: nn.Module, train: str, adapter_rank: int, alpha: float, seed: int,
                     names: list[str] | None = None) -> None:
    """Make what recovery trains trainable: LoRA adapters (`lora`) or the tensors themselves (`factors`), on
    `names` (default: every LowRankLinear)."""
    if train == "lora":
        attach_adapters(model, adapter_rank, alpha, seed, names)
    elif train == "factors":
        unfreeze_factors(model, names)
    else:
        raise ValueError(f"unknown recovery train target {train!r}")


def merge_adapters(model: nn.Module) -> dict[str, Trainable]:
    """Replace every adapter wrapper by its merged module and freeze trained tensors; returns merged by name.

    With train=factors there is nothing to merge (the dict is empty): the trained tensors already hold the result.
    """
    merged = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, (AdaptedLowRank, AdaptedLinear)):
            merged[name] = mod.merged()
            _set_module(model, name, merged[name])
    for p in model.parameters():
        p.requires_grad_(False)
    return merged


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable recovery parameters (adapters, or the factors with train=factors), in module-name order."""
    return [p for p in model.parameters() if p.requires_grad]


def _set_module(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
