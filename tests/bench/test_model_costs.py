"""bench.model_costs: a model's multiply-adds per token, counted from the modules the engine runs, whatever their
packing, and the FLOPs of a step, a request and a level from them."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from bench import engine_step
from bench.model_costs import (TokenArithmetic, ceiling_tok_s, decoded_positions, level_kv_bytes, linear_macs,
                               min_level_steps)
from server.models import fused_ops
from server.models.llama import StackedPair
from server.models.lora import projection_widths
from server.models.lowrank import LowRankLinear
from server.models.packed_linear import FactoredPanelLinear, pack_linears
from transformers import AutoConfig


def _runner(model_dir, panel_gemm: bool):
    model = argparse.Namespace(dtype="float32", quantization=None, source="safetensors")
    cfg = argparse.Namespace(model=model, device="cpu", engine=argparse.Namespace(block_size=16, kv_cache_dtype="auto"))
    args = argparse.Namespace(context=8, steps=4, hold=0, num_threads=None, no_panel_gemm=not panel_gemm,
                              batch_sizes=[1], python_layers=False)
    return engine_step._load_runner(model_dir, cfg, args, None)


@pytest.mark.parametrize("panel_gemm", [True, False])
def test_a_dense_models_count_is_its_projections_and_lm_head_however_they_are_packed(tiny_model_dir, panel_gemm):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    widths = projection_widths(config)  # q, k, v, o, gate, up, down: (in, out)
    per_layer = sum(i * o for i, o in widths.values())
    head = config.vocab_size * config.hidden_size
    last_past_attention = sum(i * o for name, (i, o) in widths.items() if name not in ("q_proj", "k_proj", "v_proj"))
    counted = TokenArithmetic.of(_runner(tiny_model_dir, panel_gemm).model)
    assert counted.decode_macs == config.num_hidden_layers * per_layer + head
    assert counted.prompt_macs == counted.decode_macs - head - last_past_attention
    head_dim = config.hidden_size // config.num_attention_heads
    assert counted.attention_macs_per_position == 2 * config.num_attention_heads * head_dim * config.num_hidden_layers


@pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")
def test_a_low_rank_pair_counts_the_same_before_and_after_it_packs_into_one_factored_call():
    g = torch.Generator().manual_seed(0)
    gate = LowRankLinear(torch.randn(32, 64, generator=g), torch.randn(96, 32, generator=g))  # rank 32: 32 x (64 + 96)
    model = nn.Sequential(StackedPair(gate, nn.Linear(64, 96, bias=False)))
    before = sum(linear_macs(model).values())
    assert before == 32 * (64 + 96) + 64 * 96
    assert pack_linears(model, use_panels=True) == 1 and isinstance(model[0], FactoredPanelLinear)
    assert sum(linear_macs(model).values()) == before  # the stacked first GEMM 64 x (32 + 96), then gate's B 32 x 96


def test_step_request_and_level_flops_count_prompts_decodes_and_the_positions_attended():
    a = TokenArithmetic(decode_macs=10, prompt_macs=6, attention_macs_per_position=2)
    assert a.decode_step_flops(batch=4, context=5) == 2 * 4 * (10 + 2 * 5)
    # 3 prompt tokens (two pruned, the last one full) attend 1 + 2 + 3 positions; one decode token attends 4
    assert a.request_flops(prompt_len=3, output_len=2) == 2 * (2 * 6 + 2 * 10 + 2 * (1 + 2 + 3 + 4))
    assert a.request_flops(prompt_len=1, output_len=1) == 2 * (10 + 2)  # the prompt's one token makes the output
    assert a.level_flops([3, 1], output_len=2) == a.request_flops(3, 2) + a.request_flops(1, 2)


def test_a_ceiling_is_the_tokens_over_the_longer_of_the_flops_at_the_peak_and_the_fewest_steps_stream():
    peak = {"kind": "fp32_fma", "gops": 200.0}
    assert ceiling_tok_s(4096, 2048.0, peak) == pytest.approx(400.0)  # 10.24 s of FLOPs
    assert min_level_steps(32, 16, 128) == 256 and min_level_steps(4, 1, 128) == 512 and min_level_steps(5, 4, 8) == 16
    assert ceiling_tok_s(4096, 2048.0, peak, steps=256, step_bytes=168e6, bandwidth_gbs=32.0) == pytest.approx(400.0)
    assert ceiling_tok_s(512, 252.0, peak, steps=512, step_bytes=168e6, bandwidth_gbs=32.0) == pytest.approx(
        512 / (512 * 168e6 / 32e9))  # one request at a time: 2.69 s of streaming against 1.26 s of FLOPs
    assert ceiling_tok_s(4096, 2048.0, None) is None


def test_a_levels_kv_reads_are_the_positions_its_decode_steps_attend_and_they_lengthen_its_stream():
    # a 3-token prompt and 3 output tokens: the prompt's last token makes the first, two decode tokens attend 4 and 5
    assert decoded_positions(prompt_len=3, output_len=3) == 4 + 5 and decoded_positions(5, 1) == 0
    assert level_kv_bytes([3, 3, 5], output_len=3, kv_bytes_per_position=100) == 100 * (9 + 9 + 6 + 7)
    peak = {"kind": "fp32_fma", "gops": 1e6}  # FLOPs take no time: the stream bounds the level
    weights_only = ceiling_tok_s(512, 1.0, peak, steps=512, step_bytes=168e6, bandwidth_gbs=32.0)
    with_kv = ceiling_tok_s(512, 1.0, peak, steps=512, step_bytes=168e6, bandwidth_gbs=32.0, kv_bytes=512 * 42e6)
    assert with_kv == pytest.approx(512 / (512 * 210e6 / 32e9)) and with_kv == pytest.approx(weights_only * 0.8)
