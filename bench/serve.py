"""Serving benchmark in the style of `vllm bench serve`, with plain HF `generate` as the baseline.

Starts `neuronmm serve` on loopback (or targets --url), sends fixed-length random-token prompts with
a streaming client at each concurrency level, ignores EOS so every request makes exactly
--output-len tokens, and reports TTFT, TPOT, ITL (p50/p99) and output tok/s. Then runs the same
prompts through `transformers` `generate` at batch sizes 1 and 16 in the same process run.

    python -m bench.serve                      # defaults: 128 in, 128 out, concurrency 1 4 16 32
    python -m bench.serve --skip-hf --concurrency 16 --num-prompts 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds)."""

    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for an empty list."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def make_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """Unique random-token prompts (no shared prefix), avoiding the lowest ids where specials live."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_size) for _ in range(length)] for _ in range(num)]


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                     output_len: int) -> RequestResult:
    """Send one streaming completion and time every chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - start
    return res


async def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int,
                    output_len: int) -> dict:
    """All prompts at one concurrency level; returns the summary row."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def guarded(p):
            async with sem:
                return await stream_one(client, url, model, p, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "num_prompts": len(prompts), "completed": len(ok),
        "errors": [r.error for r in results if r.error][:3], "duration_s": duration,
        "output_tokens": out_tokens, "output_tok_s": out_tokens / duration,
        "ttft_ms_p50": 1e3 * percentile([r.ttft for r in ok], 50),
        "ttft_ms_p99": 1e3 * percentile([r.ttft for r in ok], 99),
        "tpot_ms_p50": 1e3 * percentile(tpots, 50), "tpot_ms_p99": 1e3 * percentile(tpots, 99),
        "itl_ms_p50": 1e3 * percentile(itls, 50), "itl_ms_p99": 1e3 * percentile(itls, 99),
        "mean_tpot_ms": 1e3 * statistics.fmean(tpots) if tpots else float("nan"),
    }


def start_server(config: str, port: int, extra: list[str]) -> subprocess.Popen:
    """`neuronmm serve` in a child process, logs to bench/results/serve-server.log."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = open(RESULTS / "serve-server.log", "w")
    cmd = [sys.executable, "-m", "server.cli", "serve", "--config", config, "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float = 600.0) -> None:
    """Poll /health until 200 (the server warms up first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"bench serve: error: server exited with {proc.returncode}; see {RESULTS}/serve-server.log")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"bench serve: error: {url}/health not ready after {timeout_s:.0f} s")


def hf_generate_baseline(model_dir: Path, prompts: list[list[int]], output_len: int,
                         batch_sizes: list[int], num_threads: int | None) -> list[dict]:
    """Plain `model.generate` (greedy, fixed length) at each batch size: output tok/s."""
    import torch
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for bs in batch_sizes:
        ids = torch.tensor(prompts[:bs])
        with torch.inference_mode():
            warm = ids[:, :8]
            model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False)
            duration = time.perf_counter() - start
        made = (out.shape[1] - ids.shape[1]) * bs
        rows.append({"batch_size": bs, "output_tokens": made, "duration_s": duration,
                     "output_tok_s": made / duration})
    return rows


def markdown(report: dict) -> str:
    """The report as markdown tables."""
    lines = ["| concurrency | prompts | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in report["serve"]:
        lines.append(f"| {r['concurrency']} | {r['completed']}/{r['num_prompts']} | {r['output_tok_s']:.1f} | "
                     f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.1f} / "
                     f"{r['tpot_ms_p99']:.1f} | {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} |")
    if report.get("hf_generate"):
        lines += ["", "| HF generate batch size | output tok/s |", "|---:|---:|"]
        lines += [f"| {r['batch_size']} | {r['output_tok_s']:.1f} |" for r in report["hf_generate"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--port", type=int, default=8137)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--num-prompts", type=int, help="per level (default: max(4, 2 x concurrency))")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--num-threads", type=int, help="torch threads for server and baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "serve.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from server.config import load_config
    from server.models.source import resolve_model_dir

    cfg = load_config(args.config)
    model_dir = resolve_model_dir(cfg.model, Path(cfg.cache_dir).expanduser())
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_prompts = max(max(4, 2 * c) if args.num_prompts is None else args.num_prompts for c in args.concurrency)
    prompts = make_prompts(vocab, max(max_prompts, max(args.hf_batch_sizes)), args.input_len, args.seed)

    proc, url = None, args.url
    if url is None:
        extra = ["--num-threads", str(args.num_threads)] if args.num_threads else []
        proc = start_server(args.config, args.port, extra)
        url = f"http://127.0.0.1:{args.port}"
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), "config": args.config,
              "input_len": args.input_len, "output_len": args.output_len, "serve": []}
    try:
        wait_healthy(url, proc)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        for c in args.concurrency:
            n = args.num_prompts or max(4, 2 * c)
            row = asyncio.run(run_level(url, model, prompts[:n], c, args.output_len))
            report["serve"].append(row)
            print(f"concurrency {c:>3}: {row['output_tok_s']:7.1f} tok/s, TTFT p50 {row['ttft_ms_p50']:.0f} ms, "
                  f"TPOT p50 {row['tpot_ms_p50']:.1f} ms ({row['completed']}/{n} ok)", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    if not args.skip_hf:
        report["hf_generate"] = hf_generate_baseline(model_dir, prompts, args.output_len, args.hf_batch_sizes,
                                                     args.num_threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(markdown(report))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
