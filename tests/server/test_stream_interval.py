"""`server.stream_interval` (vLLM's --stream-interval): a choice's first token goes out at once, then a chunk per
that many tokens and one with the rest; the text, the tokens' logprobs and the usage are what a chunk a token gives."""

from __future__ import annotations

import openai
import pytest

from server.engine.sequence import SeqOutput, TokenLogprob
from support import live_server, tiny_config

INTERVAL, TOKENS = 4, 14  # 1 + 4 + 4 + 4 + 1: the last chunk holds what is left


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=512)
    cfg.server.stream_interval = INTERVAL
    with live_server(cfg) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_completion_chunks_hold_interval_tokens_and_the_same_text(client):
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=TOKENS, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0]
    chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **args)]
    texts = [c for c in chunks if c.choices]
    assert [len(c.choices[0].logprobs.tokens) for c in texts] == [1, 4, 4, 4, 1]
    assert "".join(c.choices[0].text for c in texts) == full.text
    assert [t for c in texts for t in c.choices[0].logprobs.token_logprobs] == pytest.approx(
        full.logprobs.token_logprobs, abs=1e-5)
    assert texts[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])
    assert chunks[-1].usage.completion_tokens == TOKENS


def test_chat_choices_reassemble_per_choice(client):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    args = dict(model="tiny", messages=msgs, max_tokens=9, temperature=0, n=2, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args).choices[0].message.content
    streamed = {0: "", 1: ""}
    per_choice = {0: 0, 1: 0}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            per_choice[c.index] += 1
    assert streamed == {0: full, 1: full}  # greedy: both choices alike
    assert per_choice == {0: 3, 1: 3}  # 1 + 4 + 4 tokens


def test_followed_by_joins_two_deltas():
    lp = [TokenLogprob(token_id=5, logprob=-0.5, top=[])]
    first = SeqOutput("r", 0, "Hel", [5], lp, None, 3, 1, num_cached_tokens=2, prompt_logprobs=[None])
    second = SeqOutput("r", 0, "lo", [6, 7], None, "stop", 3, 3)
    both = first.followed_by(second)
    assert (both.text, both.token_ids, both.finish_reason, both.num_output_tokens) == ("Hello", [5, 6, 7], "stop", 3)
    assert both.logprobs == lp and both.prompt_logprobs == [None] and both.num_cached_tokens == 2
    assert first.followed_by(SeqOutput("r", 0, "", [], None, None, 3, 1)).logprobs == lp
    plain = SeqOutput("r", 0, "a", [1], None, None, 3, 1).followed_by(SeqOutput("r", 0, "b", [2], None, None, 3, 2))
    assert plain.logprobs is None
