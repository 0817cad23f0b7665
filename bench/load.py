"""Bounded loopback load: a `neuronmm serve` subprocess, N mixed requests at fixed concurrency, two runs.

Every request must end as 200, 429 or a deliberate client disconnect (streaming clients that hang up
mid-stream); none may hang past --request-timeout and none may be lost: the client's tally is
reconciled with the server's finish counters. Between runs the server's RSS and its running/waiting
gauges are read. Writes JSON (and prints a summary); exits 1 when a check fails.

    python -m bench.load                       # tiny random model, 2 x 2,000 requests, concurrency 64
    python -m bench.load --model real          # the configured SmolLM2-135M instead
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench.harness import (REPO, ServerProcess, check_out, fraction, machine_facts, make_tiny_model, nonnegative_float,
                           nonnegative_int, positive_float, positive_int, run_cli, run_client, write_config)
from server.config import DEFAULT_CONFIG, load_config
from server.fileio import write_json_atomic
from server.models.source import resolve_model_dir

__all__ = ["ServerProcess", "check", "one_run", "run_load", "write_config"]  # tests drive the load through these
WORDS = ("the quick brown fox jumps over a lazy dog while seven small robots count prime numbers "
         "near the quiet river bank at dawn").split()


# ---- the load ----------------------------------------------------------------------------------
@dataclass
class Plan:
    """One request: endpoint, prompt size, output bound, and whether it streams / hangs up mid-stream."""

    chat: bool
    num_words: int
    max_tokens: int
    stream: bool
    disconnect_after: int | None  # chunks read before hanging up (streaming disconnect clients)


def make_plans(num_requests: int, disconnect_fraction: float, rng: random.Random) -> list[Plan]:
    plans = []
    for _ in range(num_requests):
        disconnect = rng.random() < disconnect_fraction
        stream = disconnect or rng.random() < 0.2
        plans.append(Plan(chat=rng.random() < 0.5, num_words=rng.choice([3, 20, 60, 200]),
                          max_tokens=rng.choice([1, 8, 32, 64]) if not disconnect else 64, stream=stream,
                          disconnect_after=rng.randint(1, 4) if disconnect else None))
    return plans


def _body(plan: Plan, model: str, rng: random.Random) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(plan.num_words))
    body = {"model": model, "max_tokens": plan.max_tokens, "temperature": rng.choice([0.0, 0.8]),
            "stream": plan.stream, "ignore_eos": plan.disconnect_after is not None}
    if plan.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def _one(client: httpx.AsyncClient, url: str, plan: Plan, body: dict) -> str:
    """The outcome of one request: ok | 429 | disconnect | http_<status> | bad_body."""
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    if not plan.stream:
        resp = await client.post(url + path, json=body)
        if resp.status_code != 200:
            return "429" if resp.status_code == 429 else f"http_{resp.status_code}"
        return "ok" if resp.json()["choices"] else "bad_body"
    async with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return "429" if resp.status_code == 429 else f"http_{resp.status_code}"
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "ok"
            if "error" in json.loads(line[6:]):
                return "stream_error"
            chunks += 1
            if plan.disconnect_after is not None and chunks >= plan.disconnect_after:
                return "disconnect"  # leaving the block closes the connection mid-stream
        return "truncated"


async def run_load(url: str, model: str, num_requests: int, concurrency: int, disconnect_fraction: float,
                   request_timeout: float, seed: int, headers: dict | None = None, backoff_s: float = 1.0) -> dict:
    """Send every planned request through `concurrency` workers; tally each one's outcome."""
    rng = random.Random(seed)
    plans = make_plans(num_requests, disconnect_fraction, rng)
    bodies = [_body(p, model, rng) for p in plans]
    queue: collections.deque = collections.deque(range(num_requests))
    outcomes: collections.Counter = collections.Counter()
    latencies: list[float] = []
    sent = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while queue:
            i = queue.popleft()
            sent += 1
            start = time.monotonic()
            try:
                outcome = await asyncio.wait_for(_one(client, url, plans[i], bodies[i]), request_timeout)
            except asyncio.TimeoutError:
                outcome = "timeout"
            except httpx.HTTPError as exc:
                outcome = f"transport_{exc.__class__.__name__}"
            outcomes[outcome] += 1
            if outcome == "ok":
                latencies.append(time.monotonic() - start)
            elif outcome == "429":
                await asyncio.sleep(backoff_s)  # a polite client waits (Retry-After) before its next request

    start = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=request_timeout, headers=headers or {}) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.monotonic() - start
    latencies.sort()
    planned_disconnects = sum(p.disconnect_after is not None for p in plans)
    return {"sent": sent, "outcomes": dict(outcomes), "answered": sum(outcomes.values()),
            "lost": sent - sum(outcomes.values()), "planned_disconnects": planned_disconnects,
            "num_streaming": sum(p.stream for p in plans), "wall_s": round(wall, 2),
            "requests_per_s": round(sent / wall, 1),
            "latency_p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "latency_p99_s": round(latencies[int(len(latencies) * 0.99)], 3) if latencies else None}


FINISH_REASONS = ("stop", "length", "abort", "error")


def server_finish_counts(server: ServerProcess) -> dict:
    return {r: server.metric("neuronmm_request_success_total", finished_reason=r) for r in FINISH_REASONS}


def one_run(server: ServerProcess, args, seed: int) -> dict:
    """One load run plus the server-side reconciliation and the idle/RSS readings after it."""
    before = server_finish_counts(server)
    result = run_client(run_load(server.url, args.model_name, args.requests, args.concurrency,
                                  args.disconnect_fraction, args.request_timeout, seed, server.headers))
    result["idle_after_s"] = round(server.wait_idle(), 3)
    after = server_finish_counts(server)
    delta = {r: int(after[r] - before[r]) for r in FINISH_REASONS}
    result["server_finished"] = delta
    outcomes = result["outcomes"]
    # Each 200 finished as stop/length; each hang-up as an abort (or, if it raced the last token, stop/length).
    served = outcomes.get("ok", 0) + outcomes.get("disconnect", 0)
    result["server_unaccounted"] = served - (delta["stop"] + delta["length"] + delta["abort"])
    result["rss_mb_after"] = round(server.rss_mb(), 1)
    return result


def check(results: list[dict], args) -> list[str]:
    """The pass conditions; an empty list means every one held."""
    problems = []
    allowed = {"ok", "429", "disconnect"}
    for i, r in enumerate(results, 1):
        bad = {k: v for k, v in r["outcomes"].items() if k not in allowed}
        if bad:
            problems.append(f"run {i}: outcomes outside 200/429/disconnect: {bad}")
        if r["lost"] or r["sent"] != args.requests:
            problems.append(f"run {i}: sent {r['sent']}, lost {r['lost']}")
        if r["server_unaccounted"]:
            problems.append(f"run {i}: {r['server_unaccounted']} requests the server never finished")
        if r["server_finished"]["error"]:
            problems.append(f"run {i}: {r['server_finished']['error']} engine errors")
    growth = results[-1]["rss_mb_after"] - results[0]["rss_mb_after"]
    if growth > args.rss_bound_mb:
        problems.append(f"RSS grew {growth:.1f} MB between runs (bound {args.rss_bound_mb} MB)")
    return problems


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["tiny", "real"], default="tiny",
                   help="tiny: a 2-layer random Llama with SmolLM2's tokenizer; real: configs/smollm2-135m.yaml")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--requests", type=positive_int, default=2000)
    p.add_argument("--concurrency", type=positive_int, default=64)
    p.add_argument("--runs", type=positive_int, default=2)
    p.add_argument("--warmup", type=nonnegative_int, default=500, help="requests sent before the measured runs")
    p.add_argument("--disconnect-fraction", type=fraction, default=0.1)
    p.add_argument("--request-timeout", type=positive_float, default=120.0)
    p.add_argument("--max-num-seqs", type=positive_int, default=16)
    p.add_argument("--max-queue", type=nonnegative_int, default=40,
                   help="below concurrency - max_num_seqs, so bursts meet 429s")
    p.add_argument("--num-threads", type=positive_int, default=2)
    p.add_argument("--rss-bound-mb", type=nonnegative_float, default=64.0,
                   help="allowed RSS growth from run 1 to the last")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "load.json")
    args = p.parse_args(argv)
    if not args.config.is_file():
        p.error(f"--config: no file {args.config}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = check_out(args.out, markdown=False)
    facts = machine_facts()  # before the server starts: the core round trip measured with the cores idle
    with tempfile.TemporaryDirectory(prefix="neuronmm-load-") as tmp:
        tmp = Path(tmp)
        model_dir = None
        if args.model == "tiny":
            cfg = load_config()
            model_dir = make_tiny_model(tmp / "tiny", resolve_model_dir(cfg.model, cfg.cache_path))
        engine = {"max_num_seqs": args.max_num_seqs, "max_queue": args.max_queue,
                  "max_num_batched_tokens": max(512, args.max_num_seqs)}
        config = write_config(tmp / "serve.yaml", model_dir, engine=engine, base=args.config)
        args.model_name = "tiny" if model_dir else yaml.safe_load(config.read_text())["model"]["name"]
        with ServerProcess(config, tmp / "server.log", num_threads=args.num_threads) as server:
            server.wait_ready()
            rss_before = server.rss_mb()
            if args.warmup:  # first-use allocations (caches, arenas) are not growth
                run_client(run_load(server.url, args.model_name, args.warmup, args.concurrency,
                                     args.disconnect_fraction, args.request_timeout, args.seed + 1000,
                                     server.headers))
                server.wait_idle()
            rss_warm = server.rss_mb()
            results = []
            for run in range(args.runs):
                results.append(one_run(server, args, args.seed + run))
                print(f"run {run + 1}: {json.dumps(results[-1])}", flush=True)
            problems = check(results, args)
    report = {**facts, "model": args.model, "requests_per_run": args.requests, "concurrency": args.concurrency,
              "max_num_seqs": args.max_num_seqs, "max_queue": args.max_queue,
              "warmup_requests": args.warmup, "rss_mb_before": round(rss_before, 1),
              "rss_mb_after_warmup": round(rss_warm, 1), "rss_bound_mb": args.rss_bound_mb,
              "runs": results, "problems": problems, "passed": not problems}
    write_json_atomic(out, report)
    print(f"RSS before {rss_before:.1f} MB, after warm-up {rss_warm:.1f} MB, after each run "
          f"{[r['rss_mb_after'] for r in results]} MB (bound on growth: {args.rss_bound_mb} MB)")
    print("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
