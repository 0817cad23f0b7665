"""A rolling restart under load loses nothing: two `neuronmm serve` replicas on loopback behind nginx, routed
as the Ingress in docker/k8s routes (docker/k8s/loopback/nginx.conf: passive health checks, a request
refused with 503 or a failed connection passes to the other replica), bench/load.py's client driving
it while each replica in turn gets SIGTERM, drains, exits 0 and comes back on its port.

Every request must end as 200, 429 / 503 (which a client retries) or the client's own planned hang-up;
none lost, none past the timeout, none cut by a transport error; each replica had requests in flight
when it was signalled and finished them (exit 0, no grace-period cut-off); nginx logged every request.
Needs the nginx binary (Debian: nginx or nginx-light), which CI does not install: there it skips.
Run it (about a minute here; numbers in docs/RELIABILITY.md, section 9):

    .venv/bin/python -m pytest -q -s tests/reliability/test_rolling_restart.py
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import REPO, ServerProcess, free_port, write_config
from bench.load import run_load

pytestmark = pytest.mark.slow

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
TEMPLATE = REPO / "docker" / "k8s" / "loopback" / "nginx.conf"
GRACE_S = 30.0
CONCURRENCY = 16
BATCH = 100          # the load runs in batches of this many until both restarts are done
REQUEST_TIMEOUT_S = 60.0
SETTLE_S = 4.0       # load before the first signal and after each replica is back (> nginx fail_timeout)
ACCEPTED = {"ok", "429", "http_503", "disconnect"}

if NGINX is None:
    pytest.skip("nginx not installed (Debian: apt-get install nginx-light)", allow_module_level=True)


def _waiting_metric() -> str:
    """The series the autoscaler's prometheus-adapter rule reads (docker/k8s/prometheus-adapter/values.yaml)."""
    (rule,) = yaml.safe_load((REPO / "docker/k8s/prometheus-adapter/values.yaml").read_text())["rules"]["custom"]
    return rule["seriesQuery"].split("{")[0]


def Replica(config: Path, port: int, log_path: Path) -> ServerProcess:
    """`neuronmm serve` on a fixed loopback port, so a restarted replica comes back where nginx routes."""
    return ServerProcess(config, log_path, num_threads=1, port=port, stop_timeout=GRACE_S + 10)


