"""Per-matrix rank allocation: budget maths on synthetic spectra, and sensitivity compress end to end (tiny model)."""

from __future__ import annotations

import numpy as np
import pytest

from compression.allocation import Spectrum, allocate, budget_for, normalised_tail, params_used, truncation_loss
from compression.compress import CompressSettings, compress_model
from compression.rank import block_rank, low_rank_params


def _spec(name, in_f, out_f, decay, n=None):
    n = n or min(in_f, out_f)
    return Spectrum(name, in_f, out_f, np.exp(-decay * np.arange(n)))


def _mix(seed=0, count=12):
    rng = np.random.default_rng(seed)
    shapes = [(576, 1536), (576, 1536), (1536, 576)]
    return [_spec(f"m{i}", *shapes[i % 3], decay=float(rng.uniform(0.0, 0.05))) for i in range(count)]


@pytest.mark.parametrize("keep,m", [(0.8, 32), (0.9, 32), (0.5, 64), (0.6, 128)])
def test_budget_met_within_one_step_and_never_exceeded(keep, m):
    spectra = _mix()
    res = allocate(spectra, keep, m)
    used = params_used(spectra, res["ranks"])
    assert used == res["used"] <= res["budget"] == budget_for(spectra, keep)
    open_steps = [m * (s.in_features + s.out_features) for s in spectra if res["ranks"][s.name] is not None]
    assert res["budget"] - used < max(open_steps, default=1)
    for r in res["ranks"].values():
        assert r is None or (r >= m and r % m == 0)


def test_flat_spectrum_gets_more_rank_than_fast_decay():
    spectra = [_spec("flat", 576, 1536, 0.0), _spec("steep", 576, 1536, 0.2)]
    ranks = allocate(spectra, 0.5, 32)["ranks"]
    assert ranks["flat"] > ranks["steep"]


def test_identical_spectra_reproduce_uniform_ranks():
    spectra = [_spec(f"m{i}", 576, 1536, 0.01) for i in range(6)]
    ranks = allocate(spectra, 0.8, 32)["ranks"]
    uniform = block_rank(576, 1536, 0.8, 32)
    assert all(abs(r - uniform) <= 32 for r in ranks.values())


def test_matrix_goes_dense_when_its_rank_stops_paying():
    # one nearly incompressible matrix and one trivially compressible: the flat one should end dense at high keep
    spectra = [_spec("flat", 256, 256, 0.0), _spec("steep", 256, 256, 1.0)]
    res = allocate(spectra, 0.95, 16)
    assert res["ranks"]["flat"] is None and res["ranks"]["steep"] is not None
    assert res["used"] <= res["budget"]


def test_budget_too_small_raises():
    with pytest.raises(ValueError, match="keep_ratio"):
        allocate([_spec("a", 576, 1536, 0.01)], 0.01, 128)


def test_normalised_tail_is_relative_error_squared():
    t = normalised_tail(np.array([3.0, 2.0, 1.0]))
    assert t[0] == pytest.approx(1.0) and t[1] == pytest.approx(5 / 14) and t[3] == 0.0


def test_weighted_loss_is_weight_times_absolute_tail_and_steers_rank():
    sigma = np.array([3.0, 2.0, 1.0])
    assert truncation_loss(Spectrum("w", 8, 8, sigma, weight=2.0)).tolist() == [28.0, 10.0, 2.0, 0.0]
    assert truncation_loss(Spectrum("n", 8, 8, sigma)) == pytest.approx(normalised_tail(sigma))
    # two identical matrices: the one whose errors cost the model more loss gets the larger rank
    same = [_spec("a", 576, 1536, 0.01), _spec("b", 576, 1536, 0.01)]
    even = allocate(same, 0.3, 32)["ranks"]
    assert abs(even["a"] - even["b"]) <= 32
    same[1].weight, same[0].weight = 10.0, 1.0
    ranks = allocate(same, 0.3, 32)["ranks"]
    assert ranks["b"] > ranks["a"]


