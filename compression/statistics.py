"""Calibration passes through one decoder layer: capture its inputs, float64 XᵀX of Linear inputs."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from scipy.linalg import blas
from torch import nn
from threadpoolctl import threadpool_limits
from tqdm import tqdm

MLP = ("gate_proj", "up_proj", "down_proj")  # the Llama MLP's linears, by attribute name


@contextlib.contextmanager
def single_threaded_lapack():
    """OpenBLAS (SciPy's and NumPy's) on one thread inside the block.

    A LAPACK SVD is a long chain of small steps with a thread barrier after each: on a shared 2-core machine
    under load, two threads made a 1536x576 gesdd 10-25x slower than one (0.9-1.1 s vs 12-24 s, measured beside
    other jobs); one thread costs at most the second core's share when the machine is idle.
    """
    with threadpool_limits(limits=1, user_api="blas"):
        yield


class _Stop(Exception):
    """Raised from a hook to end a forward pass once the wanted input is captured."""


def gram(x: torch.Tensor) -> torch.Tensor:
    """XᵀX in float64 over all leading dims of x [..., features]."""
    flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64).numpy()
    # BLAS syrk computes one triangle only: half the flops of flat.T @ flat, the bulk of compression time.
    # flat.T of a C-ordered array is Fortran-ordered, so SciPy passes it without a copy.
    return _symmetric(blas.dsyrk(1.0, flat.T, trans=0))


def gram_float32(x: torch.Tensor) -> torch.Tensor:
    """XᵀX from float32 products (ssyrk, twice dsyrk's speed), returned float64 so callers sum batches in float64.

    For statistics that rank or ridge-solve (structured pruning's channel orders and refit), where one batch's
    float32 rounding (~1e-6 relative) is far below the calibration noise; the SVD whitening's Cholesky keeps `gram`.
    """
    flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32).numpy()
    return _symmetric(blas.ssyrk(1.0, flat.T, trans=0).astype(np.float64))


def _symmetric(upper: np.ndarray) -> torch.Tensor:
    """The full symmetric matrix from the upper triangle BLAS syrk fills."""
    return torch.from_numpy(np.triu(upper) + np.triu(upper, 1).T)


def batched_gram(x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """gram(x) accumulated over batches of the leading dim (bounds the float64 copy to one batch)."""
    return sum(gram(x[start:start + batch_size]) for start in range(0, x.shape[0], batch_size))


def capture_layer0_inputs(model: nn.Module, windows: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, dict]:
    """(hidden states [num_samples, seqlen, hidden] entering layer 0, that layer's keyword arguments).

    The keyword arguments (rotary tables, mask) depend only on the batch shape, so one set serves every batch.
    """
    layer0 = model.model.layers[0]
    chunks: list[torch.Tensor] = []
    kwargs: dict = {}

    def hook(_module, args, kw):
        chunks.append((args[0] if args else kw["hidden_states"]).detach())
        if not kwargs:
            kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _Stop

    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for start in range(0, windows.shape[0], batch_size):
            try:
                model(input_ids=windows[start:start + batch_size], use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.cat(chunks), kwargs


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """One decoder layer's output for a batch (HF layers return a tensor or a tuple)."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def input_grams(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int,
                modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """XᵀX (float64) of each named module's input, accumulated over a full pass of the layer."""
    grams: dict[str, torch.Tensor] = {}

    def make_hook(name):
        def hook(_module, args):
            g = gram(args[0].detach())
            grams[name] = g if name not in grams else grams[name] + g
        return hook

    handles = [mod.register_forward_pre_hook(make_hook(name)) for name, mod in modules.items()]
    try:
        for start in range(0, hidden.shape[0], batch_size):
            run_layer(layer, hidden[start:start + batch_size], kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return grams


def mlp_inputs(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual after attention, normed MLP input), both [num_samples, seqlen, hidden]; the MLP itself is skipped."""
    residuals: list[torch.Tensor] = []
    normed: list[torch.Tensor] = []

    def grab_residual(_module, args):
        residuals.append(args[0].detach())

    def grab_mlp_input(_module, args):
        normed.append(args[0].detach())
        raise _Stop

    handles = [layer.post_attention_layernorm.register_forward_pre_hook(grab_residual),
               layer.mlp.register_forward_pre_hook(grab_mlp_input)]
    try:
        for start in range(0, hidden.shape[0], batch_size):
            try:
                run_layer(layer, hidden[start:start + batch_size], kwargs)
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(residuals), torch.cat(normed)


def cross_gram(a: torch.Tensor, b: torch.Tensor, batch_size: int) -> torch.Tensor:
    """aᵀb [features_a, features_b] in float64 over all leading dims, accumulated over batches of the leading dim.

    Each batch's product is float32 (half the time of float64 on CPU; a batch is a few thousand tokens) and the sum
    over batches float64.
    """
    total = None
    for start in range(0, a.shape[0], batch_size):
        x = a[start:start + batch_size].reshape(-1, a.shape[-1]).float()
        y = b[start:start + batch_size].reshape(-1, b.shape[-1]).float()
        part = (x.T @ y).to(torch.float64)
        total = part if total is None else total + part
    return total


def mlp_intermediate(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama MLP's down_proj input act(gate x)·(up x) for its normed input x."""
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def dense_mlp_grams(model: nn.Module, hidden: torch.Tensor, kwargs: dict, batch_size: int, desc: str,
                    down_gram=gram, input_gram: bool = True):
    """Yield (layer index, layer, gate/up input XᵀX, down input XᵀX) for every layer of the DENSE model, float64.

    hidden: the calibration hidden states entering layer 0 (capture_layer0_inputs). gate and up share one XᵀX (the
    normed MLP input); down's input is act(gate)·up, its XᵀX summed over batches of `down_gram` (gram_float32 for
    pruning), the gate/up one skipped (None) without input_gram. The next layer's input is the residual plus the MLP
    output computed here (no second pass through the layer). The layer is still dense when the caller receives it.
    """
    layers = model.model.layers
    with torch.no_grad():
        for i in tqdm(range(len(layers)), desc=desc, unit="layer"):
            layer = layers[i]
            mlp = layer.mlp
            residual, normed = mlp_inputs(layer, hidden, kwargs, batch_size)
            xtx = batched_gram(normed, batch_size) if input_gram else None
            xtx_down, outs = None, []
            for start in range(0, normed.shape[0], batch_size):
                x = normed[start:start + batch_size]
                m = mlp_intermediate(mlp, x)
                xtx_down = down_gram(m) if xtx_down is None else xtx_down + down_gram(m)
                outs.append(residual[start:start + batch_size] + mlp.down_proj(m))
            del residual, normed
            yield i, layer, xtx, xtx_down
            hidden = torch.cat(outs)
