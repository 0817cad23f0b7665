"""The benchmarks' command lines: bad counts, choices and output paths are one-line errors (exit code 2) found before
any work; bench.harness's shared argparse types, output check and `python -m bench.NAME` entry."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import (compression_quality, cpu_ops, engine_step, engine_workload, grammar_engines, harness, kernels,
                   kv_cache_quality, load, lora_step, multiturn, peak_rate, position_nll, pruning_baseline,
                   read_bandwidth, recovery, serve, speculative, structured_output)
from server.errors import ConfigError
from support import finished_children

PYTHON_TIMEOUT = 120  # a child imports torch: seconds, not minutes


# --- the shared argparse types ---

@pytest.mark.parametrize("parse, good, bad", [
    (harness.positive_int, {"1": 1, "64": 64}, ["0", "-1", "1.5", "x", ""]),
    (harness.nonnegative_int, {"0": 0, "3": 3}, ["-1", "nan", "x"]),
    (harness.int_at_least(2), {"2": 2}, ["1", "0"]),
    (harness.positive_float, {"0.5": 0.5, "2": 2.0}, ["0", "-1", "nan", "inf", "x"]),
    (harness.nonnegative_float, {"0": 0.0, "0.7": 0.7}, ["-0.1", "nan", "-inf"]),
    (harness.fraction, {"0": 0.0, "0.1": 0.1, "1": 1.0}, ["1.5", "-0.1", "nan"]),
    (harness.keep_ratio, {"1": 1.0, "0.8": 0.8}, ["0", "1.5", "nan", "abc"]),
    (harness.torch_device, {"cpu": "cpu", "cuda": "cuda", "cuda:1": "cuda:1"}, ["tpu", "cuda:x", "cpu:0"]),
    (harness.tcp_port, {"1": 1, "8310": 8310, "65535": 65535}, ["0", "65536", "-1", "x"]),
])
def test_argparse_types_take_what_they_name_and_refuse_the_rest(parse, good, bad):
    assert {text: parse(text) for text in good} == good
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace(".", r"\.")):
            parse(text)


def test_a_comma_list_reads_every_item_and_refuses_a_bad_or_empty_one():
    keeps = harness.comma_list(harness.keep_ratio)
    assert keeps("0.9,0.8") == [0.9, 0.8]
    for text in ("0.8,abc", "0.8,", "", "0.8,1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            keeps(text)
    assert harness.comma_list(harness.one_of("a", "b"))("b,a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError, match="one of a, b"):
        harness.comma_list(harness.one_of("a", "b"))("a,c")


def test_the_dtype_choices_are_the_server_configs():
    assert "float32" in harness.MODEL_DTYPES and "fp8" not in harness.MODEL_DTYPES
    assert {"auto", "float16", "fp8"} <= set(harness.KV_CACHE_DTYPES) and "bogus" not in harness.KV_CACHE_DTYPES


# --- the output check ---

def test_check_out_takes_a_writable_path_and_creates_nothing(tmp_path):
    out = tmp_path / "new" / "report.json"
    assert harness.check_out(out) == out.resolve()
    assert not (tmp_path / "new").exists()


def test_check_out_refuses_a_folder_a_file_parent_and_an_unwritable_place(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "report.md").mkdir()  # the markdown beside the report would be a folder
    for bad, why in ((tmp_path, "is a folder"), (tmp_path / "file" / "x.json", "is a file, not a folder"),
                     (tmp_path / "report.json", "is a folder"), (Path("/proc/x.json"), "cannot write")):
        with pytest.raises(ConfigError, match=why):
            harness.check_out(bad)
    assert harness.check_out(tmp_path / "report.json", markdown=False) == (tmp_path / "report.json").resolve()


# --- the `python -m bench.NAME` entry ---

def test_run_cli_turns_a_config_error_into_one_line_and_exit_code_2(capsys):
    def fails(argv):
        raise ConfigError("config file not found: /x.yaml")

    assert harness.run_cli(fails, "bench.x") == 2
    assert capsys.readouterr().err == "bench.x: error: config file not found: /x.yaml\n"
    assert harness.run_cli(lambda argv: 3, "bench.x") == 3
    assert harness.run_cli(lambda argv: None, "bench.x") == 0


def test_run_cli_says_interrupted_on_ctrl_c(capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    assert harness.run_cli(interrupted, "bench.x") == 130
    assert capsys.readouterr().err == "bench.x: interrupted\n"


# Each child imports torch and the server (~5 s of CPU): they all start together, when the first test reads one,
# so they share both cores instead of running one after another; each test reads its own child's result.
PYTHON_M = {"config error": ("bench.engine_step", "--config", "/nonexistent.yaml", "--out", "{out}"),
            "zero concurrency": ("bench.serve", "--concurrency", "0"),
            "bench.cli": ("bench.cli", "engine_step", "--config", "/nonexistent.yaml", "--out", "{out}"),
            "cpu_caps help": ("bench.cpu_caps", "--help"),
            "cpu_caps missing": ("bench.cpu_caps", "avx2", "no-such-command-here"),
            "core_latency help": ("bench.core_latency", "--help"),
            "core_latency refused": ("bench.core_latency", "--rounds", "5")}


@pytest.fixture(scope="module")
def python_m(tmp_path_factory):
    """`python -m` with each PYTHON_M entry's arguments ({out}: a path in a folder of its own), all started at once:
    a function from the entry's name to its finished child."""
    procs = {}
    for name, args in PYTHON_M.items():
        out = tmp_path_factory.mktemp("python-m") / "s.json"
        argv = [sys.executable, "-m", *(arg.replace("{out}", str(out)) for arg in args)]
        procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       cwd=harness.REPO)
    yield from finished_children(procs, PYTHON_TIMEOUT)


