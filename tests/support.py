"""Test helpers shared by several folders: a Config for the tiny model, a live uvicorn server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace


def tiny_config(model_dir: Path, **engine):
    """A Config serving the tiny model from safetensors, with engine overrides."""
    from server.config import Config

    limits = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256, "max_queue": 16,
              "num_threads": 1}
    limits.update(engine)
    return Config.model_validate({
        "model": {"name": "tiny", "source": "safetensors", "path": str(model_dir)},
        "engine": limits, "server": {"port": 0}})


@contextmanager
def live_server(cfg, loader: Callable | None = None, ready_timeout: float = 60.0) -> Iterator[SimpleNamespace]:
    """Run the app under a real uvicorn on 127.0.0.1 (free port); yields (url, app) once /health is 200."""
    import httpx
    import uvicorn

    from server.api.app import create_app
    from server.runtime import load_runtime

    app = create_app(cfg, loader or load_runtime)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    else:
        server.should_exit = True
        raise RuntimeError("server did not become healthy")
    try:
        yield SimpleNamespace(url=base, app=app, state=app.state.neuronmm)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
