"""Beam search (vLLM's use_beam_search): the replies a search over transformers' logits finds, served."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.api.beam_search import Beam, beam_search
from server.engine.sequence import TokenLogprob
from server.runtime import load_tokenizer
from support import live_server, tiny_config

PROMPT = "The three primary colors are"


def _hf_next_tokens(hf):
    """next_tokens over transformers' own logits (fp32 log-softmax, the top `num`)."""

    async def next_tokens(prefixes: list[list[int]], num: int) -> list[TokenLogprob]:
        out = []
        for prefix in prefixes:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([prefix])).logits[0, -1].float(), dim=-1)
            values, ids = logprobs.topk(num)
            out.append(TokenLogprob(int(ids[0]), float(values[0]), list(zip(ids.tolist(), values.tolist()))))
        return out

    return next_tokens


def test_the_search_keeps_the_likeliest_beams_and_ranks_by_length_penalised_score():
    # a two-token vocabulary where the greedy first token (0) leads to a worse pair than the runner-up (1)
    table = {(): [(0, -0.5), (1, -0.9)], (0,): [(2, -2.0), (3, -2.1)], (1,): [(2, -0.1), (3, -3.0)]}

    async def next_tokens(prefixes, num):
        return [TokenLogprob(-1, 0.0, table.get(tuple(p), [(2, -5.0), (3, -5.0)])[:num]) for p in prefixes]

    best = asyncio.run(beam_search(next_tokens, [], 2, 2, frozenset()))
    assert [b.tokens for b in best] == [(1, 2), (0, 2)] and best[0].logprob == pytest.approx(-1.0)
    assert asyncio.run(beam_search(next_tokens, [], 1, 2, frozenset()))[0].tokens == (0, 2)  # width 1: greedy
    ended = asyncio.run(beam_search(next_tokens, [], 2, 2, frozenset({2})))  # token 2 ends a reply
    assert ended[0] == Beam((1, 2), pytest.approx(-1.0), True)


@pytest.mark.parametrize("penalty", [-2.5e16, 2.5e16, 1e308])
def test_an_extreme_length_penalty_still_ranks(penalty):
    """The fuzzer's case: length ** -2.5e16 is 0 in floating point, and the division failed (a 500)."""
    beams = [Beam((1, 2), -1.0), Beam((3,), -2.0, True)]
    scores = [b.score(4, penalty) for b in beams]
    assert all(s <= 0 and s == s for s in scores) and Beam((1, 2), -1.0).score(4, 1.0) == pytest.approx(-1.0 / 6)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    cfg.model.dtype = "float32"  # compared with transformers in fp32
    with live_server(cfg) as live:
        yield live


def test_served_beams_are_the_search_over_transformers_logits(server, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = tok.encode(PROMPT)
    expected = asyncio.run(beam_search(_hf_next_tokens(hf), prompt, 3, 6, frozenset(), 1.0))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in resp.choices] == [tok.decode(b.tokens) for b in expected]
    assert [c.index for c in resp.choices] == [0, 1, 2] and resp.usage.completion_tokens == 18
    # one beam is greedy decoding
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                    extra_body={"use_beam_search": True, "ignore_eos": True}).choices[0].text
    assert one == greedy
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          n=2, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(chat.choices) == 2 and all(c.finish_reason == "length" for c in chat.choices)


@pytest.mark.parametrize("extra, says", [
    ({"stream": True}, "stream"),
    ({"stop": ["x"]}, "stop"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"structured_outputs": {"regex": "a+"}}, "structured output"),
    ({"n": 11}, "at most 10"),
])
def test_what_beam_search_does_not_combine_with_is_a_400(server, extra, says):
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "use_beam_search": True,
                                                            **extra})
    assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
