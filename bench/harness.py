"""Bench and test harness: a `neuronmm serve` subprocess, the wait for /health, the tiny random model, child commands.

bench/load.py and tests/support.py start servers through this module; benches run their `neuronmm`
child commands through `run_logged`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import get_args

import httpx
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.core_latency import core_round_trip_ns
from bench.cpu_caps import caps_in_force
from server.config import DEFAULT_CONFIG, EngineConfig, ModelConfig
from server.errors import ConfigError
from server.fileio import atomic_file, check_out_file, write_json_atomic
from server.models.cpu_features import cpu_flags
from server.models.lora import projection_widths

REPO = Path(__file__).resolve().parent.parent
NEURONMM = [sys.executable, "-m", "server.cli"]
# Marks a benchmark child's result line on its stdout (bench.engine_workload --levels-from-stdin, read by bench.serve):
# anything else a library prints there is passed over.
ROW_PREFIX = "bench row: "

# The CPU flags that pick our kernels' paths: what a report records of the machine.
BENCH_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})


# The values the server's config accepts: what a benchmark's --dtype / --kv-cache-dtype flags offer as choices.
MODEL_DTYPES = get_args(ModelConfig.model_fields["dtype"].annotation)
KV_CACHE_DTYPES = get_args(EngineConfig.model_fields["kv_cache_dtype"].annotation)


def _number(text: str, kind: type, test: Callable[[float], bool], rule: str) -> int | float:
    """`text` read as `kind` (finite) and passing `test`, else an argparse error naming the rule."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
    if not math.isfinite(value) or not test(value):
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum`."""
    def parse(text: str) -> int:
        return _number(text, int, lambda v: v >= minimum, f"an integer >= {minimum}")
    parse.__name__ = f"int_at_least_{minimum}"
    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count that must not be zero)."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return _number(text, float, lambda v: v > 0, "a positive number")


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port number, 1 to 65535."""
    return _number(text, int, lambda v: 1 <= v <= 65535, "a port from 1 to 65535")


def fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    return _number(text, float, lambda v: 0 <= v <= 1, "a number from 0 to 1")


def keep_ratio(text: str) -> float:
    """An argparse type: a keep ratio in (0, 1], as compression's keep_ratio takes it."""
    return _number(text, float, lambda v: 0 < v <= 1, "a keep ratio above 0 and at most 1")


def one_of(*choices: str) -> Callable[[str], str]:
    """An argparse type for one item of a comma list: one of `choices`."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    parse.__name__ = "one_of"
    return parse


def comma_list(item: Callable[[str], object]) -> Callable[[str], list]:
    """An argparse type: comma-separated values, each read by `item` (an argparse type), at least one."""
    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        return [item(part) for part in parts]
    parse.__name__ = "comma_list"
    return parse


def torch_device(text: str) -> str:
    """An argparse type: a torch device the runner takes, cpu, cuda or cuda:N."""
    kind, _, index = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def check_out(path: str | Path, what: str = "--out", markdown: bool = True) -> Path:
    """A report's path checked before any work (ConfigError, one line): it, and with `markdown` the .md that
    save_report writes beside it, can be written."""
    path = check_out_file(Path(path), what)
    if markdown:
        check_out_file(path.with_suffix(".md"), what)
    return path


def run_cli(main: Callable[[list[str] | None], int | None], prog: str | None = None) -> int:
    """A benchmark's `python -m bench.NAME` entry: main()'s exit code, a ConfigError as one line on stderr
    (`bench.NAME: error: ...`, exit code 2) and Ctrl+C as `interrupted` (130), as `neuronmm bench NAME` has them."""
    if prog is None:
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        prog = spec.name if spec is not None else Path(sys.argv[0]).stem
    try:
        return int(main(None) or 0)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def level_size(concurrency: int) -> int:
    """Requests a benchmark level sends (bench.serve and its engine-only twin alike): two waves at its concurrency,
    at least four."""
    return max(4, 2 * concurrency)


def prompt_id_bound(vocab_size: int, tokenizer) -> int:
    """The bound of a benchmark's random prompt ids: below the model's vocabulary and its tokenizer's (an embedding
    table may be padded past the tokenizer, as Qwen's are, and servers refuse ids their tokenizer lacks)."""
    return min(vocab_size, len(tokenizer))


def run_client(coro: Coroutine):
    """Run a benchmark client's coroutine on uvloop where it is installed, else on asyncio's loop.

    The client shares the CPU with the server it measures, and every millisecond it spends is one the server
    loses. On uvloop bench.serve's client spends ~20 % less per streamed token (0.030 against 0.038 ms at 16
    streams).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def wait_healthy(url: str, timeout: float, alive: Callable[[], str | None] = lambda: None) -> None:
    """Poll `url`/health until it answers 200; RuntimeError after `timeout` s or when alive() names a failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        failure = alive()
        if failure:
            raise RuntimeError(failure)
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server at {url} not healthy after {timeout} s")


def make_tiny_model(out: Path, tokenizer_dir: Path) -> Path:
    """The test suite's tiny random Llama (2 layers, hidden 64, seed 0) with the tokenizer of tokenizer_dir."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_lora(folder: Path, model_config, targets: tuple[str, ...] = LORA_TARGETS, rank: int = 16,
                      alpha: float = 32.0, seed: int = 0, layers: tuple[int, ...] | None = None, **config) -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for the model, with random A and B (PEFT
    starts B at zero, which would hide an engine that ignored the adapter); `config` adds adapter_config keys."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers) if layers is None else layers:
        for module, (in_f, out_f) in projection_widths(model_config).items():
            if module in targets:
                prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module in LORA_TARGETS[4:] else 'self_attn'}"
                tensors[f"{prefix}.{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.2
                tensors[f"{prefix}.{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.2
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    write_json_atomic(folder / "adapter_config.json", {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "use_rslora": False, "fan_in_fan_out": False, **config})
    return folder


def run_logged(cmd: list[str], log_path: Path) -> tuple[float, float]:
    """Run a command with output to a log; (wall seconds, peak RSS MiB of that process). Fails loudly."""
    print("$ " + shlex.join(cmd), flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"command failed ({code}): {shlex.join(cmd)}\n" + "\n".join(tail))
    return wall, usage.ru_maxrss / 1024  # Linux reports KiB


def free_port() -> int:
    """A loopback TCP port free at the time of the call."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(path: Path, model_dir: Path | None, engine: dict | None = None, server: dict | None = None,
                 base: Path | None = None, model: dict | None = None) -> Path:
    """A serve config: the tiny safetensors model in `model_dir`, or the `base` config's model (`model` updates it)."""
    data = yaml.safe_load((base or DEFAULT_CONFIG).read_text())
    if model_dir is not None:
        data["model"] = {"name": "tiny", "source": "safetensors", "path": str(model_dir)}
    data.setdefault("model", {}).update(model or {})
    data.setdefault("engine", {}).update(engine or {})
    data.setdefault("server", {}).update(server or {})
    path.write_text(yaml.safe_dump(data))
    return path


def save_report(out: Path, report: dict, md: str) -> Path:
    """Write a benchmark's JSON report and its markdown beside it (`.md`), each atomically."""
    out = write_json_atomic(out, report)
    with atomic_file(out.with_suffix(".md")) as tmp:
        tmp.write_text(md.rstrip("\n") + "\n", encoding="utf-8")
    return out


def machine_facts() -> dict:
    """What a report states first: the UTC date, the CPU count, the kernel-picking CPU flags, the caps in force and
    the core-to-core round trip now (whether CPUs 0 and 1 share a last-level cache: bench.core_latency)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "cpu_flags": sorted(cpu_flags() & BENCH_FLAGS), "caps_in_force": caps_in_force(),
            "core_round_trip_ns": core_round_trip_ns()}


def publish(out: Path, report: dict, md: str) -> int:
    """save_report, then print the markdown and where the report went; a benchmark's exit code (0)."""
    saved = save_report(out, report, md)
    print(md)
    print(f"saved {saved}")
    return 0


def tree_rss_mb(pid: int) -> float:
    """Resident memory of process `pid` and all its descendants, MiB (psutil: a dev dependency). A child that exits
    while being read is skipped."""
    import psutil

    root = psutil.Process(pid)
    total = root.memory_info().rss
    for child in root.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class ServerProcess:
    """`neuronmm serve` in a subprocess on a free loopback port, stdout+stderr to a log file."""

    def __init__(self, config: Path, log_path: Path, api_key: str | None = None, num_threads: int | None = None,
                 port: int | None = None, stop_timeout: float = 30.0):
        self.port = port or free_port()  # a fixed port lets a restarted replica come back where a proxy routes
        self.stop_timeout = stop_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = NEURONMM + ["serve", "--config", str(config), "--port", str(self.port)]
        if num_threads:
            cmd += ["--num-threads", str(num_threads)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if api_key:
            env["NEURONMM_API_KEY"] = api_key  # not on the command line, where `ps` would show it
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Return once /health is 200; RuntimeError with the log's tail if the process exits or times out."""
        try:
            wait_healthy(self.url, timeout,
                         lambda: None if self.proc.poll() is None else f"server exited with {self.proc.returncode}")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {self.log_text()[-2000:]}") from None

    def rss_mb(self) -> float:
        """Resident memory of the server, MiB: the API process and its children (the engine core runs in one)."""
        return tree_rss_mb(self.proc.pid)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the /metrics samples called `name` whose labels include `labels`."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def wait_idle(self, timeout: float = 30.0) -> float:
        """Seconds until running and waiting are both 0 (raises if they are not within timeout)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if (self.metric("neuronmm_num_requests_running") == 0
                    and self.metric("neuronmm_num_requests_waiting") == 0):
                return time.monotonic() - start
            time.sleep(0.05)
        raise RuntimeError("server did not go idle")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


