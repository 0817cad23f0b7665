"""Speculative decoding: drafts from the sequence's own text (n-gram) or from a predicted reply, checked in one
forward; greedy outputs as without them."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from server.backends.torch_runner import TorchRunner
from server.config import ConfigError, SpeculativeConfig, load_config
from server.engine import sampler
from server.engine.ngram import propose
from server.engine.predicted import PredictedOutput
from server.engine.sampling_params import SamplingParams
from server.runtime import build_engine, eos_token_ids
from support import live_server, tiny_config
from test_api import metric
from test_config_cli import _serve_config

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# the default model on text it partly copies (drafts taken and rejected), and on text it does not
PROMPTS = ["Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape\nCopy: apple, banana,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "The three primary colors are"]


def test_propose_takes_what_followed_the_latest_earlier_tail():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 4, 2) == [4, 5, 1]  # tail 1 2 3 occurred at the start
    assert propose([9, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2, 4, 2) == [8, 2]  # the latest occurrence of 2 3
    assert propose([1, 2, 3, 4], 3, 4, 2) == [] and propose([], 3, 4, 1) == [] and propose([5], 3, 4, 1) == []
    assert propose([4, 5, 6, 4], 2, 4, 1) == [5, 6]  # a single token where no longer tail repeats


def _propose_plainly(tokens, num_draft, lookup_max, lookup_min):
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + num_draft]
    return []


def test_propose_matches_whole_tokens_only():
    """The byte search finds no match across token boundaries: ids whose bytes overlap (256 = 00 01 00 00) agree
    with a plain search over the ids."""
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.choice([0, 1, 2, 256, 65536, 16777216]) for _ in range(rng.randrange(0, 40))]
        assert propose(tokens, 3, 4, 1) == _propose_plainly(tokens, 3, 4, 1), tokens


@pytest.fixture(scope="module")
def parts(smol_dir):
    """The default model in fp32 (its fused kernels): real text, where drafts are both right and wrong."""
    runner = TorchRunner(smol_dir, 256, "float32", fused_kernels=True)
    runner.load()
    return smol_dir, runner, AutoTokenizer.from_pretrained(smol_dir)


def _run(parts, speculative, params_of, prompts=PROMPTS):
    """Every prompt (text, or token ids) in one engine; (tokens, finish reasons, step stats)."""
    model_dir, runner, tok = parts
    cfg = tiny_config(model_dir, max_model_len=256, max_num_batched_tokens=512)  # every prompt in the first step
    cfg.engine.speculative = SpeculativeConfig(**speculative) if speculative else None
    engine = build_engine(cfg, runner, tok, eos_token_ids(model_dir, tok))
    steps = []
    engine.observers.append(steps.append)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), tok(prompt).input_ids if isinstance(prompt, str) else prompt, params_of(i))
    got = {str(i): [] for i in range(len(prompts))}
    finish = {}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
            finish[out.request_id] = out.finish_reason or finish.get(out.request_id)
    return [got[str(i)] for i in range(len(prompts))], [finish[str(i)] for i in range(len(prompts))], steps


def test_greedy_output_is_the_same_with_and_without_drafts(parts):
    greedy = lambda i: SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # noqa: E731
    plain, _, plain_steps = _run(parts, None, greedy)
    drafted, _, steps = _run(parts, SPEC, greedy)
    assert drafted == plain
    made, held = sum(s.num_draft_tokens for s in steps), sum(s.num_accepted_tokens for s in steps)
    assert 0 < held < made  # drafts were right and wrong
    assert sum(s.num_generation_tokens for s in steps) == 3 * 40 and len(steps) < len(plain_steps)


def test_a_draft_stops_at_max_tokens_and_stop_tokens(parts):
    plain, _, _ = _run(parts, None, lambda i: SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for max_tokens in (5, 6, 7):
        got, finish, _ = _run(parts, SPEC, lambda i: SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True))
        assert got == [p[:max_tokens] for p in plain] and finish == ["length"] * 3
    stop_at = plain[0][9]  # in the copied list, where drafts hold
    got, finish, steps = _run(parts, SPEC, lambda i: SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]), prompts=PROMPTS[:1])
    assert got[0] == plain[0][:plain[0].index(stop_at) + 1] and finish == ["stop"]


def test_logprob_and_penalty_requests_are_not_drafted_and_sampled_ones_are(parts):
    kinds = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.2, ignore_eos=True)]
    with_spec, _, steps = _run(parts, SPEC, lambda i: kinds[i], prompts=PROMPTS[:2])
    without, _, _ = _run(parts, None, lambda i: kinds[i], prompts=PROMPTS[:2])
    assert with_spec == without and sum(s.num_draft_tokens for s in steps) == 0
    sampled = lambda i: SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True)  # noqa
    first, _, steps = _run(parts, SPEC, sampled)
    again, _, _ = _run(parts, SPEC, sampled)
    assert first == again and [len(t) for t in first] == [30] * 3  # a seed replays under the same config
    assert sum(s.num_accepted_tokens for s in steps) > 0


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_sampled_draft_gives_the_models_distribution(top_p):
    """Speculative sampling with a guessed draft: the first token is distributed as the model's first row, and
    (first, second) as row 0 then row 1 when the first is the guess; whatever the guess."""
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, -0.5], [1.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=top_p)
    probs = sampler._distributions(rows, SimpleNamespace(params=params))
    trials, draft = 20000, [1, 3]
    seq = SimpleNamespace(params=params, generator=torch.Generator().manual_seed(7))
    firsts, pairs = torch.zeros(5), torch.zeros(5)
    for _ in range(trials):
        tokens = sampler.check_draft(rows, draft, seq)
        firsts[tokens[0]] += 1
        if tokens[0] == draft[0]:
            pairs[tokens[1]] += 1
    assert torch.allclose(firsts / trials, probs[0], atol=0.015)
    assert torch.allclose(pairs / trials, probs[0, draft[0]] * probs[1], atol=0.015)


def test_no_drafts_above_disable_by_batch_size(parts):
    greedy = lambda i: SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # noqa: E731
    _, _, three = _run(parts, {**SPEC, "disable_by_batch_size": 2}, greedy)  # three prompts run together
    _, _, one = _run(parts, {**SPEC, "disable_by_batch_size": 2}, greedy, prompts=PROMPTS[:2])
    assert sum(s.num_draft_tokens for s in three) == 0 and sum(s.num_draft_tokens for s in one) > 0


def test_prefix_cache_blocks_written_with_drafts_serve_a_later_prompt(parts):
    """Blocks filled by checked drafts are published with the tokens they hold: a later prompt that repeats the
    first request's text reuses them and decodes as a run without the cache does."""
    model_dir, runner, tok = parts
    cfg = tiny_config(model_dir, max_model_len=256)
    cfg.engine.speculative = SpeculativeConfig(**SPEC)
    engine = build_engine(cfg, runner, tok, eos_token_ids(model_dir, tok))
    prompt = tok(PROMPTS[0]).input_ids
    engine.add_request("a", prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    first = []
    while engine.has_work():
        first += [t for out in engine.step() for t in out.token_ids]
    follow = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("b", prompt + first, follow)
    second, cached = [], 0
    while engine.has_work():
        for out in engine.step():
            second += out.token_ids
            cached = max(cached, out.num_cached_tokens)
    assert cached >= (len(prompt) + len(first)) // 16 * 16 - 16  # every whole block but perhaps the last step's
    fresh, _, _ = _run(parts, None, lambda i: follow, prompts=[prompt + first])
    assert second == fresh[0]


def test_speculative_config_and_flag():
    cfg = load_config(None, {"engine.speculative": SPEC})
    assert cfg.engine.speculative.num_speculative_tokens == 4
    for bad in ({**SPEC, "method": "eagle"}, {**SPEC, "prompt_lookup_min": 5}, {**SPEC, "num_speculative_tokens": 0}):
        with pytest.raises(ConfigError, match="engine.speculative"):
            load_config(None, {"engine.speculative": bad})
    cli = _serve_config(["--speculative-config", json.dumps(SPEC)]).engine.speculative
    assert (cli.method, cli.num_speculative_tokens, cli.prompt_lookup_min) == ("ngram", 4, 1)
    with pytest.raises(SystemExit):
        _serve_config(["--speculative-config", "ngram"])


def test_served_streams_carry_several_tokens_a_step_and_equal_the_plain_server(tiny_model_dir):
    """Through the API: a drafted step's tokens arrive as one delta (or several), the text and usage as without."""
    body = {"model": "tiny", "prompt": "one two one two one two", "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True}
    answers = []
    for speculative in (None, SPEC):
        cfg = tiny_config(tiny_model_dir, max_model_len=256)
        cfg.engine.speculative = SpeculativeConfig(**speculative) if speculative else None
        with live_server(cfg) as live:
            whole = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
            with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            drafted = metric(live.url, "neuronmm_spec_decode_num_draft_tokens_total")
            accepted = metric(live.url, "vllm:spec_decode_num_accepted_tokens_total")  # vLLM's name too
            assert (drafted > 0 and 0 < accepted <= drafted) if speculative else drafted == accepted == 0
            answers.append((whole["choices"][0]["text"], whole["usage"]["completion_tokens"],
                            "".join(e["choices"][0]["text"] for e in events), len(events)))
    (plain_text, plain_count, plain_streamed, plain_chunks), (text, count, streamed, chunks) = answers
    assert (text, count, streamed) == (plain_text, plain_count, plain_streamed) == (plain_text, 24, plain_text)
    assert chunks < plain_chunks  # fewer, fuller chunks: several tokens a step



# ---- predicted replies (OpenAI's Predicted Outputs) -----------------------------------------------------------------

def test_a_prediction_drafts_from_where_the_reply_stands_in_it():
    pred = PredictedOutput([10, 11, 12, 13, 14, 15, 16, 17])
    assert pred.draft([], 3) == [10, 11, 12]  # the reply's start is the prediction's
    pred.follow([10], [])
    pred.follow([11, 12, 13], [11, 12])  # the draft kept whole, the model's own 13 after it
    assert pred.draft([10, 11, 12, 13], 3) == [14, 15, 16] and (pred.accepted, pred.rejected) == (2, 0)
    pred.follow([14, 99], [14, 15, 16])  # 99: the reply leaves the prediction (an edit)
    assert (pred.accepted, pred.rejected, pred.next) == (3, 2, None)
    assert pred.draft([10, 11, 12, 13, 14, 99], 3) == []  # 99 is nowhere in it
    pred.follow([16], [])  # the reply comes back two tokens on: its newest token, near where it left
    assert pred.draft([10, 11, 12, 13, 14, 99, 16], 3) == [17]
    pred.follow([17], [17])
    assert pred.draft([10, 11, 12, 13, 14, 99, 16, 17], 3) == [] and pred.accepted == 4  # the prediction's end


def test_a_prediction_resumes_far_away_only_on_two_tokens_and_shrinks_refused_drafts():
    far = list(range(100, 140))
    pred = PredictedOutput([1, 2] + far + [7, 8, 9, 5])
    pred.follow([1, 2, 50], [])  # left the prediction right after its start
    assert pred.draft([1, 2, 50, 7], 4) == []  # one token (7) far from where the reply left places nothing
    assert pred.draft([1, 2, 50, 7, 8], 4) == [9, 5]  # two (7 8) do, wherever they are
    pred.follow([60], [9, 5])
    assert pred.misses == 1 and pred.draft([1, 2, 50, 7, 8, 60, 1, 2], 4) == [100, 101]  # half as long
    pred.follow([61], [100, 101])
    assert pred.draft([1, 2, 50, 7, 8, 60, 61, 1, 2], 4) == [100]
    pred.follow([100, 101], [100])  # a kept token: full length again
    assert pred.misses == 0 and pred.draft([1, 2, 50, 7, 8, 60, 61, 1, 2, 100, 101], 4) == [102, 103, 104, 105]


def test_a_predicted_reply_drafts_without_speculative_config_and_changes_no_token(parts):
    """The plain reply as its own prediction, the same with words changed, inserted and dropped, and another
    prompt's reply: every greedy reply is the plain one; a right prediction takes far fewer steps."""
    greedy = lambda i: SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # noqa: E731
    plain, _, plain_steps = _run(parts, None, greedy)
    edited = [p[:5] + [p[7], 1000, 1001] + p[8:20] + p[24:] for p in plain]
    for predictions in (plain, edited, plain[1:] + plain[:1]):
        got, _, steps = _run(parts, None, lambda i: replace(greedy(i), prediction=predictions[i]))
        assert got == plain
        assert sum(s.num_draft_tokens for s in steps) > 0
        if predictions is plain:
            assert len(steps) < len(plain_steps) / 3 and sum(s.num_generation_tokens for s in steps) == 3 * 40


def test_a_predicted_reply_stops_at_max_tokens_and_stop_tokens(parts):
    plain, _, _ = _run(parts, None, lambda i: SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for max_tokens in (2, 3, 9):
        got, finish, steps = _run(parts, None, lambda i: SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                         ignore_eos=True, prediction=plain[i]))
        assert got == [p[:max_tokens] for p in plain] and finish == ["length"] * 3
        # nothing drafted past the last token (its K/V would need room the reply does not have)
        assert sum(s.num_draft_tokens for s in steps) == 3 * (max_tokens - 2)
    stop_at = plain[0][12]
    got, finish, _ = _run(parts, None, lambda i: SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at], prediction=plain[0]),
        prompts=PROMPTS[:1])
    assert got[0] == plain[0][:plain[0].index(stop_at) + 1] and finish == ["stop"]


