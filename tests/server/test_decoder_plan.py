"""The decode step's layers in C++ (csrc/decoder.cpp) compute what the Python layer loop computes, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.models.packed_linear import FactoredPanelLinear, PanelLinear, panels_available

DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(not panels_available(torch.device("cpu"), dtype),
                                                       reason=f"no {dtype} panel GEMM on this CPU"))
          for dtype in (torch.bfloat16, torch.float32)]


def _runner(model_dir, dtype: torch.dtype) -> TorchRunner:
    runner = TorchRunner(model_dir, 64, str(dtype).removeprefix("torch."))
    runner.load()
    return runner


def _steps(runner: TorchRunner, use_plan: bool) -> list[torch.Tensor]:
    """A two-sequence prefill and three decode steps on a fresh cache; the logits of each."""
    runner.model.use_decoder_plan = use_plan
    runner.allocate_kv(2)
    logits = [runner.execute([SeqChunk(slot=0, token_ids=[1, 5, 9, 3], start_pos=0),
                              SeqChunk(slot=1, token_ids=[7, 2], start_pos=0)])]
    for i in range(3):
        logits.append(runner.execute([SeqChunk(slot=0, token_ids=[11 + i], start_pos=4 + i),
                                      SeqChunk(slot=1, token_ids=[13 + i], start_pos=2 + i)]))
    return logits


def _assert_same(runner: TorchRunner) -> None:
    assert runner.model.decoder_plan() is not None
    for planned, looped in zip(_steps(runner, True), _steps(runner, False), strict=True):
        assert torch.equal(planned, looped)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_planned_layers_equal_the_python_loop(tiny_model_dir, dtype):
    runner = _runner(tiny_model_dir, dtype)
    assert isinstance(runner.model.layers[0].mlp.down_proj, PanelLinear)
    _assert_same(runner)


@pytest.mark.parametrize("dtype", DTYPES)
def test_factored_projections_run_in_the_plan(tiny_model_dir, dtype):
    """A low-rank down projection and a gate/up pair with a low-rank gate beside a dense up, as the SVD artifact has."""
    runner = _runner(tiny_model_dir, dtype)
    mlp = runner.model.layers[1].mlp
    hidden, inter = mlp.down_proj.out_features, mlp.down_proj.in_features
    g = torch.Generator().manual_seed(3)
    factor = lambda *shape: (torch.randn(*shape, generator=g) / shape[1] ** 0.5).to(dtype)  # noqa: E731
    mlp.down_proj = FactoredPanelLinear(factor(32, inter), [32], [factor(hidden, 32)])
    mlp.gate_up_proj = FactoredPanelLinear(torch.cat([factor(32, hidden), factor(inter, hidden)]), [32, inter],
                                           [factor(inter, 32), None])
    runner.model.unbind()
    _assert_same(runner)


def test_no_plan_unless_every_projection_is_a_panel_gemm(tiny_model_dir):
    runner = TorchRunner(tiny_model_dir, 64, "float32", panel_gemm=False)  # oneDNN-packed or plain linears
    runner.load()
    assert runner.model.decoder_plan() is None


def test_no_plan_on_the_reference_kernels(tiny_model_dir):
    runner = TorchRunner(tiny_model_dir, 64, "float32", fused_kernels=False)
    runner.load()
    assert runner.model.decoder_plan() is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapping_a_projection_rebuilds_the_plan(tiny_model_dir, dtype):
    runner = _runner(tiny_model_dir, dtype)
    before = runner.model.decoder_plan()
    runner.model.unbind()  # as fuse_projections, use_kernels and pack_linears do after swapping modules
    assert runner.model.decoder_plan() is not before


@pytest.mark.parametrize("use_plan", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_last_layer_carries_only_the_rows_that_want_logits(tiny_model_dir, dtype, use_plan):
    """A prompt chunk wanting its last token's logits gets what a chunk wanting every token's gets at that token,
    and the cache it leaves serves the next step alike (every row's K/V is written before the rows are dropped)."""
    runner = _runner(tiny_model_dir, dtype)
    runner.model.use_decoder_plan = use_plan
    if not use_plan:  # the Python loop with the first prompt attended by SDPA (as long prompts are), the second not
        runner.model.kernels = dataclasses.replace(runner.model.kernels, sdpa_min_chunk=5)
    prompts = [[1, 5, 9, 3, 8, 2, 6], [7, 2, 4]]

    def run(all_logits: bool, needs_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        runner.allocate_kv(2)
        first = runner.execute([SeqChunk(slot=i, token_ids=p, start_pos=0, needs_logits=needs_logits,
                                         all_logits=all_logits) for i, p in enumerate(prompts)])
        then = runner.execute([SeqChunk(slot=i, token_ids=[11], start_pos=len(p)) for i, p in enumerate(prompts)])
        return first, then

    pruned, pruned_next = run(all_logits=False)
    every, every_next = run(all_logits=True)
    assert pruned.shape == (2, runner.vocab_size) and every.shape == (7 + 3, runner.vocab_size)
    last_rows = every[[6, 9]]
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4  # fewer rows may take another GEMM path (bf16: FMA or VDPBF16PS)
    torch.testing.assert_close(pruned, last_rows, atol=tol, rtol=0)
    assert torch.equal(pruned.argmax(-1), last_rows.argmax(-1))
    torch.testing.assert_close(pruned_next, every_next, atol=tol, rtol=0)
    none, _ = run(all_logits=False, needs_logits=False)  # chunks that do not end their prompts: no row goes on
    assert none.shape == (0, runner.vocab_size)
