"""API key on every endpoint but /health, /version and /metrics (as vLLM; constant-time, never logged);
CORS off by default, on by config."""

from __future__ import annotations

import logging

import httpx
import pytest

import server.api.app as app_module
from support import live_server, tiny_config

KEY = "sk-neuronmm-" + "c0ffee42" * 4
ORIGIN = "https://chat.example.com"
ENDPOINTS = [("GET", "/v1/models"), ("GET", "/openapi.json"), ("GET", "/docs"),
             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/no/such/path")]
BODIES = {"/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
          "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    cfg.server.api_key = KEY
    cfg.server.cors_origins = [ORIGIN]
    with live_server(cfg) as live:
        yield live


@pytest.fixture(scope="module")
def open_server(tiny_model_dir):
    with live_server(tiny_config(tiny_model_dir)) as live:
        yield live


def _call(live, method: str, path: str, headers: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"{live.url}{path}", json=BODIES.get(path), headers=headers or {}, timeout=30)


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY,
                                  f"Basic {KEY}", "Bearer", f"Bearer {KEY.upper()}"])
@pytest.mark.parametrize("method, path", ENDPOINTS)
def test_every_endpoint_but_health_metrics_and_version_needs_the_key(keyed, method, path, auth):
    resp = _call(keyed, method, path, {"Authorization": auth} if auth else None)
    assert resp.status_code == 401
    err = resp.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
    assert resp.headers["www-authenticate"] == "Bearer"
    assert KEY not in resp.text


@pytest.mark.parametrize("method, path", ENDPOINTS)
@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_the_right_key_opens_every_endpoint(keyed, method, path, scheme):
    resp = _call(keyed, method, path, {"Authorization": f"{scheme} {KEY}"})
    assert resp.status_code == (404 if path == "/no/such/path" else 200), resp.text[:200]


def test_health_version_and_metrics_are_open(keyed):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 200
    assert httpx.post(f"{keyed.url}/tokenize", json={"prompt": "x"}).status_code == 401


def test_metrics_behind_the_key_when_configured(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    cfg.server.api_key = KEY
    cfg.server.metrics_require_api_key = True
    with live_server(cfg) as live:
        assert httpx.get(f"{live.url}/metrics").status_code == 401
        assert httpx.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_keys_are_compared_in_constant_time(keyed, monkeypatch):
    calls = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    assert _call(keyed, "GET", "/v1/models", {"Authorization": "Bearer nope"}).status_code == 401
    assert _call(keyed, "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert _call(keyed, "GET", "/v1/models", {"x-api-key": "nope"}).status_code == 401  # Anthropic's header
    assert _call(keyed, "GET", "/v1/models", {"x-api-key": KEY}).status_code == 200
    # every header a request brings is compared with the key, each in constant time (a bearer key, then x-api-key)
    assert [a for a, _ in calls] == [b"nope", b"", KEY.encode(), b"", b"nope", b"", KEY.encode()]
    assert all(b == KEY.encode() for _, b in calls)


def test_key_never_logged(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    # uvicorn's loggers do not propagate to the root logger, so listen on them directly
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.access", "uvicorn.error")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(caplog.handler)
        lg.setLevel(logging.DEBUG)
    try:
        for auth in (f"Bearer {KEY}", f"Bearer {KEY}x", KEY):
            for method, path in ENDPOINTS:
                _call(keyed, method, path, {"Authorization": auth})
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(caplog.handler)
            lg.setLevel(level)
    messages = [r.getMessage() for r in caplog.records]
    assert any("/v1/models" in m and r.name == "uvicorn.access" for m, r in zip(messages, caplog.records))
    assert not [m for m in messages if KEY[:20] in m]


def test_cors_is_off_by_default(open_server):
    preflight = httpx.options(f"{open_server.url}/v1/completions",
                              headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code == 405 and preflight.json()["error"]
    resp = httpx.get(f"{open_server.url}/v1/models", headers={"Origin": ORIGIN})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_cors_when_configured(keyed):
    preflight = httpx.options(f"{keyed.url}/v1/chat/completions",
                              headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200  # answered before the key check: browsers send no key here
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    ok = httpx.get(f"{keyed.url}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.get(f"{keyed.url}/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{keyed.url}/v1/models", headers={"Origin": "https://evil.example",
                                                         "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in other.headers
    bad_preflight = httpx.options(f"{keyed.url}/v1/models", headers={"Origin": "https://evil.example",
                                                                     "Access-Control-Request-Method": "GET"})
    assert bad_preflight.status_code == 400 and "access-control-allow-origin" not in bad_preflight.headers
