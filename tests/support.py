"""Test helpers shared by several folders: a Config for the tiny model (and its YAML file), a live in-process uvicorn
server, pytest in a fresh process, children read when first asked, waiting for a condition, a runtime whose logits
write a scripted reply, an engine that refuses to add some prompts, paged-attention batches of runs."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import uvicorn
import yaml

from bench.harness import wait_healthy
from server.api.app import create_app
from server.config import Config
from server.engine.llm_engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.runtime import build_engine, eos_token_ids, load_runtime


def tiny_config(model_dir: Path, **engine):
    """A Config serving the tiny model from safetensors, with engine overrides."""
    limits = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256, "max_queue": 16,
              "num_threads": 1}
    limits.update(engine)
    return Config.model_validate({
        "model": {"name": "tiny", "source": "safetensors", "path": str(model_dir)},
        "engine": limits, "server": {"port": 0}})


def tiny_config_file(model_dir: Path, folder: Path, **engine) -> Path:
    """tiny_config written as a YAML file in `folder`, for the benchmarks' --config."""
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(model_dir, **engine).model_dump(mode="json")))
    return path


@contextmanager
def live_server(cfg, loader: Callable | None = None, ready_timeout: float = 60.0,
                engine_process: bool = False, engine_core=None) -> Iterator[SimpleNamespace]:
    """Run the app under a real uvicorn on 127.0.0.1 (free port); yields (url, app) once /health is 200.

    The engine runs in this process (tests inspect it) unless `engine_process`, as `neuronmm serve` runs it
    (`engine_core`: one spawned before the app, as `neuronmm serve` spawns it).
    """
    app = create_app(cfg, None if engine_process else (loader or load_runtime), engine_core=engine_core)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, ready_timeout)
    except RuntimeError:
        server.should_exit = True
        raise
    try:
        yield SimpleNamespace(url=base, app=app, state=app.state.neuronmm)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def engine_greedy(model_dir: Path, runner, tok, prompts: list[str], new_tokens: int,
                  max_model_len: int) -> list[list[int]]:
    """Greedy tokens (ignore_eos) of each prompt, all in one engine batch, over a loaded runner."""
    engine = build_engine(tiny_config(model_dir, max_model_len=max_model_len), runner, tok,
                          eos_token_ids(model_dir, tok))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), tok(p).input_ids,
                           SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    return [got[str(i)] for i in range(len(prompts))]


def pytest_in_subprocess(config, targets: list[str], env: dict[str, str],
                         timeout: int = 900) -> subprocess.CompletedProcess:
    """pytest on `targets` in a fresh process with `env` (another build of the fused ops), loading the plugins this
    run was given with `-p` (the compat job's shims) so the child tests what this run tests."""
    args = [str(a) for a in config.invocation_params.args]
    plugins = [a for prev, a in zip(args, args[1:]) if prev == "-p"]
    plugins += [a[2:] for a in args if a.startswith("-p") and a != "-p"]  # -pNAME
    plugin_args = [arg for name in plugins if name != "no:cacheprovider" for arg in ("-p", name)]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_args, *targets],
                          env=env, capture_output=True, text=True, timeout=timeout)


def wait_for(cond: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll `cond` until it holds; an AssertionError if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def scripted_loader(prompt_len: int, reply_ids: list[int], eos: int | None):
    """The tiny model's runtime, its logits forcing `reply_ids` after any prompt of `prompt_len` tokens, then EOS
    (None: then the model's own logits) (a random model writes no <think>; what follows the parser is the API's)."""

    def loader(cfg):
        runtime = load_runtime(cfg)
        execute = runtime.runner.execute

        def forced(chunks):
            logits = execute(chunks).clone()  # (an inference tensor: not written in place outside inference mode)
            rows = [c for c in chunks if c.needs_logits]
            for row, chunk in enumerate(rows):
                k = chunk.start_pos + len(chunk.token_ids) - prompt_len  # the output token this row chooses
                if k >= len(reply_ids) and eos is None:
                    continue
                logits[row] = -torch.inf
                logits[row, reply_ids[k] if 0 <= k < len(reply_ids) else eos] = 0.0
            return logits

        runtime.runner.execute = forced
        return runtime

    return loader


def refuse_prompts_starting(monkeypatch, prefix: list[int]) -> None:
    """LLMEngine.add_request raises ValueError("injected admission fault") for prompts that start with `prefix`."""
    real = LLMEngine.add_request

    def add_request(self, request_id, prompt_ids, params, n=1):
        if prompt_ids[:len(prefix)] == prefix:
            raise ValueError("injected admission fault")
        return real(self, request_id, prompt_ids, params, n)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)


def finished_children(procs: dict[str, subprocess.Popen],
                      timeout: float) -> Iterator[Callable[[str], subprocess.CompletedProcess]]:
    """For a generator fixture (`yield from`): a function from a child's name to its finished CompletedProcess, each
    waited for when first asked, so children started together run beside the tests; any left are killed after."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def result(name: str) -> subprocess.CompletedProcess:
        if name not in done:
            proc = procs[name]
            stdout, stderr = proc.communicate(timeout=timeout)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        return done[name]

    yield result
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def scattered_runs(runs: list[tuple[int, int]], block_size: int, generator: torch.Generator) -> SimpleNamespace:
    """A paged-attention batch's layout for runs (prefix, tokens), each its own sequence with its blocks scattered over
    the pool: num_blocks, block tables, each token's sequence index, position and cache slot."""
    max_blocks = max(-(-(p + n) // block_size) for p, n in runs)
    num_blocks = len(runs) * max_blocks + 2
    tables = torch.randperm(num_blocks, generator=generator)[:len(runs) * max_blocks].view(len(runs), max_blocks).int()
    seq_index = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, (_, n) in enumerate(runs)])
    positions = torch.cat([torch.arange(p, p + n) for p, n in runs])
    slot_mapping = tables[seq_index.long(), positions // block_size].long() * block_size + positions % block_size
    return SimpleNamespace(num_blocks=num_blocks, tables=tables, seq_index=seq_index, positions=positions,
                           slot_mapping=slot_mapping)
