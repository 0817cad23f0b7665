"""Measured allocation: loss rises of single truncations on held-out windows, fed to the exact knapsack."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from compression.allocation import Spectrum, allocate_exact, budget_for, params_used, rank_options
from compression.measured import (LossFrom, allocation_loss, measure, mlp_factors, mlp_shapes, scoring_model)
from compression.statistics import capture_layer0_inputs, mlp_inputs
from compression.whiten import damped_cholesky, whitened_factors
from server.models.lowrank import LowRankLinear


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 1000, (4, 32), generator=g)
    ids = torch.randint(0, 1000, (3, 24), generator=g)  # the scoring windows: not the calibration's
    with torch.no_grad():
        hidden, kwargs = capture_layer0_inputs(model, calib, 2)
    return model, calib, hidden, kwargs, ids


def _full_loss(model, ids) -> float:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def test_loss_resumed_at_any_layer_equals_the_full_forward(tiny):
    model, _, _, _, ids = tiny
    want = _full_loss(model, ids)
    with torch.no_grad():
        hidden, kwargs = capture_layer0_inputs(model, ids, ids.shape[0])
        loss_from = LossFrom(model, ids, kwargs)
        for i, layer in enumerate(model.model.layers):
            residual, normed = mlp_inputs(layer, hidden, kwargs, ids.shape[0])
            assert loss_from(i, residual, normed) == pytest.approx(want, abs=1e-5)
            hidden = residual + layer.mlp(normed)
    assert loss_from.tokens == ids.shape[0] * (ids.shape[1] - 1)


def _dense_grams(model, calib):
    """XᵀX of every MLP linear's input on the dense model, straight from forward hooks (the reference)."""
    grams, hooks = {}, []
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj"):
            def hook(_m, args, name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                grams[name] = grams.get(name, 0) + x.T @ x
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for start in range(0, calib.shape[0], 2):
            model(input_ids=calib[start:start + 2])
    for h in hooks:
        h.remove()
    return grams


def test_factors_are_compress_whitened_svd_sliced_to_every_option(tiny):
    model, calib, hidden, kwargs, _ = tiny
    factors = mlp_factors(model, hidden, kwargs, 2, 8)
    grams = _dense_grams(model, calib)
    assert set(factors) == set(grams) and len(factors) == 3 * model.config.num_hidden_layers
    for name, f in factors.items():
        W = model.get_submodule(name).weight.detach()
        L = damped_cholesky(grams[name])[0]
        assert f.options == rank_options(Spectrum(name, f.in_features, f.out_features, np.zeros(0)), 8)
        for rank in f.options[:-1]:
            A, B = whitened_factors(W, L, rank)
            low = f.module(rank, torch.float32)
            torch.testing.assert_close(low.B @ low.A, (B @ A).float(), atol=1e-4, rtol=1e-4)


def test_dense_option_is_zero_and_each_delta_is_that_one_truncation_on_the_windows(tiny):
    model, _, hidden, kwargs, ids = tiny
    factors = mlp_factors(model, hidden, kwargs, 2, 8)
    scores = measure(model, ids, factors)
    dense = _full_loss(model, ids)
    assert scores.base_loss == pytest.approx(dense, abs=1e-5) and scores.tokens == ids.numel() - ids.shape[0]
    assert set(scores.delta) == set(factors)
    for name, row in scores.delta.items():
        assert row[None] == 0.0 and set(row) == set(factors[name].options)
    # spot-check options against a model with only that matrix swapped, run end to end on the same windows
    for name, rank in (("model.layers.0.mlp.gate_proj", 8), ("model.layers.1.mlp.down_proj", 24),
                       ("model.layers.0.mlp.up_proj", 40)):
        other = copy.deepcopy(model)
        parent, child = name.rsplit(".", 1)
        setattr(other.get_submodule(parent), child, factors[name].module(rank, torch.float32))
        assert scores.delta[name][rank] == pytest.approx(_full_loss(other, ids) - dense, abs=2e-5)
    assert not any(isinstance(m, LowRankLinear) for m in model.modules())  # the model is given back dense
    # other windows, other scores: the delta is a property of the stated windows
    again = measure(model, ids[:1], factors, only={"model.layers.0.mlp.gate_proj"})
    assert again.base_loss == pytest.approx(_full_loss(model, ids[:1]), abs=1e-5)
    assert set(again.delta) == {"model.layers.0.mlp.gate_proj"}


def test_context_scores_are_relative_to_the_context_ranks(tiny):
    model, _, hidden, kwargs, ids = tiny
    factors = mlp_factors(model, hidden, kwargs, 2, 8)
    context = {name: f.options[1] for name, f in factors.items()}
    context["model.layers.1.mlp.up_proj"] = None
    scores = measure(model, ids, factors, context)
    assert scores.base_loss == pytest.approx(allocation_loss(model, ids, factors, context), abs=1e-6)
    other = copy.deepcopy(model)
    for name, rank in context.items():
        if rank is not None:
            parent, child = name.rsplit(".", 1)
            setattr(other.get_submodule(parent), child, factors[name].module(rank, torch.float32))
    assert scores.base_loss == pytest.approx(_full_loss(other, ids), abs=1e-5)
    for name, row in scores.delta.items():
        assert row[context[name]] == 0.0 and set(row) == set(factors[name].options)
    # dense is an option like any other once the context truncates the matrix
    name = "model.layers.0.mlp.gate_proj"
    parent, child = name.rsplit(".", 1)
    setattr(other.get_submodule(parent), child, model.get_submodule(name))
    assert scores.delta[name][None] == pytest.approx(_full_loss(other, ids) - scores.base_loss, abs=2e-5)


def test_bfloat16_scoring_leaves_the_float32_model_alone(tiny):
    model, _, hidden, kwargs, ids = tiny
    factors = mlp_factors(model, hidden, kwargs, 2, 8)
    half = scoring_model(model, torch.bfloat16)
    assert scoring_model(model, torch.float32) is model
    scores = measure(half, ids, factors, only={"model.layers.1.mlp.gate_proj"})
    assert next(model.parameters()).dtype == torch.float32
    assert scores.base_loss == pytest.approx(_full_loss(model, ids), abs=0.05)


def _random_scores(shapes, m, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for s in shapes:
        opts = rank_options(s, m)
        low = sorted(rng.uniform(-0.001, 0.2, len(opts) - 1), reverse=True)  # mostly larger at lower rank
        out[s.name] = {**dict(zip(opts[:-1], low)), None: 0.0}
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("keep,m", [(0.5, 8), (0.7, 8), (0.8, 16)])
def test_knapsack_on_measured_scores_is_optimal_and_within_budget(seed, keep, m):
    shapes = [Spectrum(f"m{i}", *((64, 128) if i % 3 < 2 else (128, 64)), np.zeros(0)) for i in range(4)]
    scores = _random_scores(shapes, m, seed)
    res = allocate_exact(shapes, keep, m, scores=scores)
    assert res["used"] == params_used(shapes, res["ranks"]) <= res["budget"] == budget_for(shapes, keep)
    best = min(sum(scores[s.name][r] for s, r in zip(shapes, combo))
               for combo in itertools.product(*(rank_options(s, m) for s in shapes))
               if params_used(shapes, {s.name: r for s, r in zip(shapes, combo)}) <= res["budget"])
    assert res["total_loss"] == pytest.approx(best, abs=1e-12)


def test_knapsack_needs_a_score_for_every_option():
    shapes = [Spectrum("a", 64, 128, np.zeros(0))]
    with pytest.raises(ValueError, match="no score for a at dense"):
        allocate_exact(shapes, 0.5, 8, scores={"a": {8: 0.1, 16: 0.05, 24: 0.0, 32: 0.0, 40: 0.0}})


def test_measured_allocation_at_smol_shapes_never_exceeds_the_budget():
    shapes = [Spectrum(f"model.layers.{i // 3}.mlp.{k}_proj", *((576, 1536) if k != "down" else (1536, 576)),
                       np.zeros(0)) for i, k in zip(range(90), itertools.cycle(("gate", "up", "down")))]
    for seed in range(3):
        scores = _random_scores(shapes, 128, seed)
        for keep in (0.6, 0.8, 0.9):
            res = allocate_exact(shapes, keep, 128, scores=scores)
            assert res["exact"] and res["used"] == params_used(shapes, res["ranks"]) <= res["budget"]


def _tiny_config(tmp_path, tiny_model_dir):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    return cfg


def test_cli_measured_allocation_writes_a_loadable_artifact_and_records_it(tmp_path, tiny_model_dir):
    from transformers import LlamaForCausalLM

    from compression.calibration import calibration_windows
    from compression.evaluation.corpora import C4_EVAL_DOCUMENTS
    from server.cli import main
    from server.config import data_path
    from server.models.compressed import apply_artifact_to_hf

    out, cache = tmp_path / "art", tmp_path / "cache.json"
    argv = ["compress", "--config", str(_tiny_config(tmp_path, tiny_model_dir)), "--keep-ratio", "0.6",
            "--rank-multiple", "8", "--allocation", "measured", "--calib-samples", "4", "--calib-seqlen", "32",
            "--score-windows", "2", "--score-seqlen", "32", "--measured-rounds", "1", "--num-threads", "1",
            "--sensitivity-cache", str(cache), "--out", str(out)]
    assert main(argv) == 0
    man = json.loads((out / "manifest.json").read_text())
    alloc, mods = man["allocation"], man["modules"]
    assert alloc["method"] == man["settings"]["allocation"] == "measured" and alloc["exact"]
    used = sum(m["in"] * m["out"] if m.get("dense") else m["rank"] * (m["in"] + m["out"]) for m in mods.values())
    assert used == alloc["mlp_params_used"] <= alloc["mlp_budget"]
    # --measured-rounds 1: round 0 in the dense context, round 1 in round 0's allocation (kept even if unchanged)
    assert [r["context"] for r in alloc["rounds"]] == ["dense", "round 0 allocation"]
    assert alloc["rounds"][alloc["chosen_round"]]["measured_loss"] == min(r["measured_loss"] for r in alloc["rounds"])
    assert alloc["scoring"]["tokens"] == 2 * 31 and alloc["dense_loss"] > 0
    assert all(row["dense"] == 0.0 for row in alloc["deltas"].values()) and len(alloc["deltas"]) == len(mods)
    # held out: no calibration document, nothing of the C4 evaluation split
    calib_ids = set(man["calibration"]["document_ids"])
    score_ids = alloc["scoring"]["document_ids"]
    assert score_ids and not calib_ids & set(score_ids) and min(score_ids) >= C4_EVAL_DOCUMENTS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = data_path(man["settings"]["calib_data"], "calib_data")
    held = calibration_windows(path, tok, 2, 32, man["seed"], exclude=calib_ids | set(range(C4_EVAL_DOCUMENTS)))
    assert held.document_ids == score_ids
    # loadable: the factors swap into the model
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    apply_artifact_to_hf(model, out, tiny_model_dir)
    low = {n for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    assert low == {n for n, m in mods.items() if not m.get("dense")}
    assert np.isfinite(_full_loss(model, held.windows))


def test_measured_steps_come_from_the_cache_and_a_changed_setting_recomputes(tmp_path, tiny_model_dir, monkeypatch):
    import compression.measured as cm
    from compression.compress import CompressSettings, compress_model

    s = CompressSettings(keep_ratio=0.6, rank_multiple=8, calib_samples=4, calib_seqlen=32, batch_size=2,
                         allocation="measured", score_windows=2, score_seqlen=32, measured_rounds=1)
    cache = tmp_path / "cache.json"
    first = compress_model(tiny_model_dir, s, tmp_path / "a", model_id="tiny", sensitivity_cache=cache)
    steps = [e["key"]["step"] for e in json.loads(cache.read_text())["measured"]]
    assert steps[0] == "round0" and len(steps) == len(first.allocation["rounds"]) + \
        (0 if first.allocation["rounds"][-1]["changed"] == 0 else 1)

    def no_factors(*_a, **_k):
        raise AssertionError("the cached measured steps should have been used")

    monkeypatch.setattr(cm, "mlp_factors", no_factors)
    again = compress_model(tiny_model_dir, s, tmp_path / "b", model_id="tiny", sensitivity_cache=cache)
    assert {m: r.rank for m, r in again.modules.items()} == {m: r.rank for m, r in first.modules.items()}
    assert again.allocation["rounds"] == first.allocation["rounds"]
    for change in ({"score_windows": 1}, {"rank_multiple": 16}, {"seed": 1}):
        with pytest.raises(AssertionError, match="cached measured"):
            compress_model(tiny_model_dir, s.model_copy(update=change), tmp_path / "c", model_id="tiny",
                           sensitivity_cache=cache)
    # another keep ratio reuses round 0 (single-matrix scores do not depend on the budget) but not round 1
    seen = []
    monkeypatch.setattr(cm, "mlp_factors", lambda *a, **k: seen.append(1) or mlp_factors(*a, **k))
    compress_model(tiny_model_dir, s.model_copy(update={"keep_ratio": 0.7}), tmp_path / "d", model_id="tiny",
                   sensitivity_cache=cache)
    assert seen == [1]
    entries = json.loads(cache.read_text())["measured"]
    assert sum(e["key"]["step"] == "round0" for e in entries) == 1


def test_sensitivity_cache_keeps_spectra_and_measured_entries_side_by_side(tmp_path, tiny_model_dir):
    from compression.compress import CompressSettings, compress_model

    cache = tmp_path / "cache.json"
    base = dict(keep_ratio=0.6, rank_multiple=8, calib_samples=4, calib_seqlen=32, batch_size=2, fisher_windows=2)
    compress_model(tiny_model_dir, CompressSettings(**base, allocation="measured", score_windows=1, score_seqlen=32,
                                                    measured_rounds=0), tmp_path / "a", "tiny",
                   sensitivity_cache=cache)
    compress_model(tiny_model_dir, CompressSettings(**base, allocation="exact"), tmp_path / "b", "tiny",
                   sensitivity_cache=cache)
    data = json.loads(cache.read_text())
    assert data["spectra"] and data["measured"] and data["key"]["calib_seqlen"] == 32


def test_mlp_shapes_lists_every_mlp_matrix_in_layer_order(tiny):
    model = tiny[0]
    shapes = mlp_shapes(model)
    assert [s.name for s in shapes] == [f"model.layers.{i}.mlp.{k}_proj" for i in range(2)
                                        for k in ("gate", "up", "down")]
    assert (shapes[2].in_features, shapes[2].out_features) == (128, 64)
