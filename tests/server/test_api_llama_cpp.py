"""llama-server's own completion API (/completion) and /apply-template: its fields, defaults and answer shape."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from bench.harness import make_tiny_model
from support import live_server, tiny_config


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_config(tiny_model_dir, max_model_len=256)) as live:
        yield live


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] != "data: [DONE]"  # as llama-server ends it
    return [json.loads(line[6:]) for line in lines]


def test_a_completion_is_the_openai_completion_in_llama_cpps_shape(server):
    """The same greedy reply as /v1/completions, with llama.cpp's counts, stop type, tokens and timings."""
    body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    done = httpx.post(f"{server.url}/completion", json=body).json()
    openai = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True,
                                                              "return_token_ids": True}).json()["choices"][0]
    assert done["content"] == openai["text"] and done["tokens"] == openai["token_ids"]
    assert done["stop"] is True and done["stop_type"] == "limit" and done["stopping_word"] == ""
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    assert done["tokens_predicted"] == 8 and done["tokens_evaluated"] == len(prompt_ids)
    assert done["prompt"] == "Once upon a time" and done["generation_settings"]["n_predict"] == 8
    timings = done["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_n"] + done["tokens_cached"] == len(prompt_ids)
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0
    assert httpx.post(f"{server.url}/completions", json=body).json()["content"] == done["content"]  # the alias


def test_streamed_pieces_rebuild_the_reply_and_end_with_the_totals(server):
    body = {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/completion", json=body).json()
    events = _events(f"{server.url}/completion", {**body, "stream": True, "return_tokens": True})
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["tokens_predicted"] for e in events[:-1]] == list(range(1, 7))
    assert sum(len(e["tokens"]) for e in events[:-1]) == 6 and events[-1]["stop_type"] == "limit"


def test_stop_words_eos_and_the_whole_context(server):
    """stop_type: word (with the stopping word), eos, and limit at the end of the context for n_predict -1."""
    tok = server.state.serving.tokenizer
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    word = httpx.post(f"{server.url}/completion", json={"prompt": "x", "n_predict": 5, "ignore_eos": True,
                                                        "logit_bias": [[forced, 100]], "stop": ["nana ba"]}).json()
    assert word["stop_type"] == "word" and word["stopping_word"] == "nana ba" and word["content"] == " ba"
    eos = httpx.post(f"{server.url}/completion", json={"prompt": "x", "n_predict": 3,
                                                       "logit_bias": {str(tok.eos_token_id): 100}}).json()
    assert eos["stop_type"] == "eos" and eos["tokens_predicted"] == 1
    banned = httpx.post(f"{server.url}/completion", json={"prompt": "x", "n_predict": 3, "temperature": 0,
                                                          "logit_bias": [[forced, 100], [forced, False]]}).json()
    assert forced not in tok.encode(banned["content"], add_special_tokens=False)  # false bans the token
    full = httpx.post(f"{server.url}/completion", json={"prompt": "x", "n_predict": -1, "ignore_eos": True}).json()
    assert full["stop_type"] == "limit" and full["tokens_predicted"] + full["tokens_evaluated"] == 256


def test_n_predict_0_evaluates_the_prompt_and_returns_no_token(server):
    """llama-server's n_predict 0: the prompt goes into the cache, nothing is generated (it once meant "no limit" here
    and ran to the end of the context). A later request with that prompt finds it cached."""
    prompt = "A prompt that is only evaluated, " * 6
    body = {"prompt": prompt, "n_predict": 0, "return_tokens": True, "n_probs": 2}
    done = httpx.post(f"{server.url}/completion", json=body).json()
    assert done["content"] == "" and done["tokens"] == [] and done["tokens_predicted"] == 0
    assert done["stop_type"] == "limit" and done["completion_probabilities"] == []
    events = _events(f"{server.url}/completion", {**body, "stream": True})
    assert len(events) == 1 and events[0]["stop"] is True and events[0]["tokens_predicted"] == 0
    again = httpx.post(f"{server.url}/completion", json={"prompt": prompt, "n_predict": 1}).json()
    assert again["tokens_cached"] > 0 and again["tokens_predicted"] == 1


def test_n_probs_give_each_tokens_logprob_and_alternatives(server):
    done = httpx.post(f"{server.url}/completion", json={"prompt": "Hello", "n_predict": 4, "temperature": 0,
                                                        "n_probs": 3, "return_tokens": True}).json()
    probs = done["completion_probabilities"]
    assert [p["id"] for p in probs] == done["tokens"] and "".join(p["token"] for p in probs) == done["content"]
    for p in probs:
        tops = p["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert p["id"] == tops[0]["id"] and p["logprob"] == pytest.approx(tops[0]["logprob"])  # greedy: the best


def test_grammar_and_json_schema_constrain_the_reply(server):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    reply = httpx.post(f"{server.url}/completion", json={"prompt": "A city:", "n_predict": 30,
                                                         "json_schema": schema}).json()
    assert json.loads(reply["content"])["city"] in ("Paris", "Rome")
    for grammar in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):  # llama.cpp's GBNF, and Lark
        picked = httpx.post(f"{server.url}/completion", json={"prompt": "Yes or no?", "n_predict": 5,
                                                              "grammar": grammar}).json()
        assert picked["content"] in ("yes", "no"), picked


