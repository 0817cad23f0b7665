"""Our low-rank MLP on the real NKI: CPU simulator (nki.simulate_kernel) and the device (nki.baremetal)."""

from __future__ import annotations

import numpy as np
import pytest

from neuronmm_kernels import reference as ref

# Llama-3.2-1B MLP at keep 0.8 (rank 1664) with tp 2 (intermediate 4096 per core), decode and prefill sizes.
HIDDEN, INTER, RANK = 2048, 4096, 1664


def _inputs(num_tokens, seed=0):
    rng = np.random.default_rng(seed)
    mk = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(ref.BF16)  # noqa: E731
    x = rng.standard_normal((num_tokens, HIDDEN)).astype(ref.BF16)
    return [x, mk(HIDDEN, RANK), mk(RANK, INTER), mk(HIDDEN, RANK), mk(RANK, INTER), mk(INTER, RANK), mk(RANK, HIDDEN)]


def _entry():
    """The nki_call adapter behind a top-level kernel that owns the output, as nki_call arranges."""
    import neuronxcc.nki as nki
    import neuronxcc.nki.language as nl

    from server.backends.neuron.kernel_adapter import lowrank_mlp_into

    @nki.jit
    def entry(x, gu, gv, uu, uv, du, dv):
        y = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        lowrank_mlp_into(x, gu, gv, uu, uv, du, dv, y)
        return y

    return entry


def _close(got, want):
    g, w = got.astype(np.float32), want.astype(np.float32)
    tol = 2.0 ** -6 * (np.abs(w) + np.sqrt(np.mean(w * w)))
    assert np.isfinite(g).all() and (np.abs(g - w) <= 4 * tol).all(), f"max err {np.abs(g - w).max():.3g}"


@pytest.mark.parametrize("num_tokens", [1, 8, 128])
def test_adapter_simulated_matches_reference(num_tokens):
    import neuronxcc.nki as nki

    args = _inputs(num_tokens)
    _close(nki.simulate_kernel(_entry(), *args), ref.lowrank_mlp(*args))


@pytest.mark.device
@pytest.mark.parametrize("num_tokens", [1, 128, 512])
def test_kernel_and_adapter_on_device(num_tokens):
    import neuronxcc.nki as nki

    from neuronmm_kernels.kernels.lowrank_mlp import lowrank_mlp

    args = _inputs(num_tokens, seed=1)
    want = ref.lowrank_mlp(*args)
    _close(nki.baremetal(lowrank_mlp)(*args), want)
    _close(nki.baremetal(_entry())(*args), want)
