"""Sensitivity pre-pass: whitened spectra of every MLP matrix from one calibration pass over the dense model."""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch
from torch import nn
from tqdm import tqdm

from compression.allocation import Spectrum
from compression.statistics import MLP, dense_mlp_grams, single_threaded_lapack
from compression.whiten import damped_cholesky


def output_fisher(model: nn.Module, windows: torch.Tensor) -> dict[str, float]:
    """{module name: mean over tokens of ‖∂L/∂y_t‖² / out_features} for every MLP linear of the dense model.

    L is a window's summed next-token loss and y_t the module's output at token t (so the gradient carries y_t's
    effect on every later token's loss too). With an isotropic Fisher this is the model loss
    added per unit of squared output error (up to a factor shared by all modules), the weight that makes whitened
    truncation losses of different matrices comparable. One window at a time: only input gradients flow (the
    weights are frozen), so memory is one window's activations.
    """
    sums: dict[str, float] = {}
    hooks = []

    def capture(name: str, out_features: int):
        def accumulate(grad: torch.Tensor) -> None:
            sums[name] = sums.get(name, 0.0) + float(grad.double().pow(2).sum()) / out_features

        def on_output(_module, _inputs, output):
            output.register_hook(accumulate)
        return on_output

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in MLP:
            hooks.append(module.register_forward_hook(capture(name, module.out_features)))
    requires = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    tokens = 0
    try:
        for ids in tqdm(windows, desc="sensitivity (output Fisher)", unit="window"):
            ids = ids.unsqueeze(0)
            with torch.enable_grad():  # callers may hold no_grad; this pass needs the backward
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
                logits = model(inputs_embeds=embeds).logits[0, :-1].float()
                torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").backward()
            tokens += ids.shape[1] - 1
    finally:
        for h in hooks:
            h.remove()
        for p, r in zip(model.parameters(), requires):
            p.requires_grad_(r)
    return {name: total / tokens for name, total in sums.items()}


def plain_output_sigma(weight: torch.Tensor, xtx: torch.Tensor) -> np.ndarray:
    """σᵢ(W)·‖X vᵢ‖ in W's singular order: their squared tail is the plain rank-r truncation's output error."""
    # Dropping σᵢuᵢvᵢᵀ adds σᵢ²·vᵢᵀXᵀXvᵢ to ‖X(W − W_r)ᵀ‖² (the uᵢ are orthonormal, so no cross terms): the unit
    # the Fisher weight prices and the normalised measure's relative output error, as the whitened σ(W·L) are.
    W = weight.detach().to(torch.float64).numpy()
    _, sigma, Vh = scipy.linalg.svd(W, full_matrices=False, lapack_driver="gesdd", check_finite=False)
    energy = np.einsum("ij,jk,ik->i", Vh, xtx.to(torch.float64).numpy(), Vh)
    return sigma * np.sqrt(np.maximum(energy, 0.0))


def _spectrum(name: str, linear: nn.Linear, L: torch.Tensor | None, weights: dict[str, float] | None,
              xtx: torch.Tensor) -> Spectrum:
    W = linear.weight.detach().to(torch.float64)
    with single_threaded_lapack():
        if L is not None:  # values only: far cheaper than the full SVD
            sigma = scipy.linalg.svdvals((W @ L).numpy(), check_finite=False)
        else:  # plain: σ(W) alone would be a weight error, not the output error the loss measures
            sigma = plain_output_sigma(W, xtx)
    out_f, in_f = linear.weight.shape
    return Spectrum(name, in_f, out_f, np.asarray(sigma), None if weights is None else weights[name])


def dense_mlp_spectra(model: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int,
                      whitened: bool = True, weights: dict[str, float] | None = None) -> list[Spectrum]:
    """Spectra of gate/up/down of every layer on the DENSE model's activations (float64 XᵀX, damped Cholesky).

    gate and up share one XᵀX (the normed MLP input); down's input is act(gate)·up. `weights` (e.g. from
    output_fisher) become each Spectrum's loss weight; without them the allocation normalises per matrix.
    """
    out: list[Spectrum] = []
    for i, layer, xtx, xtx_down in dense_mlp_grams(model, hidden, kwargs, batch_size, "sensitivity (dense spectra)"):
        mlp, prefix = layer.mlp, f"model.layers.{i}.mlp"
        L = damped_cholesky(xtx)[0] if whitened else None
        Ld = damped_cholesky(xtx_down)[0] if whitened else None
        out += [_spectrum(f"{prefix}.{kind}_proj", getattr(mlp, f"{kind}_proj"), Lk, weights, g)
                for kind, Lk, g in (("gate", L, xtx), ("up", L, xtx), ("down", Ld, xtx_down))]
    return out