def test_python_m_gives_a_config_error_as_one_line(python_m):
    run = python_m("config error")
    assert run.returncode == 2
    assert run.stderr == "bench.engine_step: error: config file not found: /nonexistent.yaml\n"


def test_python_m_refuses_a_zero_concurrency_in_argparse_style(python_m):
    run = python_m("zero concurrency")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == "bench.serve: error: argument --concurrency: expected a positive integer, got '0'"


def test_bench_cli_runs_as_a_module_as_neuronmm_bench_does(python_m):
    run = python_m("bench.cli")
    assert run.returncode == 2 and run.stderr == "neuronmm bench: error: config file not found: /nonexistent.yaml\n"


def test_cpu_caps_help_and_a_missing_command(python_m):
    helped = python_m("cpu_caps help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m bench.cpu_caps")
    missing = python_m("cpu_caps missing")
    assert missing.returncode == 127
    assert missing.stderr == "bench.cpu_caps: error: no-such-command-here: command not found\n"


def test_core_latency_has_a_help_and_refuses_other_arguments(python_m):
    assert python_m("core_latency help").returncode == 0
    refused = python_m("core_latency refused")
    assert refused.returncode == 2 and "unrecognized arguments" in refused.stderr


# --- bad flags, each refused by the tool's parser before any work ---

