"""bench.cuda_step: a random model of the given architecture, timed per dtype and batch; without CUDA only the CPU
run (op by op) is possible and asking for CUDA is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from bench import cuda_step


def test_random_model_has_the_architecture_and_the_tokenizer(tiny_model_dir, tmp_path):
    out = cuda_step.random_model(tiny_model_dir, tmp_path / "m", seed=0)
    assert LlamaConfig.from_pretrained(out).to_dict()["num_hidden_layers"] == \
        LlamaConfig.from_pretrained(tiny_model_dir).to_dict()["num_hidden_layers"]
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (out / "model.safetensors").is_file()


def test_cpu_run_reports_each_batch_op_by_op(tiny_model_dir, tmp_path):
    out = tmp_path / "cs.json"
    assert cuda_step.main(["--device", "cpu", "--model-config", str(tiny_model_dir), "--dtypes", "float32",
                           "--batch-sizes", "1", "3", "--steps", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch_size"], r["cuda_graphs"]) for r in rows] == [(1, False), (3, False)]
    assert all(r["step_ms_p50"] > 0 for r in rows)
    assert "op by op" in out.with_suffix(".md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_cuda_without_a_device_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cuda_step.main([])
    assert exc.value.code == 2 and "no CUDA device" in capsys.readouterr().err
