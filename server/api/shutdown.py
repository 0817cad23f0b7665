"""Graceful shutdown: drain in-flight requests on the first SIGTERM/SIGINT, exit at once on the second.

uvicorn's own handling closes the listening socket at the first signal (new clients get "connection
refused", not a 503), gives in-flight work one fixed timeout and then re-raises the signal, so the
process never exits 0. This server keeps the socket open while it drains so new requests get an
OpenAI-style 503, waits for in-flight generation requests up to `grace_s`, then shuts down and returns.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Generator

import uvicorn

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After the drain, what is left (idle keep-alive connections, cut-off requests) gets this long.
_FINAL_TIMEOUT_S = 1.0


class GracefulServer(uvicorn.Server):
    """uvicorn.Server with a drain phase bounded by `grace_s`; `state` is the app's AppState."""

    def __init__(self, config: uvicorn.Config, state, grace_s: float):
        config.timeout_graceful_shutdown = _FINAL_TIMEOUT_S
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.drain_deadline: float | None = None
        self.drain_started: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Unlike uvicorn's, the captured signal is not re-raised afterwards: a drained shutdown exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        """First signal: start draining. The default action is restored, so a second one ends the process."""
        for s in _SIGNALS:
            # SIG_DFL acts in the kernel, so the second signal works even while Python is busy
            signal.signal(s, signal.SIG_DFL)
        self.begin_drain(signal.Signals(sig).name)

    def begin_drain(self, reason: str = "request") -> None:
        """Refuse new generation requests (503) and exit once in-flight ones finish or grace_s passes."""
        if self.drain_deadline is not None:
            return
        self.state.draining = True
        self.drain_started = time.monotonic()
        self.drain_deadline = self.drain_started + self.grace_s
        log.info("%s: draining %d in-flight request(s), grace period %.1f s (send it again to exit now)",
                 reason, self.state.num_active, self.grace_s)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            active = self.state.num_active
            if active == 0 or time.monotonic() >= self.drain_deadline:
                if active:
                    log.warning("grace period over: cutting off %d request(s)", active)
                log.info("drained in %.2f s", time.monotonic() - self.drain_started)
                self.should_exit = True
        return await super().on_tick(counter)
