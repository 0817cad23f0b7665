"""Prompt logprobs (`echo` with `logprobs` on /v1/completions), the scoring lm-evaluation-harness's
`local-completions` model does: each prompt token's logprob must be the model's teacher-forced one,
whether the prompt is prefilled in one chunk or several, cached or not, streamed or not."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import LlamaForCausalLM

from server.backends.base import SeqChunk
from server.engine.llm_engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from support import live_server, tiny_config

# Longer than the fixture's max_num_batched_tokens (64): the prompt is prefilled in several chunks.
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door. " * 4).strip()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=512, max_num_batched_tokens=64)
    cfg.model.dtype = "float32"  # compared with transformers in fp32
    with live_server(cfg) as live:
        yield live


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.state.serving.tokenizer


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tokenizer):
    """(prompt ids, teacher-forced logprob of each prompt token after the first) from transformers, fp32."""
    ids = tokenizer.encode(PROMPT)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def _complete(server, **body) -> dict:
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("attempt", ["first", "again (prefix cache warm)"])
def test_echoed_prompt_logprobs_are_teacher_forced(server, tokenizer, reference, attempt):
    ids, expected = reference
    assert len(ids) > 64  # several prefill chunks
    choice = _complete(server)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=2e-4)
    assert lp["tokens"][:len(ids)] == [tokenizer.decode([t]) for t in ids]
    # the prompt token is among its own top alternatives, as vLLM reports it (lm-eval's is_greedy reads it)
    for token, value, top in zip(lp["tokens"][1:len(ids)], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == value and max(top.values()) >= value
    assert choice["text"].startswith(PROMPT)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets[len(ids)] == len(PROMPT)  # the generated token follows the prompt


def test_usage_counts_the_prompt_once(server, reference):
    usage = _complete(server, n=2, temperature=1.0, seed=1)["usage"]
    assert usage["prompt_tokens"] == len(reference[0]) and usage["completion_tokens"] == 2


def test_streamed_echo_logprobs_equal_the_response(server):
    full = _complete(server, max_tokens=4, ignore_eos=True)["choices"][0]["logprobs"]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
            "ignore_eos": True, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    merged = {key: [] for key in full}
    for event in events:
        for key, values in (event["choices"][0]["logprobs"] or {}).items():
            merged[key] += values
    assert merged == full


def test_a_backend_without_prompt_logprobs_refuses_them():
    class SlotRunner:  # a backend that returns last-position logits only (as the Neuron runner does)
        supports_paged_kv = False

        def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
            raise AssertionError("never reached")

    engine = LLMEngine.__new__(LLMEngine)
    engine.runner, engine.seqs = SlotRunner(), {}
    with pytest.raises(ValueError, match="prompt logprobs"):
        engine.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=1))