class Nginx:
    """nginx with docker/k8s/loopback/nginx.conf in a private prefix, in the foreground (daemon off)."""

    def __init__(self, prefix: Path, ports: tuple[int, int]):
        self.prefix, self.port = prefix, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = TEMPLATE.read_text()
        # As root, nginx's workers would run as nobody, who cannot read pytest's private temp folders.
        user = "user root root;" if os.geteuid() == 0 else ""
        for key, value in {"@USER@": user, "@PREFIX@": str(prefix), "@PORT_A@": str(ports[0]),
                           "@PORT_B@": str(ports[1]), "@LISTEN@": str(self.port)}.items():
            conf = conf.replace(key, value)
        assert not re.search(r"@[A-Z_]+@", conf), "an unfilled placeholder"
        (prefix / "nginx.conf").write_text(conf)
        test = subprocess.run([NGINX, "-t", "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                               "-e", str(prefix / "error.log")], capture_output=True, text=True)
        assert test.returncode == 0, test.stderr
        self.proc = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                                      "-e", str(prefix / "error.log")], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("nginx did not start: " + (prefix / "error.log").read_text()[-2000:])

    def access_log(self) -> list[tuple[str, str, str]]:
        """(status, upstream addresses, upstream statuses) per request, as the `upstreams` log_format writes."""
        lines = (self.prefix / "access.log").read_text().splitlines()
        return [re.match(r'^(\d+) "([^"]*)" "([^"]*)"', line).groups() for line in lines]

    def errors(self) -> dict[str, int]:
        """nginx's error log, counted by message (time, connection and client details stripped)."""
        text = (self.prefix / "error.log").read_text(errors="replace")
        return dict(collections.Counter(re.sub(r"^\S+ \S+ \[(\w+)\] \d+#\d+: (\*\d+ )?", r"\1: ", line)
                                        .split(", client:")[0] for line in text.splitlines() if line.strip()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish what is open
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Load:
    """bench.load.run_load in back-to-back batches on a thread until stop(); outcomes summed over batches."""

    def __init__(self, url: str):
        self.url, self.outcomes, self.sent, self.lost = url, collections.Counter(), 0, 0
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seed = 0
        while not self._stop.is_set():
            r = asyncio.run(run_load(self.url, "tiny", BATCH, CONCURRENCY, disconnect_fraction=0.05,
                                     request_timeout=REQUEST_TIMEOUT_S, seed=seed))
            self.outcomes.update(r["outcomes"])
            self.sent += r["sent"]
            self.lost += r["lost"]
            self.latencies.append(r["latency_p99_s"] or 0.0)
            seed += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(REQUEST_TIMEOUT_S * 3)
        assert not self._thread.is_alive(), "the load did not finish"


class GaugeSampler:
    """Polls each replica's waiting gauge (the autoscaling signal) twice a second; keeps the maximum."""

    def __init__(self, ports: tuple[int, int], name: str):
        self.ports, self.name = ports, name
        self.max_waiting = {p: 0.0 for p in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for port in self.ports:
                try:
                    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                except httpx.HTTPError:
                    continue  # the replica is down
                value = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                            if s.name == self.name)
                self.max_waiting[port] = max(self.max_waiting[port], value)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _wait_busy(port: int, timeout: float = 20.0) -> None:
    """Until the replica has sequences running: the load comes in batches, and a signal between two would
    test an idle drain."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        if any(s.value > 0 for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "neuronmm_num_requests_running"):
            return
        time.sleep(0.005)
    raise AssertionError(f"replica on port {port} never had a request running: no load reaches it")


def _restart(replicas: list[Replica], i: int, config: Path, tmp_path: Path, generation: int) -> dict:
    """SIGTERM replica i under load, wait for its exit, start it again on the same port, wait until ready."""
    old = replicas[i]
    _wait_busy(old.port)
    signalled = time.monotonic()
    old.proc.send_signal(signal.SIGTERM)
    code = old.proc.wait(GRACE_S + 15)
    exited = time.monotonic()
    log = old.log_text()
    old.stop()
    draining = re.search(r"draining (\d+) in-flight request\(s\)", log)
    new = Replica(config, old.port, tmp_path / f"replica{i}-{generation}.log")
    replicas[i] = new
    new.wait_ready()
    return {"replica": i, "exit_code": code, "drain_s": round(exited - signalled, 2),
            "in_flight_at_sigterm": int(draining.group(1)) if draining else None,
            "cut_off": "grace period over" in log, "back_after_s": round(time.monotonic() - signalled, 2)}


def test_rolling_restart_under_load_loses_nothing(tmp_path, tiny_model_dir):
    config = write_config(tmp_path / "serve.yaml", tiny_model_dir,
                          engine={"max_num_seqs": 8, "max_queue": 32, "max_num_batched_tokens": 512},
                          server={"shutdown_grace_s": GRACE_S})
    ports = (free_port(), free_port())
    replicas = [Replica(config, port, tmp_path / f"replica{i}-0.log") for i, port in enumerate(ports)]
    (tmp_path / "nginx").mkdir()
    nginx = load = sampler = None
    try:
        for replica in replicas:
            replica.wait_ready()
        nginx = Nginx(tmp_path / "nginx", ports)
        sampler = GaugeSampler(ports, _waiting_metric())
        started = time.monotonic()
        load = Load(nginx.url)
        time.sleep(SETTLE_S)
        restarts = []
        for i in range(len(replicas)):
            restarts.append(_restart(replicas, i, config, tmp_path, generation=1))
            time.sleep(SETTLE_S)
        load.stop()
        wall = time.monotonic() - started
        sampler.stop()
        log, errors = nginx.access_log(), nginx.errors()
    finally:
        for stoppable in (load, sampler):
            if stoppable is not None and stoppable._thread.is_alive():
                stoppable._stop.set()
        if nginx is not None:
            nginx.stop()
        for replica in replicas:
            replica.stop()

    retried = [entry for entry in log if "," in entry[2]]
    report = {"wall_s": round(wall, 1), "sent": load.sent, "lost": load.lost, "outcomes": dict(load.outcomes),
              "nginx_logged": len(log), "nginx_status": dict(collections.Counter(e[0] for e in log)),
              "passed_to_other_replica": len(retried),
              "first_upstream_status_of_retried": dict(collections.Counter(e[2].split(",")[0] for e in retried)),
              "max_batch_p99_s": max(load.latencies), "restarts": restarts,
              "max_waiting_per_replica": list(sampler.max_waiting.values()), "nginx_errors": errors}
    print(f"\nrolling restart: {report}")

    assert load.lost == 0 and load.sent == sum(load.outcomes.values())
    assert set(load.outcomes) <= ACCEPTED, f"outcomes beyond 200/429/503/hang-up: {dict(load.outcomes)}"
    assert load.outcomes["ok"] > 0
    assert len(log) == load.sent, "nginx saw a different number of requests than the client sent"
    for restart in restarts:
        assert restart["exit_code"] == 0 and not restart["cut_off"], restart
        assert restart["in_flight_at_sigterm"], f"no request in flight at SIGTERM: not under load ({restart})"
    # The restarts met live traffic: nginx passed requests from the restarting replica to the other one.
    assert retried, "no request was passed to the other replica"
