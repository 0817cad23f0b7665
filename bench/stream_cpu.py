"""CPU a streamed token costs each process of a serve: the API process, the engine core and the client.

On a 2-core machine both cores run the engine's threads, so every microsecond the API process and the client spend
on a token is taken from an engine thread, which its partner then waits for at the next barrier: this is what
served TPOT pays over the engine-only step at c=1. One stream at a time (c=1), each process's run time summed over
its threads from /proc/<pid>/task/*/schedstat (nanoseconds) around each stream, per token; the median of the rounds.
With --concurrency N, N streams at once (a step then carries N tokens, and the figures are per token still).

    python -m bench.stream_cpu [--config CONFIG] [--quantization int8] [--route chat] [--tokens 400] [--rounds 5]
                               [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from bench.harness import (ServerProcess, check_out, machine_facts, positive_int, publish, run_cli, run_client,
                           write_config)
from server.config import DEFAULT_CONFIG

RESULTS = Path(__file__).parent / "results"
PROCESSES = ("api", "engine_core", "client")


def run_ns(pid: int) -> int:
    """Nanoseconds process `pid` has run, all its threads (a thread that exits while being read is skipped)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def engine_core_pid(api: int) -> int:
    """The engine core among the API process's children (multiprocessing's spawned child; its resource tracker is
    another)."""
    for child in psutil.Process(api).children():
        if any("spawn_main" in part for part in child.cmdline()):
            return child.pid
    raise RuntimeError(f"no engine core process under {api}")


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, route: str, tokens: int) -> int:
    """Stream one request of `tokens` tokens (greedy, ignore_eos); the chunks that carried text or a finish."""
    body = {"model": model, "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    else:
        body["prompt"] = "Once upon a time"
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    chunks = 0
    async with session.post(url + path, json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            chunks += line.startswith(b"data: {")
    return chunks


async def stream_many(url: str, route: str, tokens: int, concurrency: int) -> int:
    """`concurrency` streams at once (bench.serve's client: aiohttp, a fresh connection each); their chunks."""
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0)) as session:
        async with session.get(f"{url}/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        counts = await asyncio.gather(*(stream_once(session, url, model, route, tokens) for _ in range(concurrency)))
    return sum(counts)


def measure(server: ServerProcess, route: str, tokens: int, rounds: int, concurrency: int = 1) -> list[dict]:
    """One row per round: ms of CPU per streamed chunk of each process, and the wall time per chunk of a stream
    (its TPOT, as the client saw it)."""
    api = server.proc.pid
    core = engine_core_pid(api)
    me = os.getpid()
    run_client(stream_many(server.url, route, 8, 1))  # the first request's one-off work stays out of the rounds
    rows = []
    for _ in range(rounds):
        before = {"api": run_ns(api), "engine_core": run_ns(core), "client": run_ns(me)}
        start = time.perf_counter()
        chunks = run_client(stream_many(server.url, route, tokens, concurrency))
        wall = time.perf_counter() - start
        after = {"api": run_ns(api), "engine_core": run_ns(core), "client": run_ns(me)}
        rows.append({"chunks": chunks, "wall_ms": wall * 1e3 * concurrency / chunks,
                     **{f"{p}_ms": (after[p] - before[p]) / 1e6 / chunks for p in PROCESSES}})
    return rows


def summary(rows: list[dict]) -> dict:
    """Median and range over the rounds of each per-chunk figure."""
    keys = ["wall_ms", *(f"{p}_ms" for p in PROCESSES)]
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in keys}


def markdown(facts: dict, args: argparse.Namespace, stats: dict) -> str:
    lines = [f"# CPU a streamed token costs each process ({facts['date']}, {facts['cpus']} CPUs, "
             f"{' '.join(facts['cpu_flags'])})", "",
             f"route {args.route}, {args.concurrency} stream(s) at once, {args.tokens} tokens a stream, {args.rounds} "
             f"rounds, quantization "
             f"{args.quantization or 'none'}", "",
             "| per token, ms | median | min | max |", "|---|---:|---:|---:|"]
    names = {"wall_ms": "wall (served TPOT)", "api_ms": "API process CPU", "engine_core_ms": "engine core CPU",
             "client_ms": "client CPU"}
    for key, name in names.items():
        s = stats[key]
        lines.append(f"| {name} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.stream_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--quantization", choices=["int8", "gguf", "none"], help="override the config's model.quantization")
    p.add_argument("--route", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokens", type=positive_int, default=400, help="tokens a stream")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--concurrency", type=positive_int, default=1, help="streams at once")
    p.add_argument("--out", type=Path, default=RESULTS / "stream_cpu.json")
    args = p.parse_args(argv)
    if not args.config.is_file():
        p.error(f"--config: no file {args.config}")
    out = check_out(args.out)
    facts = machine_facts()
    with tempfile.TemporaryDirectory() as tmp:
        model = {"quantization": args.quantization} if args.quantization else None
        config = write_config(Path(tmp) / "config.yaml", None, base=args.config, model=model)
        with ServerProcess(config, Path(tmp) / "serve.log") as server:
            server.wait_ready()
            rows = measure(server, args.route, args.tokens, args.rounds, args.concurrency)
    stats = summary(rows)
    report = {**facts, "route": args.route, "tokens": args.tokens, "concurrency": args.concurrency,
              "quantization": args.quantization,
              "config": str(args.config), "rounds": rows, "summary": stats}
    return publish(out, report, markdown(facts, args, stats))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
