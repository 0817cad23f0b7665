"""The cyclic collector around a server process's start-up: held off while it starts, then the heap frozen."""

from __future__ import annotations

import gc
import multiprocessing as mp
import signal

import pytest
from fastapi.testclient import TestClient

from server.api import app as app_module
from server.api.app import create_app
from server.engine.core_process import core_main
from server.engine.engine_core import SHUTDOWN_SIGNALS
from server.gc_heap import collections_held, freeze_heap, startup_heap
from server.runtime import load_runtime
from support import tiny_config, wait_for


def _cycle() -> None:
    a = []
    a.append(a)  # reachable only from itself: only the cyclic collector frees it


def test_startup_heap_holds_collections_then_freezes_what_survived():
    kept = [[] for _ in range(100)]
    with startup_heap("test"):
        assert not gc.isenabled()
        _cycle()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)
    assert gc.collect() == 0  # the start-up's garbage went in the collection before the freeze


def test_startup_heap_freezes_and_turns_the_collector_on_when_start_up_fails():
    with pytest.raises(RuntimeError), startup_heap("test"):
        raise RuntimeError("load failed")
    assert gc.isenabled() and gc.get_freeze_count() > 0


def test_collections_held_until_a_freeze_inside_or_the_end():
    with collections_held():
        assert not gc.isenabled()
        freeze_heap("test")  # a start-up that ends inside the block turns the collector on there
        assert gc.isenabled()
    with pytest.raises(ValueError), collections_held():
        raise ValueError("bad config")  # a start that stops early leaves the collector on
    assert gc.isenabled()


def test_the_server_process_freezes_its_heap_once_loaded(tiny_model_dir):
    app = create_app(tiny_config(tiny_model_dir), load_runtime, freeze_startup_heap=True)
    with collections_held(), TestClient(app) as client:  # collections_held: as `neuronmm serve` starts it
        state = app.state.neuronmm
        wait_for(lambda: state.ready)
        assert client.get("/health").status_code == 200
        assert gc.isenabled() and gc.get_freeze_count() > 0


def test_a_failed_load_still_freezes_and_turns_the_collector_back_on(tiny_model_dir):
    def broken(_cfg):
        raise RuntimeError("no model")

    app = create_app(tiny_config(tiny_model_dir), broken, freeze_startup_heap=True)
    with collections_held(), TestClient(app) as client:
        state = app.state.neuronmm
        wait_for(lambda: state.load_error and gc.isenabled())
        assert state.load_error == "RuntimeError: no model"
        assert client.get("/health").status_code == 503
        assert gc.isenabled() and gc.get_freeze_count() > 0


def test_engine_core_freezes_its_start_up_heap_before_it_serves(tiny_model_dir):
    parent, child = mp.Pipe()
    parent.send(("stop", None))  # read once the core is loaded: it answers "ready" first, then returns
    # core_main ignores SIGINT and SIGTERM, as an engine core does; here it runs in pytest, whose later children
    # (stand-in servers, bench subprocesses) would inherit the ignored signals and outlive their terminate()
    saved = {sig: signal.getsignal(sig) for sig in SHUTDOWN_SIGNALS}
    try:
        core_main(tiny_config(tiny_model_dir), child)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert parent.recv() == ("ready", None)
    assert gc.isenabled() and gc.get_freeze_count() > 0


class _FakeCore:
    """Stands in for EngineCoreClient: records the calls, and what the API's heap was when the core was waited on."""

    def __init__(self, fail: bool):
        self.calls, self.fail, self.frozen_at_wait = [], fail, None

    def __call__(self, cfg, on_abort=None, on_step=None):
        return self

    def spawn(self):
        self.calls.append("spawn")

    def wait_ready(self, loop):
        self.calls.append("wait_ready")
        self.frozen_at_wait = gc.get_freeze_count()
        if self.fail:
            raise RuntimeError("engine core exited with code 1 while loading")

    def stop(self):
        self.calls.append("stop")


@pytest.mark.parametrize("fail", [False, True])
def test_the_api_spawns_the_core_then_freezes_its_heap_while_the_core_loads(tiny_model_dir, monkeypatch, fail):
    core = _FakeCore(fail)
    monkeypatch.setattr(app_module, "EngineCoreClient", core)
    monkeypatch.setattr(app_module.AppState, "_serve_with", lambda self, engine, tokenizer, model_dir: None)
    state = app_module.AppState(tiny_config(tiny_model_dir), freeze_startup_heap=True)
    with collections_held():
        if fail:
            with pytest.raises(RuntimeError, match="while loading"):
                state.start_engine_process(loop=None)
        else:
            state.start_engine_process(loop=None)
        assert gc.isenabled()  # the API's start-up ended at the freeze, before the core was ready
    assert core.frozen_at_wait > 0
    assert core.calls == ["spawn", "wait_ready"] + (["stop"] if fail else [])
