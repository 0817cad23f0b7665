"""Exact (multiple-choice knapsack) rank allocation: optimal against brute force, never over budget."""

from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest

from compression.allocation import (Spectrum, allocate, allocate_exact, budget_for, params_used, rank_options,
                                    truncation_loss)
from server.config import data_path


def _random_spectra(seed: int, count: int, shapes=((16, 48), (48, 16), (24, 40))) -> list[Spectrum]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        in_f, out_f = shapes[i % len(shapes)]
        sigma = np.sort(rng.gamma(0.5, size=min(in_f, out_f)))[::-1]
        out.append(Spectrum(f"m{i}", in_f, out_f, sigma, weight=float(rng.uniform(0.1, 10.0))))
    return out


def _loss(s: Spectrum, rank):
    return 0.0 if rank is None else float(truncation_loss(s)[rank])


def _brute_force(spectra, keep, m):
    budget = budget_for(spectra, keep)
    best = (np.inf, None)
    for combo in itertools.product(*(rank_options(s, m) for s in spectra)):
        ranks = {s.name: r for s, r in zip(spectra, combo)}
        if params_used(spectra, ranks) <= budget:
            total = sum(_loss(s, r) for s, r in zip(spectra, combo))
            best = min(best, (total, ranks), key=lambda t: t[0])
    return best


def test_options_are_saving_multiples_then_dense():
    s = Spectrum("x", 576, 1536, np.ones(576))
    assert rank_options(s, 128) == [128, 256, 384, None]  # 512·2112 > 576·1536: no rank 512
    assert rank_options(Spectrum("y", 16, 48, np.ones(16)), 4) == [4, 8, None]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("keep,m", [(0.5, 4), (0.7, 4), (0.8, 8)])
def test_exact_matches_brute_force_optimum(seed, keep, m):
    spectra = _random_spectra(seed, 5)
    want, _ = _brute_force(spectra, keep, m)
    res = allocate_exact(spectra, keep, m)
    got = sum(_loss(s, res["ranks"][s.name]) for s in spectra)
    assert res["exact"] and got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert res["total_loss"] == pytest.approx(got)
    assert res["used"] == params_used(spectra, res["ranks"]) <= res["budget"]


@pytest.mark.parametrize("seed", range(4))
def test_exact_never_worse_than_greedy_and_within_budget(seed):
    spectra = _random_spectra(seed, 30, shapes=((576, 1536), (576, 1536), (1536, 576)))
    for keep, m in ((0.8, 128), (0.8, 32), (0.6, 64)):
        greedy = allocate(spectra, keep, m)
        exact = allocate_exact(spectra, keep, m)
        assert exact["used"] <= exact["budget"]
        g = sum(_loss(s, greedy["ranks"][s.name]) for s in spectra)
        assert exact["total_loss"] <= g + 1e-9 * max(g, 1.0)


def test_coarsened_table_stays_within_budget():
    spectra = _random_spectra(3, 12, shapes=((576, 1536), (1536, 576)))
    exact = allocate_exact(spectra, 0.8, 1, max_cells=10**9)
    coarse = allocate_exact(spectra, 0.8, 1, max_cells=2_000_000)
    assert exact["exact"] and not coarse["exact"] and coarse["unit"] > exact["unit"]
    assert params_used(spectra, coarse["ranks"]) <= coarse["budget"]
    assert coarse["total_loss"] >= exact["total_loss"] - 1e-9


def test_dense_chosen_when_budget_allows_and_error_when_too_small():
    spectra = _random_spectra(1, 3)
    full = allocate_exact(spectra, 1.0, 4)
    assert all(r is None for r in full["ranks"].values()) and full["total_loss"] == 0.0
    with pytest.raises(ValueError, match="smallest option"):
        allocate_exact(spectra, 0.01, 4)


def test_sensitivity_cache_is_reused_and_gives_the_same_ranks(tiny_model_dir, tmp_path, monkeypatch):
    import compression.compress as cc
    from compression.compress import CompressSettings, compress_model

    # seed 2 draws C4 document 456 first: an evaluation document, left out, so the draw differs from the copy's below
    s = CompressSettings(keep_ratio=0.5, rank_multiple=8, calib_samples=4, calib_seqlen=32, batch_size=2,
                         fisher_windows=2, allocation="exact", seed=2)
    cache = tmp_path / "spectra.json"
    first = compress_model(tiny_model_dir, s, tmp_path / "a", model_id="tiny", sensitivity_cache=cache)
    assert cache.is_file() and first.allocation["total_loss"] <= first.allocation["greedy_total_loss"] + 1e-12

    def no_prepass(*_a, **_k):
        raise AssertionError("the cached pre-pass should have been used")

    monkeypatch.setattr(cc, "output_fisher", no_prepass)
    again = compress_model(tiny_model_dir, s, tmp_path / "b", model_id="tiny", sensitivity_cache=cache)
    assert {m: r.rank for m, r in again.modules.items()} == {m: r.rank for m, r in first.modules.items()}
    other = s.model_copy(update={"calib_seqlen": 16})  # another key: the cache is not used
    with pytest.raises(AssertionError, match="cached pre-pass"):
        compress_model(tiny_model_dir, other, tmp_path / "c", model_id="tiny", sensitivity_cache=cache)
    # the same bytes outside the data folder are not the C4 evaluation file: nothing is left out of the draw, so its
    # windows come from other documents, and the spectra of the first draw must not stand in for them
    copy = tmp_path / "c4-copy.jsonl"
    shutil.copyfile(data_path(s.calib_data, "calib_data"), copy)
    elsewhere = s.model_copy(update={"calib_data": str(copy)})
    with pytest.raises(AssertionError, match="cached pre-pass"):
        compress_model(tiny_model_dir, elsewhere, tmp_path / "d", model_id="tiny", sensitivity_cache=cache)
