"""bench.cpu_ops: every op it times runs and lands in the report, in the dtype this build's panels serve."""

from __future__ import annotations

import json

import pytest
import torch

from bench import cpu_ops
from server.models import fused_ops


@pytest.fixture
def few_calls(monkeypatch):
    """best_us at no more than 20 calls a timing: these tests check what lands in the report, not the figures (the
    bench's 20,000 // rows calls a timing took ~8 s on an idle 2-core machine, minutes beside another busy job)."""
    best_us = cpu_ops.best_us
    monkeypatch.setattr(cpu_ops, "best_us", lambda fn, calls, repeats: best_us(fn, min(calls, 20), repeats))


@pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")
def test_the_report_holds_every_op(tmp_path, few_calls):
    out = tmp_path / "ops.json"
    assert cpu_ops.main(["--rows", "1", "5", "--step-rows", "3", "--step-layers", "1", "--positions", "40",
                         "--repeats", "1", "--prefill-chunks", "0:9", "20:5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(g["n"], g["k"], g["rows"]) for g in report["gemm"]] == [(1536, 576, 1), (1536, 576, 5),
                                                                      (576, 1536, 1), (576, 1536, 5)]
    assert all(g["us"] > 0 and g["dtype"] in ("bfloat16", "float32") for g in report["gemm"])
    [step] = report["step_linears"]
    assert (step["layers"], step["rows"], step["dtype"]) == (1, 3, report["gemm"][0]["dtype"])
    n_by_k = sum(n * k for n, k in cpu_ops.STEP_SHAPES) + cpu_ops.VOCAB * cpu_ops.HIDDEN
    assert step["weight_mb"] == pytest.approx(n_by_k * (2 if step["dtype"] == "bfloat16" else 4) / 1e6)
    assert step["ms"] > 0 and step["gflops"] == pytest.approx(2 * 3 * n_by_k / step["ms"] / 1e6)
    pairs = [("float32", "float32"), ("float32", "float16"), ("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn")]
    assert [(a["dtype"], a["cache_dtype"], a["contexts"]) for a in report["attention"]] == (
        [(*pair, "16 x 40") for pair in pairs] + [(*pair, "8 x 5 + 8 x 75") for pair in pairs])
    assert all(a["positions"] == 40 for a in report["attention"])  # the uneven batch holds as many positions
    assert all(a["ms"] > 0 for a in report["attention"])
    assert [(a["prefix"], a["tokens"], a["cache_dtype"]) for a in report["prefill_attention"]] == [
        (0, 9, "float32"), (0, 9, "float16"), (20, 5, "float32"), (20, 5, "float16")]
    # the causal products: 4 x 64 x 9 heads x (1 + .. + 9) positions x 30 layers over the time
    first = report["prefill_attention"][0]
    assert first["ms"] > 0 and first["gflops"] == pytest.approx(4 * 64 * 9 * 45 * 30 / first["ms"] / 1e6)
    assert set(report["sampler"]) == {"argmax_rows", "sample_temperature", "torch_argmax"}
    assert report["gguf_gemm"] == []  # only with --gguf-blocks
    assert out.with_suffix(".md").read_text().startswith("CPU flags")


@pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")
def test_gguf_blocks_are_timed_beside_fp32_panels_of_their_weights():
    """--gguf-blocks: a step's linears over block panels (1.25 bytes a weight) and over fp32 panels (4)."""
    rows = cpu_ops.gguf_block_step([2], repeats=1, layers=1)
    assert [(r["dtype"], r["rows"], r["layers"]) for r in rows] == [("gguf blocks", 2, 1), ("float32", 2, 1)]
    n_by_k = sum(n * k for n, k in cpu_ops.STEP_SHAPES) + cpu_ops.VOCAB * cpu_ops.HIDDEN
    blocks, fp32 = rows
    assert fp32["weight_mb"] == pytest.approx(n_by_k * 4 / 1e6)
    assert blocks["weight_mb"] == pytest.approx(n_by_k * 1.25 / 1e6, rel=0.01)  # + the padded columns' share
    assert all(r["ms"] > 0 and r["gflops"] == pytest.approx(2 * 2 * n_by_k / r["ms"] / 1e6) for r in rows)


@pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")
def test_gguf_block_gemms_are_timed_on_one_thread_and_on_all(few_calls):
    """--gguf-blocks: each panel GEMM over block panels and fp32 panels, on one thread and on all; the thread count
    is put back."""
    threads = torch.get_num_threads()
    rows = cpu_ops.gguf_block_rows([3], repeats=1)
    assert torch.get_num_threads() == threads
    counts = list(dict.fromkeys((1, threads)))
    assert [(r["n"], r["k"], r["threads"], r["dtype"]) for r in rows] == [
        (n, k, t, kind) for n, k in cpu_ops.GEMMS for t in counts for kind in ("gguf blocks", "float32")]
    assert all(r["rows"] == 3 and r["gflops"] == pytest.approx(2 * 3 * r["n"] * r["k"] / r["us"] / 1e3) for r in rows)
    report = {"cpu_flags": [], "caps_in_force": None, "gemm": [], "gguf_gemm": rows, "step_linears": [],
              "attention": [], "prefill_attention": [], "sampler": {}}
    table = cpu_ops.markdown(report)
    assert "| GEMM | weights | rows | threads | µs | GFLOP/s |" in table and table.count("| gguf blocks | 3 |") == len(
        cpu_ops.GEMMS) * len(counts)


@pytest.mark.parametrize("chunks", [["128"], ["0:0"], ["-1:5"], ["a:b"]])
def test_a_bad_prefill_chunk_is_a_one_line_error(chunks, capsys):
    with pytest.raises(SystemExit) as exit_:
        cpu_ops.main(["--prefill-chunks", *chunks])
    assert exit_.value.code == 2 and "PREFIX:TOKENS" in capsys.readouterr().err
