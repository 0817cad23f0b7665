"""The real default model: engine greedy output equals HF `generate` greedy output token for token."""

from __future__ import annotations

import pytest
import torch

from server.engine.sampling_params import SamplingParams
from server.runtime import build_engine, eos_token_ids, load_tokenizer
from support import tiny_config

NEW_TOKENS = 40


@pytest.mark.slow
def test_engine_greedy_equals_hf_generate(smol_dir):
    from transformers import AutoModelForCausalLM

    from server.backends.torch_runner import TorchRunner

    tok = load_tokenizer(smol_dir)
    prompts = ["The three primary colors are", "def fibonacci(n):"]
    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    expected = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, ids.shape[1]:].tolist())
    del hf

    runner = TorchRunner(smol_dir, 512)
    runner.load()
    engine = build_engine(tiny_config(smol_dir, max_model_len=512), runner, tok, eos_token_ids(smol_dir, tok))
    for i, p in enumerate(prompts):  # both in one batch: batching must not change greedy results
        engine.add_request(str(i), tok(p).input_ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                    ignore_eos=True))
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == expected