def test_output_fisher_matches_autograd_on_the_module_outputs(tiny_model_dir):
    import torch
    from transformers import LlamaForCausalLM

    from compression.sensitivity import output_fisher

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    weights = output_fisher(model, ids)
    assert len(weights) == 3 * model.config.num_hidden_layers and all(w > 0 for w in weights.values())
    assert all(p.requires_grad for p in model.parameters())  # restored
    assert not any(m._forward_hooks for m in model.modules())  # hooks removed
    # reference: keep one module's output, backward the summed loss of each window, average by hand
    target = model.model.layers[1].mlp.down_proj
    total = 0.0
    for row in ids:
        kept = []
        h = target.register_forward_hook(lambda _m, _i, out: kept.append(out) or out.retain_grad())
        logits = model(row[None]).logits[0, :-1]
        torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").backward()
        h.remove()
        total += float(kept[0].grad.double().pow(2).sum()) / target.out_features
    assert weights["model.layers.1.mlp.down_proj"] == pytest.approx(total / (2 * 15), rel=1e-6)


def test_latency_tie_break_only_among_near_ties():
    spectra = [_spec("a", 576, 1536, 0.0), _spec("b", 576, 1536, 0.0)]
    calls = []

    def lat(s, old, new):  # "a" is always cheaper to grow
        calls.append(s.name)
        return 1.0 if s.name == "a" else 5.0

    plain = allocate(spectra, 0.3, 32)["ranks"]
    tied = allocate(spectra, 0.3, 32, lat)["ranks"]
    assert calls and tied["a"] >= plain["a"] and tied["a"] + tied["b"] == plain["a"] + plain["b"]


@pytest.fixture(scope="module")
def sensitivity_artifact(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("alloc") / "tiny-sens"
    s = CompressSettings(keep_ratio=0.5, rank_multiple=8, calib_samples=4, calib_seqlen=32, batch_size=2,
                         allocation="sensitivity", latency_model="trn1", fisher_windows=2)
    return compress_model(tiny_model_dir, s, out, model_id="tiny").to_dict()


def test_sensitivity_compress_within_budget_with_multiple_ranks(sensitivity_artifact):
    man = sensitivity_artifact
    mods, alloc = man["modules"], man["allocation"]
    total = sum(i["in"] * i["out"] if i.get("dense") else low_rank_params(i["in"], i["out"], i["rank"])
                for i in mods.values())
    assert alloc["method"] == "sensitivity" and total == alloc["mlp_params_used"] <= alloc["mlp_budget"]
    assert "Fisher" in alloc["sensitivity"]
    assert alloc["mlp_budget"] == int(0.5 * sum(i["in"] * i["out"] for i in mods.values()))
    ranks = [i["rank"] for i in mods.values() if not i.get("dense")]
    assert ranks and all(r % 8 == 0 for r in ranks) and len(set(ranks)) > 1
    lat = alloc["modeled_latency"]["tokens"]
    assert lat["128"]["model_us"] > 0 and set(lat["1"]["per_layer_us"]) == {"0", "1"}


def test_plain_spectra_measure_the_plain_truncations_output_error(tiny_model_dir):
    """--method plain prices each rank by its output error on the calibration, as the whitened spectra do (σ(W)
    alone gave a weight error, in no unit the Fisher weight or the normalised measure's "relative output error"
    means)."""
    import torch
    from transformers import AutoModelForCausalLM

    from compression.sensitivity import dense_mlp_spectra
    from compression.statistics import capture_layer0_inputs, dense_mlp_grams
    from compression.whiten import plain_factors

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    windows = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, kwargs = capture_layer0_inputs(model, windows, 2)
        spectra = {s.name: s for s in dense_mlp_spectra(model, hidden, kwargs, 2, whitened=False)}
        grams = list(dense_mlp_grams(model, hidden, kwargs, 2, "dense grams"))
    for i, layer, xtx, xtx_down in grams:
        for kind, G in (("gate", xtx), ("up", xtx), ("down", xtx_down)):
            W = getattr(layer.mlp, f"{kind}_proj").weight.detach().double()
            tail = normalised_tail(spectra[f"model.layers.{i}.mlp.{kind}_proj"].sigma)
            for rank in (8, 24):
                A, B = plain_factors(W, rank)
                D = W - B @ A
                relative = float(((D @ G) * D).sum() / ((W @ G) * W).sum())  # ‖X(W − BA)ᵀ‖² / ‖XWᵀ‖²
                assert tail[rank] == pytest.approx(relative, rel=1e-9), (i, kind, rank)
