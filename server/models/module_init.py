"""Modules built around weights assigned right after: no random init, no meta device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# The torch modules our models build; each initialises its parameters in reset_parameters().
_SELF_INITIALISING = (nn.Linear, nn.Embedding)


def _keep_uninitialised(self: nn.Module) -> None:
    """reset_parameters() inside no_init(): leave torch.empty parameters as they are."""


@contextmanager
def no_init() -> Iterator[None]:
    """Inside, nn.Linear and nn.Embedding skip their random init: their parameters stay torch.empty until assigned.

    Why not the meta device: the first op on a meta tensor imports torch._dynamo (~0.9 s of a server's start-up),
    and initialising the 134M parameters of the default model on the CPU only to overwrite them cost ~0.6 s.
    Not thread-safe: build models in one thread at a time.
    """
    saved = [(cls, cls.reset_parameters) for cls in _SELF_INITIALISING]
    for cls, _ in saved:
        cls.reset_parameters = _keep_uninitialised
    try:
        yield
    finally:
        for cls, reset in saved:
            cls.reset_parameters = reset


def linear_around(weight: torch.Tensor) -> nn.Linear:
    """A frozen bias-free Linear whose weight is `weight` itself [out, in] (not a copy), in its dtype and device."""
    out_features, in_features = weight.shape
    with no_init():
        linear = nn.Linear(in_features, out_features, bias=False, dtype=weight.dtype, device=weight.device)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
