"""The engine in its own process (as vLLM runs its engine core), so HTTP work never takes the engine's GIL.

Why: in one process the event loop and the engine thread share a GIL, and the engine re-takes it after
every op; each streamed chunk the loop writes delays the forward (served steps were 40-67 % slower than
the engine alone). Here the API process keeps only the tokenizer; the child loads the model, runs the
scheduler and sends each step's outputs back in one message over a pipe.

`EngineCoreClient` has the interface of `AsyncEngine` (submit / release / start / stop / counts), so
the serving layer does not know which one it talks to. This module is the API process's side and imports no
torch: `neuronmm serve` spawns the core before it imports the rest of the server, and the core's imports and load
(`server.engine.core_process`) run on the other CPU core meanwhile.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import signal
import time
import uuid
from dataclasses import dataclass, fields
from multiprocessing import resource_tracker
from operator import attrgetter

from server.config import Config, ConfigError
from server.engine.async_engine import EngineDeadError, QueueFullError, RequestStream, settle
from server.engine.loop_pipe import LoopPipe
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import SeqOutput
from server.engine.step_stats import KVStats, LoraStats, StepStats

log = logging.getLogger(__name__)


@dataclass
class AddRequest:
    """A request for the core, as the API process sends it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int


@dataclass
class StepReport:
    """One engine step, as the child reports it: outputs, the step's stats, the queue state after it.

    It crosses the pipe as plain tuples (`to_wire`, `from_wire`), not as pickled dataclasses: unpickling one looks
    up its class by module and name and rebuilds it from a dict of its fields, and in a process whose caches the
    engine's weight stream has just emptied that took ~110 us a step against ~25 us for the same values in tuples
    (on each side of the pipe, once a token at c=1).
    """

    outputs: list[SeqOutput]
    stats: StepStats | None
    num_waiting: int
    num_running: int
    num_waiting_requests: int
    num_aborted: int = 0  # sequences the core ended for clients that left, since its last report
    num_added: int = 0  # requests the core has read from the API process so far (its adds in transit are the rest)

    def to_wire(self) -> tuple:
        """The report as tuples of its records' fields (what `from_wire` takes)."""
        return ([_output_fields(out) for out in self.outputs], _stats_to_wire(self.stats), self.num_waiting,
                self.num_running, self.num_waiting_requests, self.num_aborted, self.num_added)

    @classmethod
    def from_wire(cls, wire: tuple) -> StepReport:
        """The report `to_wire` gave."""
        outputs, stats, *counts = wire
        return cls([SeqOutput(*values) for values in outputs], _stats_from_wire(stats), *counts)


def _getter(record: type) -> attrgetter:
    """A record's fields as a tuple in declaration order (its constructor's positional order)."""
    return attrgetter(*(f.name for f in fields(record)))


_output_fields, _stats_fields, _kv_fields, _lora_fields = map(_getter, (SeqOutput, StepStats, KVStats, LoraStats))


def _stats_to_wire(stats: StepStats | None) -> tuple | None:
    if stats is None:
        return None
    *head, kv, padding, lora = _stats_fields(stats)
    return (*head, kv and _kv_fields(kv), padding, lora and _lora_fields(lora))


def _stats_from_wire(wire: tuple | None) -> StepStats | None:
    if wire is None:
        return None
    *head, kv, padding, lora = wire
    return StepStats(*head, kv and KVStats(*kv), padding, lora and LoraStats(*lora))


SHUTDOWN_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the API process handles them (drains); the core ignores them


def _run_core(cfg: Config, conn) -> None:
    """The core process's entry point. The engine's modules (torch, the model, the backends: seconds of imports) are
    imported here, in the core, so the API process can spawn it before it has imported them itself."""
    from server.engine.core_process import core_main  # (tests/test_import_graph.py: PROCESS_ENTRY_POINTS)

    core_main(cfg, conn)


