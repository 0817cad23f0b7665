"""Least-squares refit of the B factors: lower error against the dense layer's outputs on held-out data."""

from __future__ import annotations

import pytest
import torch

from compression.calibration import calibration_windows
from compression.compress import CompressSettings, compress_model
from compression.refit import dense_output_rel_error, refit_b
from compression.whiten import damped_cholesky, whitened_factors
from server.config import data_path
from server.models.artifact import load_artifact
from server.models.compressed import apply_artifact_to_hf


def _acts(n, d, g):
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) * torch.logspace(0, -2, d, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ mix


def test_refit_lowers_dense_output_error_on_held_out_rows():
    g = torch.Generator().manual_seed(0)
    d, out, rank, n = 32, 24, 8, 4000
    W = torch.randn(out, d, generator=g, dtype=torch.float64)
    X_d = _acts(2 * n, d, g)
    # The compressed model's inputs: the dense ones plus a systematic (learnable) distortion and noise.
    distort = torch.eye(d, dtype=torch.float64) + 0.2 * torch.randn(d, d, generator=g, dtype=torch.float64)
    X_c = X_d @ distort + 0.01 * torch.randn(2 * n, d, generator=g, dtype=torch.float64)
    fit, held = slice(0, n), slice(n, 2 * n)
    xtx = X_c[fit].T @ X_c[fit]
    A, B0 = whitened_factors(W, damped_cholesky(xtx)[0], rank)
    B = refit_b(W, A, B0, xtx, X_d[fit].T @ X_c[fit], damp=1e-2)

    def held_err(Bk):
        return float(torch.linalg.norm(X_c[held] @ A.T @ Bk.T - X_d[held] @ W.T) / torch.linalg.norm(X_d[held] @ W.T))

    assert held_err(B) < 0.9 * held_err(B0)
    # The statistics-only error equals the direct one on the fitted rows.
    dense_sq = float((X_d[fit] @ W.T).pow(2).sum())
    direct = float(torch.linalg.norm(X_c[fit] @ A.T @ B.T - X_d[fit] @ W.T)) ** 2 / dense_sq
    assert dense_output_rel_error(W, A, B, xtx, X_d[fit].T @ X_c[fit], dense_sq) == pytest.approx(direct ** 0.5,
                                                                                                    rel=1e-6)


def test_huge_damping_returns_the_svd_factor():
    g = torch.Generator().manual_seed(1)
    W, X = torch.randn(12, 16, generator=g, dtype=torch.float64), _acts(500, 16, g)
    xtx = X.T @ X
    A, B0 = whitened_factors(W, damped_cholesky(xtx)[0], 4)
    assert torch.allclose(refit_b(W, A, B0, xtx, xtx * 1.1, damp=1e9), B0, atol=1e-6)


@pytest.fixture(scope="module")
def refit_pair(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("refit")
    common = dict(keep_ratio=0.5, rank_multiple=8, calib_samples=16, calib_seqlen=64, batch_size=4, fisher_windows=2,
                  allocation="exact")
    arts = {}
    for refit in (False, True):
        out = root / f"refit-{refit}"
        compress_model(tiny_model_dir, CompressSettings(refit=refit, **common), out, model_id="tiny")
        arts[refit] = out
    return arts


def _last_mlp_outputs(model, windows):
    got = []
    handle = model.model.layers[-1].mlp.register_forward_hook(lambda _m, _a, out: got.append(out.detach()))
    try:
        with torch.no_grad():
            model(input_ids=windows)
    finally:
        handle.remove()
    return got[0]


def test_refit_lowers_last_layer_error_against_dense_on_held_out_windows(refit_pair, tiny_model_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    man_off, _ = load_artifact(refit_pair[False])
    man_on, _ = load_artifact(refit_pair[True])
    assert man_off.refit == {"enabled": False} and man_on.refit["enabled"]
    assert man_on.allocation["method"] == "exact" and man_on.allocation["mlp_params_used"] <= \
        man_on.allocation["mlp_budget"]
    assert man_on.low_rank_modules() and {m: r.rank for m, r in man_on.modules.items()} == \
        {m: r.rank for m, r in man_off.modules.items()}
    errs = man_on.refit["dense_rel_error"]
    assert errs and all(after <= before + 1e-9 for before, after in errs.values())  # on the calibration data

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    held = calibration_windows(data_path(man_on.settings["calib_data"], "calib_data"), tok, 4, 64, seed=12345)
    assert not set(held.document_ids) & set(man_on.calibration.document_ids)  # held-out documents
    models = {}
    for name, art in (("dense", None), ("off", refit_pair[False]), ("on", refit_pair[True])):
        models[name] = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        if art is not None:
            apply_artifact_to_hf(models[name], art)
    ref = _last_mlp_outputs(models["dense"], held.windows)
    err = {k: float(torch.linalg.norm(_last_mlp_outputs(models[k], held.windows) - ref)) for k in ("off", "on")}
    assert err["on"] < err["off"], err
