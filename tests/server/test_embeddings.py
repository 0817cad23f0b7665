"""POST /v1/embeddings: each input's last hidden state (after the final norm), as transformers computes it."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.backends.torch_runner import TorchRunner
from server.engine.sampling_params import SamplingParams
from server.runtime import build_engine, eos_token_ids, load_tokenizer
from support import live_server, tiny_config

TEXTS = ["The capital of France is Paris.", "def add(a, b): return a + b", "x"]


def _hf_last_states(model_dir, tok, texts: list[str]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([hf.model(torch.tensor([tok.encode(t)])).last_hidden_state[0, -1] for t in TEXTS])


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> torch.Tensor:
    return _hf_last_states(tiny_model_dir, load_tokenizer(tiny_model_dir), TEXTS)


def test_the_engine_pools_the_last_hidden_state_beside_generating_requests(tiny_model_dir, expected):
    tok = load_tokenizer(tiny_model_dir)
    runner = TorchRunner(tiny_model_dir, 256, "float32")
    runner.load()
    engine = build_engine(tiny_config(tiny_model_dir), runner, tok, eos_token_ids(tiny_model_dir, tok))
    embed = SamplingParams(max_tokens=1, temperature=0.0, embed=True)
    engine.add_request("gen", tok.encode("Once upon a time"), SamplingParams(max_tokens=6, temperature=0.0))
    for i, text in enumerate(TEXTS):
        engine.add_request(f"e{i}", tok.encode(text), embed)
    engine.add_request("again", tok.encode(TEXTS[0]), embed)  # its prompt's blocks come from the prefix cache
    outputs = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    for i in range(len(TEXTS)):
        (out,) = outputs[f"e{i}"]
        assert out.finish_reason == "stop" and out.token_ids == [] and out.num_output_tokens == 0
        torch.testing.assert_close(torch.tensor(out.embedding), expected[i], atol=1e-4, rtol=1e-4)
    assert outputs["again"][0].embedding == outputs["e0"][0].embedding
    assert sum(len(o.token_ids) for o in outputs["gen"]) == 6  # the generating request went on undisturbed


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def server(request, tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    cfg.model.dtype = "float32"  # (auto is bf16 on a CPU with native bf16: compared with HF in fp32 here)
    with live_server(cfg, engine_process=request.param) as live:
        yield live


def test_the_official_client_gets_normalised_vectors(server, expected):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    resp = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == "tiny"
    got = torch.tensor([d.embedding for d in resp.data])
    torch.testing.assert_close(got, torch.nn.functional.normalize(expected, dim=-1), atol=1e-4, rtol=1e-4)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > 3
    # the client's default asks for base64 (little-endian float32) and decodes it back
    torch.testing.assert_close(torch.tensor([d.embedding for d in client.embeddings.create(
        model="tiny", input=TEXTS).data]), got)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(decoded.copy()), got[2])


def test_dimensions_token_ids_and_raw_states(server, tiny_model_dir, expected):
    tok = load_tokenizer(tiny_model_dir)
    short = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[0], "dimensions": 16}).json()
    vector = torch.tensor(short["data"][0]["embedding"])
    assert vector.shape == (16,) and abs(vector.norm().item() - 1) < 1e-5
    torch.testing.assert_close(vector, torch.nn.functional.normalize(expected[0, :16], dim=-1), atol=1e-4, rtol=1e-4)
    by_ids = httpx.post(f"{server.url}/v1/embeddings", json={
        "input": [tok.encode(TEXTS[1])], "normalize": False}).json()
    torch.testing.assert_close(torch.tensor(by_ids["data"][0]["embedding"]), expected[1], atol=1e-4, rtol=1e-4)


def test_a_backend_without_embeddings_answers_400(server):
    server.state.serving.serves_embeddings = False  # as under the neuron backend
    try:
        resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"})
    finally:
        server.state.serving.serves_embeddings = True
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "embeddings_not_supported"


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": "word " * 400}, "input"),  # over max_model_len (256)
    ({"input": [[1, 2, 10**9]]}, "input"),
    ({"input": "x", "dimensions": 65}, "dimensions"),  # the tiny model's hidden size is 64
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "other"}, None),
])
def test_bad_requests_are_openai_errors(server, body, param):
    resp = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert resp.status_code in (400, 404), resp.text
    error = resp.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_score_is_the_cosine_similarity_of_the_embeddings(server, expected):
    """vLLM's /score for an embedding model: text_1 against each text_2, or the lists pair by pair, each score the
    cosine of the two texts' embeddings (transformers' last hidden states here)."""
    unit = torch.nn.functional.normalize(expected, dim=-1)
    one_to_many = httpx.post(f"{server.url}/score", json={"model": "tiny", "text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert one_to_many["object"] == "list" and one_to_many["id"].startswith("score-")
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([d["score"] for d in one_to_many["data"]]), unit @ unit[0],
                               atol=1e-4, rtol=1e-4)
    assert one_to_many["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)  # a text against itself
    pairwise = httpx.post(f"{server.url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in pairwise["data"]]),
                               torch.stack([unit[0] @ unit[1], unit[1] @ unit[2]]), atol=1e-4, rtol=1e-4)
    assert pairwise["usage"]["prompt_tokens"] == pairwise["usage"]["total_tokens"] > 0
    mismatched = httpx.post(f"{server.url}/score", json={"text_1": TEXTS[:2], "text_2": TEXTS})
    assert mismatched.status_code == 400 and "same length" in mismatched.json()["error"]["message"]
    blank = httpx.post(f"{server.url}/score", json={"text_1": "x", "text_2": ["y", ""]})
    assert blank.status_code == 400 and "text_2 must not hold an empty text" in blank.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_similarity(server, expected, route):
    """Jina's and Cohere's rerank shape: results best first, top_n of them, each with its index and document."""
    unit = torch.nn.functional.normalize(expected, dim=-1)
    want = (unit[1:] @ unit[0]).tolist()
    reply = httpx.post(f"{server.url}{route}", json={"model": "tiny", "query": TEXTS[0], "documents": TEXTS[1:],
                                                     "top_n": 1}).json()
    best = max(range(2), key=lambda i: want[i])
    assert [r["index"] for r in reply["results"]] == [best]
    assert reply["results"][0]["document"]["text"] == TEXTS[1 + best]
    assert reply["results"][0]["relevance_score"] == pytest.approx(want[best], abs=1e-4)
    every = httpx.post(f"{server.url}{route}", json={"query": TEXTS[0], "documents": TEXTS[1:],
                                                     "return_documents": False}).json()
    assert [r["index"] for r in every["results"]] == sorted(range(2), key=lambda i: -want[i])
    assert all(r["document"] is None for r in every["results"]) and every["usage"]["total_tokens"] > 0
    empty = httpx.post(f"{server.url}{route}", json={"query": "x", "documents": []})
    assert empty.status_code == 400
    blank = httpx.post(f"{server.url}{route}", json={"query": "x", "documents": ["y", ""]})
    assert blank.status_code == 400 and "empty text" in blank.json()["error"]["message"]