def test_served_prediction_reports_kept_and_refused_tokens(smol_dir):
    """Through the chat API: the same reply with and without its prediction, OpenAI's usage details (streamed
    too), text parts taken, a bad prediction refused. (The default model: the tiny one's replies are runs of
    newlines, which its tokenizer writes as fewer, longer tokens than the model generates.)"""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "List five fruits."}], "max_tokens": 24,
            "temperature": 0.0, "ignore_eos": True}
    with live_server(tiny_config(smol_dir, max_model_len=256)) as live:
        url = f"{live.url}/v1/chat/completions"
        plain = httpx.post(url, json=body, timeout=60).json()
        reply = plain["choices"][0]["message"]["content"]
        assert plain["usage"]["completion_tokens_details"] is None
        predicted = httpx.post(url, json={**body, "prediction": {"type": "content", "content": reply}}, timeout=60)
        details = predicted.json()["usage"]["completion_tokens_details"]
        assert predicted.json()["choices"][0]["message"]["content"] == reply
        assert details["accepted_prediction_tokens"] > 0
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] <= 24
        parts_body = {**body, "stream": True, "stream_options": {"include_usage": True},
                      "prediction": {"type": "content", "content": [{"type": "text", "text": reply}]}}
        with httpx.stream("POST", url, json=parts_body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == reply
        assert events[-1]["usage"]["completion_tokens_details"] == details
        # each of n choices follows the prediction on its own; the usage adds them up
        both = httpx.post(url, json={**body, "n": 2, "prediction": {"type": "content", "content": reply}},
                          timeout=60).json()
        assert [c["message"]["content"] for c in both["choices"]] == [reply, reply]
        assert both["usage"]["completion_tokens_details"] == {k: 2 * v for k, v in details.items()}
        for bad in ({"type": "text", "content": reply}, {"type": "content"}, {"type": "content", "content": 3}):
            r = httpx.post(url, json={**body, "prediction": bad}, timeout=60)
            assert r.status_code == 400 and "prediction" in r.json()["error"]["message"], bad
