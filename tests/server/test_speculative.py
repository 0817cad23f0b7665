"""n-gram speculative decoding: drafts from the sequence's own text, checked in one forward; greedy outputs as
without them."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from server.backends.torch_runner import TorchRunner
from server.config import ConfigError, SpeculativeConfig, load_config
from server.engine import sampler
from server.engine.ngram import propose
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

