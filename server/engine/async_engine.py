"""Asyncio front of the engine: the engine loop runs in its own thread; each request gets an output queue.

Requests and aborts cross into the engine thread through a lock-protected inbox that is drained
between steps, so the engine's state is only ever touched by its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.engine.sampling_params import SamplingParams
from server.engine.sequence import SeqOutput

if TYPE_CHECKING:  # a type only: the engine-process client imports this module without the engine's (torch's) imports
    from server.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running."""


# LLMEngine methods the API may call between steps (`call`): vLLM's runtime LoRA updates
ENGINE_CALLS = frozenset({"load_lora", "unload_lora"})


def run_engine_call(engine, method: str, args: tuple) -> tuple[object, Exception | None]:
    """engine.<method>(*args), one of ENGINE_CALLS, where the engine runs: (its result, None) or (None, the exception
    it raised, for the caller to raise)."""
    if method not in ENGINE_CALLS:
        return None, ValueError(f"{method} is not an engine call")
    try:
        return getattr(engine, method)(*args), None
    except Exception as exc:  # noqa: BLE001 - the caller's to report
        return None, exc


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """callback(*args) in `loop`, from another thread; nothing if that loop is closed (nobody is left to tell)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """Give an engine call's future its result or exception (in its loop), unless its caller gave up on it."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass
class _Pending:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int


class AsyncEngine:
    """Thread-hosted engine loop with per-request asyncio queues and abort on cancellation."""

    def __init__(self, engine: LLMEngine, max_queue: int, on_abort=None):
        self.engine = engine
        self.on_abort = on_abort  # called (in the engine thread) for each sequence ended because its client left
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_Pending] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[str, tuple, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead = False  # the loop has ended: requests are refused
        self.num_waiting = 0  # sequences waiting in the engine, read by metrics
        self.num_waiting_requests = 0  # requests waiting in the engine (n choices count once), for admission
        self.num_running = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._stop = self._dead = False
        self._thread = threading.Thread(target=self._loop, name="neuronmm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout)
        with self._lock:
            calls, self._calls = self._calls, []
        for _, _, loop, future in calls:  # never reached by the engine thread
            loop.call_soon_threadsafe(settle, future, None, EngineDeadError("engine stopped"))

    @property
    def is_alive(self) -> bool:
        return bool(self._thread and self._thread.is_alive()) and not self._dead

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int = 1,
               request_id: str | None = None) -> "RequestStream":
        """Admit a request now (QueueFullError if the queue is full); iterate the result for outputs."""
        if not self.is_alive:
            raise EngineDeadError("engine is not running")
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._dead:
                raise EngineDeadError("engine is not running")
            if self.num_waiting_requests + len(self._inbox) >= self.max_queue:
                raise QueueFullError(f"queue full ({self.max_queue} waiting requests)")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._inbox.append(_Pending(request_id, prompt_ids, params, n))
        self._wake.set()
        return RequestStream(self, request_id, queue, n)

    def release(self, request_id: str, abort: bool) -> None:
        """Stop routing outputs to a request; abort it in the engine if it has not finished."""
        with self._lock:
            self._queues.pop(request_id, None)
            if abort:
                self._aborts.append(request_id)
        self._wake.set()

    async def call(self, method: str, *args) -> object:
        """engine.<method>(*args) (one of ENGINE_CALLS) run by the engine thread between steps: its result, or the
        exception it raised, raised here."""
        if not self.is_alive:
            raise EngineDeadError("engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._dead:
                raise EngineDeadError("engine is not running")
            self._calls.append((method, args, loop, future))
        self._wake.set()
        return await future

    # ---- engine thread ---------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for method, args, loop, future in calls:
            loop.call_soon_threadsafe(settle, future, *run_engine_call(self.engine, method, args))
        # counted as the engine ends them: a request that finished as its client left is not also an abort
        aborted = sum(self.engine.abort(rid) for rid in aborts)
        for _ in range(aborted if self.on_abort else 0):
            self.on_abort()
        for p in inbox:
            if p.request_id in self._queues:  # not cancelled before it reached us
                try:
                    self.engine.add_request(p.request_id, p.prompt_ids, p.params, p.n)
                except Exception as exc:  # an uncaught one here would kill the loop and hang the clients
                    log.exception("could not add request %s", p.request_id)
                    self.engine.abort(p.request_id)
                    self._publish([SeqOutput.failed(p.request_id, f"engine error: {exc.__class__.__name__}: {exc}",
                                                    len(p.prompt_ids))])

    def _publish(self, outputs: list[SeqOutput]) -> None:
        with self._lock:
            targets = [(self._queues.get(o.request_id), o) for o in outputs]
        for target, out in targets:
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)

    def _update_counts(self) -> None:
        sched = self.engine.scheduler
        self.num_waiting, self.num_running = sched.num_waiting, sched.num_running
        self.num_waiting_requests = sched.num_waiting_requests

    def _loop(self) -> None:
        log.info("engine loop started")
        try:
            while not self._stop:
                self._drain_inbox()
                self._update_counts()
                if not self.engine.has_work():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception:  # a bug outside the forward: fail the running batch, keep the queue, keep going
                    log.exception("engine step failed")
                    outputs = self.engine.fail_running("engine step failed")
                self._publish(outputs)
        except Exception:  # (in an abort, say) the engine's state is unknown: stop, as a dead engine core does
            log.exception("engine loop failed")
        finally:
            # whoever still waits on this engine would wait forever: end their requests and calls with an error
            self._fail_all("engine error: the engine loop stopped")
        log.info("engine loop stopped")

    def _fail_all(self, message: str) -> None:
        """End every request and engine call still waiting on this engine with an error; refuse new ones."""
        with self._lock:
            self._dead = True  # (submit and call refuse from now on, before the thread has ended)
            queues, self._queues = self._queues, {}
            calls, self._calls = self._calls, []
        for rid, (loop, queue) in queues.items():
            error = SeqOutput.failed(rid, message)
            _call_soon(loop, queue.put_nowait, error)
        for _, _, loop, future in calls:
            _call_soon(loop, settle, future, None, EngineDeadError(message))


_CLOSED = object()  # queued by RequestStream.aclose: ends a read of the stream that another task still awaits


class RequestStream:
    """Async iterator over one request's outputs; `aclose()` (always call it) aborts unfinished work."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue, n: int):
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self._remaining = n
        self._closed = False
        self._failed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> SeqOutput:
        if self._remaining == 0 or self._closed:
            await self.aclose()
            raise StopAsyncIteration
        out: SeqOutput = await self._queue.get()
        if out is _CLOSED:
            raise StopAsyncIteration
        if out.finish_reason is not None:
            self._remaining -= 1
        if out.error:  # one failed choice fails the request (and aborts its other choices on close)
            self._failed = True
            self._remaining = 0
        return out

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.release(self.request_id, abort=self._remaining > 0 or self._failed)
            # Released, the engine sends nothing more here: a task still waiting on the queue (a sibling prompt's
            # reader when another prompt failed) would wait forever.
            self._queue.put_nowait(_CLOSED)