BAD_FLAGS = [
    (engine_workload.main, ["--concurrency", "0"], "--concurrency"),
    (engine_workload.main, ["--output-len", "-1"], "--output-len"),
    (engine_workload.main, ["--dtype", "bogus"], "--dtype"),
    (engine_workload.main, ["--kv-cache-dtype", "bogus"], "--kv-cache-dtype"),
    (serve.parse_args, ["--concurrency", "0"], "--concurrency"),
    (serve.parse_args, ["--step-batch-sizes", "0"], "--step-batch-sizes"),
    (serve.parse_args, ["--systems", "bogus"], "--systems"),
    (serve.parse_args, ["--input-len", "0"], "--input-len"),
    (speculative.main, ["--concurrency", "0"], "--concurrency"),
    (speculative.main, ["--temperature", "-0.5"], "--temperature"),
    (speculative.main, ["--rounds", "0"], "--rounds"),
    (speculative.main, ["--draft-tokens", "17"], "--draft-tokens"),
    (engine_step.main, ["--steps", "0"], "--steps"),
    (engine_step.main, ["--batch-sizes", "4", "0"], "--batch-sizes"),
    (engine_step.main, ["--kv-cache-dtype", "bogus"], "--kv-cache-dtype"),
    (kv_cache_quality.main, ["--kv-cache-dtypes", "bogus"], "--kv-cache-dtypes"),
    (kv_cache_quality.main, ["--windows", "0"], "--windows"),
    (lora_step.main, ["--rank", "0"], "--rank"),
    (cpu_ops.main, ["--positions", "0"], "--positions"),
    (load.parse_args, ["--disconnect-fraction", "nan"], "--disconnect-fraction"),
    (load.parse_args, ["--runs", "0"], "--runs"),
    (multiturn.main, ["--turns", "1"], "--turns"),
    (position_nll.main, ["--compressed", "x", "--windows", "0"], "--windows"),
    (pruning_baseline.main, ["--keep", "1.5"], "--keep"),
    (pruning_baseline.main, ["--block", "0"], "--block"),
    (compression_quality.main, ["--keeps", "0.8,abc"], "--keeps"),
    (recovery.main, ["--keeps", "abc"], "--keeps"),
    (recovery.main, ["--allocations", "uniform,bogus"], "--allocations"),
    (structured_output.main, ["--rounds", "0"], "--rounds"),
    (structured_output.main, ["--dtype", "bogus"], "--dtype"),
    (structured_output.main, ["--port", "0"], "--port"),
    (engine_step.main, ["--seed", "-1"], "--seed"),
    (serve.parse_args, ["--seed", "-1"], "--seed"),
    (load.parse_args, ["--seed", "x"], "--seed"),
    (multiturn.main, ["--seed", "-2"], "--seed"),
]


