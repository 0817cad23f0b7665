"""bench.kv_cache_quality: one row per cache dtype, scored against the first; agreement counts where tokens part."""

from __future__ import annotations

import json

import pytest

from bench import kv_cache_quality
from server.models import fused_ops
from server.models.int8_linear import int8_available


def test_agreement_finds_the_first_differing_token():
    result = kv_cache_quality.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert result == {"identical": 0.5, "mean_first_difference": 2.0, "first_differences": [3, 1]}


def _scored(model_dir, tmp_path, *flags: str) -> tuple[list[dict], str]:
    """bench.kv_cache_quality's rows and markdown for the tiny model on a small slice, with `flags` added."""
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {{name: tiny, source: safetensors, path: {model_dir}}}\n"
                      f"cache_dir: {tmp_path / 'cache'}\n")
    out = tmp_path / "kq.json"
    assert kv_cache_quality.main(["--config", str(config), "--windows", "2", "--seqlen", "32", "--greedy-prompts", "2",
                                  "--prompt-len", "8", "--greedy-tokens", "4", "--out", str(out), *flags]) == 0
    return json.loads(out.read_text())["rows"], out.with_suffix(".md").read_text()


def test_each_cache_dtype_is_scored_against_the_first(tiny_model_dir, tmp_path):
    rows, table = _scored(tiny_model_dir, tmp_path)
    assert [r["kv_cache_dtype"] for r in rows] == ["float32", "float16", "bfloat16"]
    assert rows[0]["ppl_ratio"] == 1.0 and rows[0]["identical"] == 1.0
    assert all(abs(r["ppl_ratio"] - 1) < 0.01 and r["ppl"] > 1 for r in rows)
    assert table.startswith("CPU flags")


@pytest.mark.skipif(not (fused_ops.load() and int8_available()), reason="int8 weights need AVX512-VNNI or AVX2")
def test_int8_weights_are_scored_beside_the_models_own(tiny_model_dir, tmp_path):
    rows, table = _scored(tiny_model_dir, tmp_path, "--kv-cache-dtypes", "auto", "--quantizations", "none", "int8")
    assert [r["quantization"] for r in rows] == [None, "int8"]
    assert rows[1]["ppl_ratio"] != 1.0 and abs(rows[1]["ppl_ratio"] - 1) < 0.05
    assert "| float32 | int8 |" in table
