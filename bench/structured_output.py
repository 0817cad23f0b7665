"""Cost of structured output: TPOT of chat completions with a JSON schema against the same requests without.

Starts `neuronmm serve` (the default model) and streams chat completions at each concurrency, once plain
and once with `response_format: json_schema`, alternating round by round so both see the same machine
load. The schema asks for a long array of objects, so the grammar constrains every one of the
--output-len tokens (EOS ignored in the plain run, so both make the same number of tokens). Reports
TPOT (p50 of per-request TPOT, then the median over rounds) and the ratio schema / plain; the goal
of issue 16 is a ratio of at most 1.2 at c=1 and c=16.

    python -m bench.structured_output --concurrency 1 16 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import (MODEL_DTYPES, ServerProcess, check_out, machine_facts, positive_int, run_cli, run_client,
                           save_report, tcp_port, write_config)
from bench.serve import percentile
from server.config import load_config

RESULTS = Path(__file__).parent / "results"
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                     "city": {"type": "string"}},
    "required": ["name", "age", "city"], "additionalProperties": False}}},
          "required": ["people"], "additionalProperties": False}


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int] | str:
    """(TTFT s, latency s, completion tokens) of one streamed chat completion, or the error text."""
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif ttft == 0.0 and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
    return ttft, time.perf_counter() - start, tokens


async def run_level(url: str, model: str, concurrency: int, num_requests: int, output_len: int,
                    schema: bool) -> dict:
    """num_requests distinct chat requests, concurrency at a time: TPOT p50 / mean and output tok/s."""
    sem = asyncio.Semaphore(concurrency)

    def body(i: int) -> dict:
        b = {"model": model, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True},
             "messages": [{"role": "user", "content": f"Request {i}: list many people with name, age and city."}]}
        if schema:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
        return b

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def one(i: int):
            async with sem:
                return await stream_chat(client, url, body(i))

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(num_requests)))
        duration = time.perf_counter() - start
    errors = [r for r in results if isinstance(r, str)]
    ok = [r for r in results if not isinstance(r, str) and r[2] > 1]
    tpots = [(latency - ttft) / (tokens - 1) for ttft, latency, tokens in ok]
    return {"concurrency": concurrency, "schema": schema, "completed": len(ok), "errors": errors[:3],
            "output_tokens": sum(r[2] for r in ok), "output_tok_s": sum(r[2] for r in ok) / duration,
            "tpot_ms_p50": 1e3 * percentile(tpots, 50),
            "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else float("nan")}


def summarize(rows: list[dict], levels: list[int]) -> list[dict]:
    """Per concurrency: median over rounds of the TPOT p50, plain and with the schema, and their ratio."""
    out = []
    for c in levels:
        plain = statistics.median(r["tpot_ms_p50"] for r in rows if r["concurrency"] == c and not r["schema"])
        schema = statistics.median(r["tpot_ms_p50"] for r in rows if r["concurrency"] == c and r["schema"])
        out.append({"concurrency": c, "tpot_ms_plain": plain, "tpot_ms_schema": schema, "ratio": schema / plain})
    return out


def markdown(report: dict) -> str:
    lines = [f"TPOT with `response_format: json_schema` vs without, {report['output_len']} tokens a request, "
             f"median of {report['rounds']} alternating rounds (p50 of per-request TPOT each)", "",
             "| concurrency | TPOT plain (ms) | TPOT schema (ms) | schema / plain |", "|---|---|---|---|"]
    lines += [f"| {s['concurrency']} | {s['tpot_ms_plain']:.1f} | {s['tpot_ms_schema']:.1f} | {s['ratio']:.2f} |"
              for s in report["summary"]]
    return "\n".join(lines + [""])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.structured_output", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating plain/schema rounds per concurrency")
    p.add_argument("--requests-per-slot", type=positive_int, default=2, help="requests per round = this x concurrency")
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--dtype", choices=MODEL_DTYPES, default="auto")
    p.add_argument("--port", type=tcp_port, default=8311, help="port for the server this starts")
    p.add_argument("--out", default=str(RESULTS / "structured_output.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = check_out(args.out)
    model = load_config().model.name
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp) / "serve.yaml", None, model={"dtype": args.dtype})
        RESULTS.mkdir(exist_ok=True)
        with ServerProcess(config, RESULTS / "structured_output-server.log", port=args.port) as server:
            server.wait_ready()
            for c in args.concurrency:
                run_client(run_level(server.url, model, c, c, 8, schema=True))  # warm-up (grammar caches too)
                for _ in range(args.rounds):
                    for schema in (False, True):
                        row = run_client(run_level(server.url, model, c, c * args.requests_per_slot,
                                                    args.output_len, schema))
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    report = {"command": " ".join(["python -m bench.structured_output", *(argv if argv is not None else sys.argv[1:])]),
              **machine_facts(), "output_len": args.output_len, "rounds": args.rounds, "dtype": args.dtype,
              "rows": rows,
              "summary": summarize(rows, args.concurrency)}
    save_report(out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