@pytest.mark.parametrize("entry, flags, flag", BAD_FLAGS, ids=[f"{e.__module__}{f}" for e, f, _ in BAD_FLAGS])
def test_a_bad_count_or_choice_is_a_usage_error(entry, flags, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        entry(flags)
    assert stop.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert ": error: " in last and flag in last


def test_cuda_step_refuses_an_unknown_device(capsys):
    from bench import cuda_step

    with pytest.raises(SystemExit) as stop:
        cuda_step.main(["--device", "tpu"])
    assert stop.value.code == 2 and "expected cpu, cuda or cuda:N, got 'tpu'" in capsys.readouterr().err


# --- a bad --out, refused before any model loads or any work runs ---

def _refuse(*args, **kwargs):
    raise AssertionError("the work started before the output path was checked")


BAD_OUT = [  # (main, flags, the first step of its work)
    (engine_step.main, [], (engine_step, "load_config")),
    (engine_workload.main, [], (engine_workload, "load_config")),
    (serve.main, [], (serve, "load_config")),
    (speculative.main, [], (speculative, "load_config")),
    (kv_cache_quality.main, [], (kv_cache_quality, "load_config")),
    (lora_step.main, [], (lora_step, "load_config")),
    (grammar_engines.main, [], (grammar_engines, "load_config")),
    (multiturn.main, [], (multiturn, "load_config")),
    (structured_output.main, [], (structured_output, "load_config")),
    (load.main, [], (load, "load_config")),
    (read_bandwidth.main, ["--sizes-mb", "1"], (read_bandwidth, "readings")),
    (peak_rate.main, [], (peak_rate, "peak_kinds")),
    (cpu_ops.main, [], (cpu_ops, "gemm_rows")),
    (kernels.main, [], (kernels, "run_bench")),
    (position_nll.main, ["--compressed", "x"], (position_nll, "load_eval_model")),
    (pruning_baseline.main, [], (pruning_baseline, "run")),
    (compression_quality.main, [], (compression_quality, "run")),
    (recovery.main, [], (recovery, "run")),
]


@pytest.mark.parametrize("entry, flags, work", BAD_OUT, ids=[e.__module__ for e, _, _ in BAD_OUT])
def test_a_bad_out_is_refused_before_the_work(entry, flags, work, tmp_path, monkeypatch):
    monkeypatch.setattr(*work, _refuse)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--out .*is a file, not a folder"):
        entry([*flags, "--out", str(tmp_path / "file" / "report.json")])
    with pytest.raises(ConfigError, match="--out .*is a folder"):
        entry([*flags, "--out", str(tmp_path)])


# --- checks that need the model's shape, made before the long passes ---

@pytest.mark.parametrize("entry", [compression_quality.main, recovery.main], ids=lambda e: e.__module__)
@pytest.mark.parametrize("flags, message", [
    (["--ppl-limit", "wikitext2=0"], "--ppl-limit: expected a positive integer"),
    (["--ppl-limit", "lambada=5"], "'lambada' is not among the --ppl corpora"),
    (["--ppl", "wikitext2,bogus"], "--ppl: unknown name 'bogus'"),
    (["--tasks", "arc_easy,bogus"], "--tasks: unknown name 'bogus'"),
])
def test_the_eval_lists_are_checked_before_the_compressions(entry, flags, message, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[entry.__module__], "run", _refuse)
    with pytest.raises(ConfigError, match=message):
        entry([*flags, "--out", str(tmp_path / "report.json")])


def test_position_nll_checks_the_artifact_before_the_dense_model(tmp_path, monkeypatch):
    monkeypatch.setattr(position_nll, "load_eval_model", _refuse)
    with pytest.raises(ConfigError, match="not a compressed artifact"):
        position_nll.main(["--compressed", str(tmp_path / "none"), "--out", str(tmp_path / "p.json")])


def test_pruning_budget_is_checked_with_the_pruners_own_rule():
    shape = SimpleNamespace(num_hidden_layers=2, hidden_size=8, intermediate_size=256)
    pruning_baseline.check_budget(shape, 0.8, 128)  # 256 = 2 blocks of 128
    with pytest.raises(ConfigError, match="--block 100: intermediate size 256 is not a multiple of the block 100"):
        pruning_baseline.check_budget(shape, 0.8, 100)


def test_engine_step_names_the_context_over_the_models_limit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    engine_step._check_context(tmp_path, SimpleNamespace(context=32, steps=10, hold=0.0))
    with pytest.raises(ConfigError, match="--context 100 is over the model's limit: .* 64 "):
        engine_step._check_context(tmp_path, SimpleNamespace(context=100, steps=10, hold=0.0))


# --- loops that a zero concurrency would hang, refused where they start ---

def test_the_level_loops_refuse_a_zero_concurrency():
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        engine_workload.run_level(None, [[1]], 0, 4, False)
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        speculative.run(None, [[1]], 4, 0, 0.0)
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        asyncio.run(serve.run_level("http://127.0.0.1:1", "m", [[1]], 0, 4, False))


# --- bench.serve's engine-only children ---

def test_engine_step_children_write_beside_out_and_a_default_run_keeps_its_old_place(tmp_path):
    assert serve.engine_step_out(tmp_path / "run.json", "neuronmm compressed") == \
        tmp_path / "run-engine_step-neuronmm-compressed.json"
    assert serve.engine_step_out(None, "neuronmm") == serve.RESULTS / "engine_step-neuronmm.json"


def test_a_failed_engine_step_child_is_noted_and_the_others_kept(tmp_path, monkeypatch):
    commands = []

    def fake_run_logged(cmd, log_path):
        commands.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        if "--compressed" in cmd:
            raise SystemExit(f"command failed (2): {' '.join(cmd)}\nbench.engine_step: error: bad artifact")
        out.write_text(json.dumps({"weight_bytes": 1, "dtype": "float32", "kv_bytes_per_position": 2,
                                   "arithmetic": {}, "gemm_peak": None, "rows": [{"batch_size": 1}]}))
        return 1.0, 1.0

    monkeypatch.setattr(serve, "run_logged", fake_run_logged)
    failures: list[str] = []
    rows = serve.engine_steps("c.yaml", "art", [1], None, tmp_path / "run.json", failures)
    assert [r["system"] for r in rows] == ["neuronmm"]
    assert (tmp_path / "run-engine_step-neuronmm.json").is_file()
    assert len(failures) == 1 and failures[0].startswith("engine_step of neuronmm compressed failed: command failed")
    assert all(str(serve.RESULTS) not in " ".join(cmd) for cmd in commands)  # the tracked results are left alone
