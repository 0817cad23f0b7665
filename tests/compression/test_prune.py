"""Structured MLP pruning (compression/prune.py): exactness, block alignment, budget, channel choice, allocation."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compression.prune import (allocate_blocks, apply_plan, budget_blocks, energy_order, energy_scores, layer_stats,
                               make_plan, mlp_parameters, obs_order, output_rel_error, prune_mlp, refit_down,
                               removal_orders)

HIDDEN, INTER, LAYERS, BLOCK = 32, 64, 3, 16


@pytest.fixture(scope="module")
def tiny():
    """A 3-layer random Llama (hidden 32, intermediate 64 = 4 blocks of 16), fp32, in memory."""
    config = LlamaConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # unequal channel scales, so scores differ clearly between channels and layers
        for i, layer in enumerate(model.model.layers):
            layer.mlp.down_proj.weight.mul_(torch.logspace(-1, 1, INTER)[torch.randperm(INTER)] * (i + 1))
    return model


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def stats(tiny, windows):
    return layer_stats(tiny, windows, batch_size=4)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_keep_all_is_exact(tiny, windows, stats):
    ids = windows[:2]
    dense = _logits(tiny, ids)
    # Budget 1.0 removes nothing; slicing every layer to all its channels reproduces the model bit for bit.
    orders = removal_orders(tiny, stats, "energy", INTER - BLOCK)
    plan = make_plan(orders, INTER, HIDDEN, 1.0, BLOCK, "global")
    assert plan.removed_blocks == [0] * LAYERS
    model = copy.deepcopy(tiny)
    apply_plan(model, plan)
    for layer in model.model.layers:
        prune_mlp(layer.mlp, torch.arange(INTER))
    assert torch.equal(_logits(model, ids), dense)
    assert mlp_parameters(model) == mlp_parameters(tiny)


def test_pruned_mlp_equals_dense_with_channels_zeroed(tiny):
    mlp = copy.deepcopy(tiny.model.layers[1].mlp)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(2))
    keep = torch.tensor(sorted(torch.randperm(INTER, generator=torch.Generator().manual_seed(3))[:40].tolist()))
    mask = torch.zeros(INTER)
    mask[keep] = 1
    with torch.no_grad():
        h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        expected = mlp.down_proj(h * mask)
        prune_mlp(mlp, keep)
        got = mlp(x)
    assert mlp.gate_proj.weight.shape == (40, HIDDEN) and mlp.up_proj.weight.shape == (40, HIDDEN)
    assert mlp.down_proj.weight.shape == (HIDDEN, 40)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["uniform", "global"])
@pytest.mark.parametrize("keep", [0.9, 0.8, 0.6, 0.5, 0.34])
def test_blocks_aligned_and_within_budget(tiny, stats, method, keep):
    orders = removal_orders(tiny, stats, "energy", INTER - BLOCK)
    plan = make_plan(orders, INTER, HIDDEN, keep, BLOCK, method)
    total = LAYERS * 3 * HIDDEN * INTER
    budget = int(keep * total)
    sizes = plan.record["intermediate_sizes"]
    assert all(s % BLOCK == 0 and BLOCK <= s <= INTER for s in sizes)
    used = sum(3 * HIDDEN * s for s in sizes)
    assert used == plan.record["mlp_params_used"] <= budget == plan.record["mlp_budget"]
    assert used + 3 * HIDDEN * BLOCK > budget  # the tightest whole-block fit: one block more would not fit
    if method == "uniform":
        assert max(sizes) - min(sizes) <= BLOCK
    model = copy.deepcopy(tiny)
    apply_plan(model, plan)
    assert mlp_parameters(model) == used


def test_budget_blocks_default_model_numbers():
    # SmolLM2-135M at keep 0.8: 288 of 360 blocks of 128 fit int(0.8 · 79,626,240) = 63,700,992 exactly.
    remove, budget = budget_blocks(30, 576, 1536, 0.8, 128)
    assert (remove, budget) == (72, 63_700_992)
    with pytest.raises(ValueError):
        budget_blocks(30, 576, 1536, 0.8, 100)


@pytest.mark.parametrize("method", ["uniform", "global"])
def test_removed_channels_are_lowest_energy(tiny, stats, method):
    orders = removal_orders(tiny, stats, "energy", INTER - BLOCK)
    plan = make_plan(orders, INTER, HIDDEN, 0.6, BLOCK, method)
    for layer, st, keep, k in zip(tiny.model.layers, stats, plan.keep, plan.removed_blocks):
        scores = energy_scores(st, layer.mlp.down_proj.weight)
        removed = sorted(set(range(INTER)) - set(keep.tolist()))
        assert len(removed) == k * BLOCK
        if removed:
            assert scores[removed].max() <= scores[keep].min()


def test_energy_score_is_expected_squared_contribution(tiny, windows, stats):
    # E[h_j²]·‖down[:, j]‖² = mean over tokens of ‖h_j · down[:, j]‖², measured directly on layer 0.
    layer = tiny.model.layers[0]
    captured = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda _m, a: captured.append(a[0].detach()))
    with torch.no_grad():
        tiny(input_ids=windows, use_cache=False)
    handle.remove()
    h = torch.cat(captured).reshape(-1, INTER).double()
    W = layer.mlp.down_proj.weight.double()
    direct = torch.stack([(h[:, j:j + 1] * W[:, j]).pow(2).sum(1).mean() for j in range(INTER)])
    assert torch.allclose(energy_scores(stats[0], W), direct, rtol=1e-6)


def test_energy_order_costs_are_cumulative_scores(tiny, stats):
    W = tiny.model.layers[2].mlp.down_proj.weight
    order = energy_order(stats[2], W, 48)
    scores = energy_scores(stats[2], W)
    assert np.allclose(order.cost[1:], np.cumsum(np.sort(scores.numpy())[:48]))
    assert np.allclose(order.block_costs(BLOCK), order.cost[[0, 16, 32, 48]])


def test_refit_and_obs_costs_match_direct_errors():
    g = torch.Generator().manual_seed(4)
    H = torch.randn(500, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g, dtype=torch.float64)
    W = torch.randn(6, 12, generator=g, dtype=torch.float64)
    G = H.T @ H
    keep = torch.tensor([0, 2, 3, 5, 7, 8, 11])
    new = refit_down(W, keep, G, damp=0.0)
    # The refit is the least-squares solution, and output_rel_error measures it from G alone.
    lstsq = torch.linalg.lstsq(H[:, keep], H @ W.T).solution.T
    assert torch.allclose(new, lstsq, atol=1e-8)
    direct = torch.linalg.norm(H[:, keep] @ new.T - H @ W.T) / torch.linalg.norm(H @ W.T)
    assert abs(output_rel_error(W, new, keep, G) - float(direct)) < 1e-10
    assert output_rel_error(W, new, keep, G) < output_rel_error(W, W[:, keep], keep, G)
    # OBS's cumulative cost after k removals is the refit error of the remaining channels (per token).
    from compression.prune import LayerStats

    order = obs_order(LayerStats(G, 500), W, 5, damp=0.0)
    for k in range(1, 6):
        rest = torch.tensor(sorted(set(range(12)) - set(order.order[:k].tolist())))
        err = (H[:, rest] @ refit_down(W, rest, G, 0.0).T - H @ W.T).pow(2).sum() / 500
        assert order.cost[k] == pytest.approx(float(err), rel=1e-6)


def test_global_allocation_is_optimal_and_uniform_is_even():
    rng = np.random.default_rng(0)
    costs = [np.concatenate([[0.0], np.cumsum(rng.random(4) * s)]) for s in (1.0, 5.0, 0.2, 2.0)]
    for remove in range(0, 13):
        costs3 = [c[:4] for c in costs]  # each layer keeps at least one of its 4 blocks
        counts = allocate_blocks(costs3, remove, "global")
        assert sum(counts) == remove and all(c <= 3 for c in counts)
        brute = min(sum(c[k] for c, k in zip(costs, ks))
                    for ks in itertools.product(range(4), repeat=4) if sum(ks) == remove)
        assert sum(c[k] for c, k in zip(costs, counts)) == pytest.approx(brute)
        uni = allocate_blocks(costs3, remove, "uniform")
        assert sum(uni) == remove and max(uni) - min(uni) <= 1
    # Weights scale a layer's costs: a heavily weighted layer loses fewer blocks.
    flat = [np.arange(5, dtype=float)] * 2
    assert allocate_blocks(flat, 3, "global", weights=[10.0, 1.0]) == [0, 3]
    # The uniform remainder goes to the layer whose next block costs least.
    assert allocate_blocks(flat, 3, "uniform", weights=[10.0, 1.0]) == [1, 2]
    with pytest.raises(ValueError):
        allocate_blocks(flat, 9, "global")


def test_refit_plan_runs_and_lowers_layer_error(tiny, windows, stats):
    orders = removal_orders(tiny, stats, "obs", INTER - BLOCK)
    plan = make_plan(orders, INTER, HIDDEN, 0.6, BLOCK, "global")
    model = copy.deepcopy(tiny)
    rec = apply_plan(model, plan, windows, batch_size=4, refit=True)
    assert mlp_parameters(model) == plan.record["mlp_params_used"]
    for (before, after), k in zip(rec["rel_error"], plan.removed_blocks):
        assert after <= before + 1e-9
        assert (before > 0) == (k > 0)
    assert torch.isfinite(_logits(model, windows[:2])).all()


def test_refit_solves_each_layer_on_the_pruned_models_own_inputs(tiny, windows, stats):
    orders = removal_orders(tiny, stats, "obs", INTER - BLOCK)
    plan = make_plan(orders, INTER, HIDDEN, 0.6, BLOCK, "global")
    model = copy.deepcopy(tiny)
    apply_plan(model, plan, windows, batch_size=4, refit=True)
    inputs = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in enumerate(model.model.layers)]
    _logits(model, windows)
    for h in hooks:
        h.remove()
    pruned = [i for i, k in enumerate(plan.removed_blocks) if k]
    assert len(pruned) >= 2  # a later layer's inputs depend on the earlier layers' refit outputs
    for i in pruned:
        dense = tiny.model.layers[i].mlp
        with torch.no_grad():
            h = dense.act_fn(dense.gate_proj(inputs[i])) * dense.up_proj(inputs[i])
        g = (h.reshape(-1, INTER).double().T @ h.reshape(-1, INTER).double())
        expected = refit_down(dense.down_proj.weight, plan.keep[i], g)
        torch.testing.assert_close(model.model.layers[i].mlp.down_proj.weight.double(), expected, rtol=1e-4, atol=1e-6)
