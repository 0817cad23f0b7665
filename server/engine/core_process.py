"""The engine core's own side of its process: load the model, then take requests, step and report each step.

The API process talks to it through `server.engine.engine_core.EngineCoreClient`, which spawns it.
"""

from __future__ import annotations

import logging
import select
import signal

from server.config import Config, ConfigError
from server.engine.async_engine import run_engine_call
from server.engine.engine_core import SHUTDOWN_SIGNALS, AddRequest, StepReport
from server.engine.sequence import SeqOutput
from server.engine.step_stats import StepStats
from server.gc_heap import startup_heap
from server.runtime import load_runtime

log = logging.getLogger(__name__)


def core_main(cfg: Config, conn) -> None:
    """Child process: load, warm, then loop: take requests, step, report; until told to stop or the API is gone."""
    # The API process owns shutdown: it drains its in-flight requests, then sends "stop". A terminal's Ctrl+C (and a
    # service manager's SIGTERM to the whole process group) reaches this process too, and dying here would fail the
    # requests being drained (and print a KeyboardInterrupt from wherever the loop was). They were blocked since
    # this process began (EngineCoreClient.spawn), its imports included; ignored now, a pending one is dropped.
    for sig in SHUTDOWN_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHUTDOWN_SIGNALS)
    logging.basicConfig(level=cfg.server.log_level.upper(), format="%(levelname)s engine-core: %(message)s")
    try:
        with startup_heap("engine core"):
            runtime = load_runtime(cfg)
    except ConfigError as exc:  # the configuration's mistake: the parent stops `neuronmm serve` with it
        conn.send(("config_error", str(exc)))
        return
    except Exception as exc:  # the parent reports it on /health
        conn.send(("load_error", f"{exc.__class__.__name__}: {exc}"))
        return
    engine = runtime.engine
    stats: list[StepStats] = []
    engine.observers.append(stats.append)
    try:
        _serve_requests(engine, conn, stats)
    except (EOFError, BrokenPipeError):  # the API process is gone (killed): nobody to serve
        log.info("the API process closed its pipe: exiting")


def _serve_requests(engine, conn, stats: list[StepStats]) -> None:
    """Say ready, then take requests, step and report each step until "stop" (EOFError: the pipe closed)."""
    conn.send(("ready", None))
    last_counts = None
    aborted = 0  # sequences client aborts ended since the last report (the metrics count them from the report)
    added = 0  # requests read from the API process (each report says how many: the client's admission counts)
    # what the API process sent, asked after every step: Connection.poll builds and drops a selector each time
    # (~60 us a step, between forwards)
    incoming = select.poll()
    incoming.register(conn.fileno(), select.POLLIN)
    while True:
        if not engine.has_work():
            incoming.poll(500)
        while incoming.poll(0):
            kind, payload = conn.recv()
            if kind == "stop":
                return
            if kind == "abort":
                aborted += engine.abort(payload)
            elif kind == "call":  # (token, method, args): the result or exception goes back under the token
                token, method, args = payload
                conn.send(("reply", (token, *run_engine_call(engine, method, args))))
            else:
                added += 1
                _add(engine, conn, payload, added)
        if not engine.has_work():
            if _counts(engine) != last_counts or aborted:  # an abort emptied the batch: say so, no step will
                last_counts = _counts(engine)
                conn.send(("step", StepReport([], None, *last_counts, aborted, added).to_wire()))
                aborted = 0
            continue
        try:
            outputs = engine.step()
        except Exception:  # a bug outside the forward: fail the running batch, keep the queue
            log.exception("engine step failed")
            outputs = engine.fail_running("engine step failed")
        last_counts = _counts(engine)
        conn.send(("step", StepReport(outputs, stats.pop() if stats else None, *last_counts, aborted,
                                      added).to_wire()))
        aborted = 0


def _counts(engine) -> tuple[int, int, int]:
    sched = engine.scheduler
    return sched.num_waiting, sched.num_running, sched.num_waiting_requests


def _add(engine, conn, add: AddRequest, added: int) -> None:
    try:
        engine.add_request(add.request_id, add.prompt_ids, add.params, add.n)
    except Exception as exc:  # report to its client instead of killing the loop
        log.exception("could not add request %s", add.request_id)
        engine.abort(add.request_id)
        error = SeqOutput.failed(add.request_id, f"engine error: {exc.__class__.__name__}: {exc}",
                                 len(add.prompt_ids))
        conn.send(("step", StepReport([error], None, *_counts(engine), num_added=added).to_wire()))