class EngineCoreClient:
    """API-process side: spawns the engine core, routes its outputs to per-request asyncio queues.

    Everything but `start` runs in the event loop's thread, which also reads the core's reports.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.max_queue = cfg.engine.max_queue
        # Set by the app that serves from this core (it may be spawned before the app exists), both run in the loop:
        self.on_abort = None  # called for each sequence the core ended because its client left
        self.on_step = None  # called with each step's StepStats
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[str, asyncio.Future] = {}  # engine calls sent, by token, until the core replies
        self._num_sent = 0  # requests sent to the core; those it has not read yet wait too (admission counts them)
        self._num_read = 0  # of those, how many the core had read at its last report
        self._proc = None
        self._conn = None
        self._pipe: LoopPipe | None = None  # the loop's end of _conn's socket, once the core is ready
        self._loop: asyncio.AbstractEventLoop | None = None  # reads the core's reports (from start on)
        self._reading = False  # until the core's pipe closes
        self._stopping = False
        self.num_waiting = 0
        self.num_running = 0
        self.num_waiting_requests = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the core process; it imports and loads while this process goes on (`wait_ready` joins it)."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited OpenMP pool or event loop
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_run_core, args=(self.cfg, child), name="neuronmm-engine-core", daemon=True)
        # Born with SIGINT and SIGTERM blocked (a signal mask survives the exec), so a Ctrl+C during its imports
        # cannot interrupt it either: _core_main then ignores them (shutdown is this process's). The resource
        # tracker is started first: starting it unblocks both in this thread, which would undo the block.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        # A core that ignores SIGTERM outlives multiprocessing's exit handler (terminate, then join: forever) if
        # this process exits without stop(); this handler, registered later, runs first.
        atexit.register(self._kill)

    def wait_ready(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None = None) -> None:
        """Block until the spawned core's model is loaded and warm (ConfigError for the configuration's mistake,
        RuntimeError for any other failure).

        Its reports are then read by `loop` itself, when the pipe is readable (a LoopPipe): a reader thread would wake
        once per step and hand each step to the loop through its self-pipe, two more wake-ups per token,
        each of which preempts an engine thread on a machine whose cores the engine keeps busy.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"engine core exited with code {self._proc.exitcode} while loading")
            if deadline and time.monotonic() > deadline:
                raise RuntimeError("engine core did not become ready in time")
        kind, payload = self._conn.recv()
        if kind == "config_error":
            raise ConfigError(payload)
        if kind != "ready":
            raise RuntimeError(payload)
        self._loop = loop
        self._reading = True
        loop.call_soon_threadsafe(self._attach)

    def _attach(self) -> None:
        if self._reading and self._pipe is None:
            self._pipe = LoopPipe(self._conn.fileno(), self._loop, self._on_message, self._on_closed)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the core: told to, once it serves (its loop reads "stop" between steps); killed if it is still
        loading (it reads nothing until ready, and there is nothing to drain) or does not stop within `timeout`."""
        if self._proc is None:
            return
        self._stopping = True
        serving = self._loop is not None
        if serving and self._reading:
            try:
                self._send(("stop", None))
            except EngineDeadError:
                pass
        self._reading = False
        if self._pipe is not None:
            self._pipe.close()  # (writes what the socket had not taken yet: the "stop" among it)
        if serving:
            self._proc.join(timeout)
        self._kill(timeout)

    def _kill(self, timeout: float = 5.0) -> None:
        """SIGKILL the core if it is still running (it ignores SIGTERM: see core_process.core_main)."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)

    @property
    def pid(self) -> int | None:
        """The core process's id (None before spawn)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def is_alive(self) -> bool:
        return bool(self._proc and self._proc.is_alive() and self._reading)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int = 1,
               request_id: str | None = None) -> RequestStream:
        """Admit a request now (QueueFullError if the queue is full); iterate the result for outputs."""
        if not self.is_alive:
            raise EngineDeadError("engine is not running")
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        if self.num_waiting_requests + self._num_sent - self._num_read >= self.max_queue:
            raise QueueFullError(f"queue full ({self.max_queue} waiting requests)")
        self._queues[request_id] = queue
        self._send(("add", AddRequest(request_id, prompt_ids, params, n)))
        self._num_sent += 1
        return RequestStream(self, request_id, queue, n)

    def release(self, request_id: str, abort: bool) -> None:
        """Stop routing outputs to a request; abort it in the engine if it has not finished (the core counts what
        it ended: a request that finished as its client left is not also an abort)."""
        self._queues.pop(request_id, None)
        if abort:
            try:
                self._send(("abort", request_id))
            except EngineDeadError:
                pass

    async def call(self, method: str, *args) -> object:
        """engine.<method>(*args) (one of ENGINE_CALLS) run by the core between steps: its result, or the exception
        it raised, raised here."""
        if not self.is_alive:
            raise EngineDeadError("engine is not running")
        token = uuid.uuid4().hex
        future = self._calls[token] = asyncio.get_running_loop().create_future()
        try:
            self._send(("call", (token, method, args)))
            return await future
        finally:
            self._calls.pop(token, None)

    def _send(self, message) -> None:
        try:
            if self._pipe is not None:
                self._pipe.send(message)
            else:  # (before the loop took the pipe over)
                self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise EngineDeadError(f"engine core is gone: {exc}") from exc

    # ---- reading the core's reports (in the event loop) --------------------------------------
    def _on_message(self, message) -> None:
        kind, report = message
        if kind == "step":
            self._deliver(StepReport.from_wire(report))
        elif kind == "reply":  # (token, result, exception)
            token, result, error = report
            if token in self._calls:
                settle(self._calls[token], result, error)

    def _on_closed(self, exc: BaseException | None) -> None:
        self._reading = False
        if not self._stopping:
            log.error("engine core exited (code %s%s); failing in-flight requests", self._proc.exitcode,
                      f", {exc}" if exc else "")
        self._fail_all("engine error: the engine process exited")

    def _deliver(self, report: StepReport) -> None:
        self.num_waiting, self.num_running = report.num_waiting, report.num_running
        # the core's counts hold what it had read when it sent this; a request sent during its step is still in
        # transit, and waits as much as those it counts
        self.num_waiting_requests, self._num_read = report.num_waiting_requests, report.num_added
        for out in report.outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if report.stats is not None and self.on_step:
            self.on_step(report.stats)
        for _ in range(report.num_aborted if self.on_abort else 0):
            self.on_abort()

    def _fail_all(self, message: str) -> None:
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(SeqOutput.failed(rid, message))
        for future in self._calls.values():
            settle(future, None, EngineDeadError(message))
