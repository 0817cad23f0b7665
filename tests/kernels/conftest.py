"""Kernel-test helpers: seeded bf16 inputs and a bf16-aware comparison."""

from __future__ import annotations

import numpy as np
import pytest

from neuronmm_kernels.reference import BF16


@pytest.fixture
def make():
    """make(*shape) -> bf16 array with unit-scale matmul outputs (entries ~ N(0, 1/shape[0]) for weights)."""
    rng = np.random.default_rng(1234)

    def _make(*shape, scale=None):
        s = 1.0 / np.sqrt(shape[0]) if scale is None else scale
        return (rng.standard_normal(shape) * s).astype(BF16)

    return _make


def assert_bf16_close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to bf16 rounding.

    Tight: |got - want| <= 2**-7 * (|want| + rms(want)) for all but 0.1 % of elements (at least one
    may miss); loose (4x)
    for every element. Kernel and reference round the same intermediates to bf16 but accumulate
    in different orders, so an intermediate can land one bf16 ulp apart and carry that through
    (seen in randomised runs: 13 of 224000 elements, kernel and reference equally far from fp64).
    """
    assert got.shape == want.shape and got.dtype == BF16
    g, w = got.astype(np.float32), want.astype(np.float32)
    assert np.isfinite(g).all(), "NaN/inf in kernel output (unwritten or uninitialised data read)"
    tol = 2.0 ** -7 * (np.abs(w) + np.sqrt(np.mean(w * w)))
    err = np.abs(g - w)
    num_bad = int((err > tol).sum())
    assert num_bad <= max(1, 1e-3 * err.size), f"{num_bad} of {err.size} elements differ; max err {err.max():.3g}"
    assert (err <= 4 * tol).all(), f"max err {err.max():.3g} beyond 4x the bf16 tolerance"