def test_apply_template_renders_the_chat_prompt(server):
    messages = [{"role": "user", "content": "Hi"}]
    rendered = httpx.post(f"{server.url}/apply-template", json={"messages": messages}).json()["prompt"]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert server.state.serving.tokenizer.decode(ids) == rendered and rendered.endswith("assistant\n")


@pytest.mark.parametrize("body, says", [
    ({"n_predict": 4}, "prompt"),
    ({"prompt": "x", "n_probs": 21}, "n_probs"),
    ({"prompt": "x", "logit_bias": [["hello", 1.0]]}, "logit_bias"),
    ({"prompt": "x", "n_predict": 300}, "max_model_len"),
    ({"prompt": "x", "grammar": "start: ("}, "grammar"),
])
def test_bad_requests_are_errors(server, body, says):
    reply = httpx.post(f"{server.url}/completion", json=body)
    assert reply.status_code == 400 and says in reply.text, reply.text


FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>")


@pytest.fixture(scope="module")
def coder(smol_dir, tmp_path_factory):
    """The tiny model with a code model's FIM tokens in its tokenizer (Qwen2.5-Coder's names)."""
    tok = AutoTokenizer.from_pretrained(smol_dir)
    tok.add_special_tokens({"additional_special_tokens": list(FIM)})
    tok_dir = tmp_path_factory.mktemp("fim-tokenizer")
    tok.save_pretrained(tok_dir)
    model_dir = make_tiny_model(tmp_path_factory.mktemp("fim-model"), tok_dir)
    with live_server(tiny_config(model_dir, max_model_len=256)) as live:
        yield live


def _fim_ids(tok, prefix: str, suffix: str, files=(), middle: str = "") -> list[int]:
    """Prefix-suffix-middle, as Qwen2.5-Coder is trained (each file behind <|file_sep|>)."""
    pre, suf, mid, sep = (tok.convert_tokens_to_ids(t) for t in FIM)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [i for name, text in files for i in [sep] + enc(f"{name}\n{text}")]
    return ids + [pre] + enc(prefix) + [suf] + enc(suffix) + [mid] + enc(middle)


def test_suffix_and_infill_fill_in_the_middle(coder):
    """OpenAI's completions `suffix` and llama-server's /infill give the reply to the FIM prompt a code model is
    trained on: the same greedy text as that prompt's token ids sent as they are."""
    tok = coder.state.serving.tokenizer
    greedy = {"temperature": 0, "ignore_eos": True}
    want = httpx.post(f"{coder.url}/v1/completions", json={
        "prompt": _fim_ids(tok, "def add(a, b):\n    ", "\n    return c"), "max_tokens": 6, **greedy}).json()
    filled = httpx.post(f"{coder.url}/v1/completions", json={
        "prompt": "def add(a, b):\n    ", "suffix": "\n    return c", "max_tokens": 6, **greedy}).json()
    assert filled["choices"][0]["text"] == want["choices"][0]["text"]
    assert filled["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    files = [("util.py", "def sub(a, b):\n    return a - b")]
    ids = _fim_ids(tok, "def add(a, b):\n    ", "\n    return c", files, middle="c =")
    infill = httpx.post(f"{coder.url}/infill", json={
        "input_prefix": "def add(a, b):\n    ", "input_suffix": "\n    return c", "prompt": "c =", "n_predict": 6,
        "input_extra": [{"filename": n, "text": t} for n, t in files], **greedy}).json()
    direct = httpx.post(f"{coder.url}/completion", json={"prompt": ids, "n_predict": 6, **greedy}).json()
    assert infill["content"] == direct["content"] and infill["tokens_evaluated"] == len(ids)


def test_a_model_without_fim_tokens_refuses_to_fill_in(server):
    for route, body in (("/v1/completions", {"prompt": "x", "suffix": "y"}),
                        ("/infill", {"input_prefix": "x", "input_suffix": "y"})):
        reply = httpx.post(f"{server.url}{route}", json=body)
        assert reply.status_code == 400 and "fill-in-the-middle" in reply.json()["error"]["message"]
    ids = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "suffix": "y"})
    assert ids.status_code == 400 and "text prompts" in ids.text


def test_llama_cpps_tokenize_detokenize_and_props_shapes(server):
    """llama-server's clients send /tokenize {"content", "add_special"} and read /detokenize's "content" and
    /props' context size and template; vLLM's shapes stay as they were."""
    vllm = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()
    llama = httpx.post(f"{server.url}/tokenize", json={"content": "Hello there", "add_special": False}).json()
    tok = server.state.serving.tokenizer
    assert llama["tokens"] == tok.encode("Hello there", add_special_tokens=False)
    assert vllm["count"] >= len(llama["tokens"])
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "content": "b"})
    assert both.status_code == 400 and "once" in both.json()["error"]["message"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": llama["tokens"]}).json()
    assert text["content"] == text["prompt"] == "Hello there"
    props = httpx.get(f"{server.url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 256 and props["total_slots"] >= 1
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8 and "{%" in props["chat_template"]
