"""Sensitivity pre-pass: whitened spectra of every MLP matrix from one calibration pass over the dense model."""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch
from torch import nn
from tqdm import tqdm

from compression.allocation import Spectrum
from compression.statistics import batched_gram, gram, mlp_inputs, run_layer
from compression.whiten import damped_cholesky


def _spectrum(name: str, linear: nn.Linear, L: torch.Tensor | None) -> Spectrum:
    W = linear.weight.detach().to(torch.float64)
    M = W @ L if L is not None else W
    sigma = scipy.linalg.svdvals(M.numpy(), check_finite=False)  # values only: far cheaper than the full SVD
    out_f, in_f = linear.weight.shape
    return Spectrum(name, in_f, out_f, np.asarray(sigma))


def dense_mlp_spectra(model: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int,
                      whitened: bool = True) -> list[Spectrum]:
    """Spectra of gate/up/down of every layer on the DENSE model's activations (float64 XᵀX, damped Cholesky).

    gate and up share one XᵀX (the normed MLP input); down's input is act(gate)·up.
    """
    out: list[Spectrum] = []
    layers = model.model.layers
    with torch.no_grad():
        for i in tqdm(range(len(layers)), desc="sensitivity (dense spectra)", unit="layer"):
            layer, prefix = layers[i], f"model.layers.{i}.mlp"
            mlp = layer.mlp
            _, normed = mlp_inputs(layer, hidden, kwargs, batch_size)
            xtx = batched_gram(normed, batch_size)
            xtx_down = sum(gram(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
                           for x in normed.split(batch_size))
            L = damped_cholesky(xtx)[0] if whitened else None
            Ld = damped_cholesky(xtx_down)[0] if whitened else None
            out += [_spectrum(f"{prefix}.gate_proj", mlp.gate_proj, L), _spectrum(f"{prefix}.up_proj", mlp.up_proj, L),
                    _spectrum(f"{prefix}.down_proj", mlp.down_proj, Ld)]
            hidden = torch.cat([run_layer(layer, hidden[s:s + batch_size], kwargs)
                                for s in range(0, hidden.shape[0], batch_size)])
    return out
