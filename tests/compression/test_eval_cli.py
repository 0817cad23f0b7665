"""`neuronmm eval` end to end on a tiny model (finite numbers, JSON + markdown) and its one-line errors."""

from __future__ import annotations

import json
import math

import pytest

from server.cli import main


@pytest.fixture()
def tiny_yaml(tmp_path, tiny_model_dir):
    path = tmp_path / "tiny.yaml"
    path.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    return path


def test_eval_small_slice_gives_finite_numbers(tiny_yaml, tmp_path, capsys):
    out = tmp_path / "res" / "results.json"
    rc = main(["eval", "--config", str(tiny_yaml), "--seqlen", "32", "--limit", "2", "--num-threads", "1",
               "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result["perplexity"]) == {"wikitext2", "ptb", "c4"}
    assert len(result["zeroshot"]) == 7 and result["label"] == "dense" and result["compressed"] is None
    for ppl in result["perplexity"].values():
        assert ppl["num_windows"] == 2 and ppl["seqlen"] == 32 and math.isfinite(ppl["perplexity"])
        # A random model is near-uniform over the vocabulary, far from a trained one.
        assert ppl["perplexity"] > 1000
    for task in result["zeroshot"].values():
        assert task["num_items"] == 2 and 0.0 <= task["acc"] <= 1.0
        assert (task["acc_norm"] is None) == (task["task"] in ("winogrande", "boolq"))
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| model | params | WikiText-2 ppl | PTB ppl | C4 ppl | ARC-E |")
    assert "| dense |" in table and table in capsys.readouterr().out


def test_eval_int8_runs_the_served_quantisation(tiny_yaml, tmp_path):
    """--quantization int8 evaluates every linear as the int8 panel GEMM computes it: another perplexity, labelled."""
    runs = {}
    for extra in ([], ["--quantization", "int8"]):
        out = tmp_path / f"r{len(extra)}.json"
        assert main(["eval", "--config", str(tiny_yaml), "--seqlen", "32", "--limit", "2", "--num-threads", "1",
                     "--tasks", "none", "--ppl", "wikitext2", "--out", str(out), *extra]) == 0
        runs[len(extra)] = json.loads(out.read_text())
    assert runs[2]["label"] == "dense, int8" and runs[2]["quantization"] == "int8" and runs[0]["quantization"] is None
    dense, int8 = (runs[n]["perplexity"]["wikitext2"]["perplexity"] for n in (0, 2))
    assert int8 != dense and abs(int8 / dense - 1) < 0.05


@pytest.mark.parametrize("argv, fragment", [
    (["--tasks", "mmlu"], "--tasks: unknown name 'mmlu'"),
    (["--ppl", "wiki103"], "--ppl: unknown name 'wiki103'"),
    (["--limit", "0"], "--limit: expected a positive integer"),
    (["--seqlen", "2k"], "--seqlen: expected a positive integer"),
    (["--seqlen", "100000", "--tasks", "none", "--ppl", "ptb"], "exceeds the model's"),
    (["--compressed", "/nonexistent/artifact"], "--compressed: not a directory"),
    (["--tasks", "none", "--ppl", "none"], "nothing to evaluate"),
    (["--ppl", "ptb", "--ppl-limit", "c4=3"], "'c4' is not among the --ppl corpora"),
    (["--tasks", "none", "--ppl", "ptb", "--out", "/proc/neuronmm-results.json"], "--out /proc/neuronmm-results.json"),
    (["--tasks", "none", "--ppl", "ptb", "--out", "/"], "is a folder"),
])
def test_bad_args_are_one_line_errors(tiny_yaml, capsys, argv, fragment):
    assert main(["eval", "--config", str(tiny_yaml), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("neuronmm eval: error:") and fragment in err[0]


def test_compressed_dir_without_manifest_is_rejected(tiny_yaml, tmp_path, capsys):
    assert main(["eval", "--config", str(tiny_yaml), "--compressed", str(tmp_path), "--tasks", "none",
                 "--ppl", "ptb"]) == 2
    assert "manifest.json" in capsys.readouterr().err


def test_per_corpus_window_limits():
    from compression.evaluation.cli import parse_ppl_limits

    corpora = ["wikitext2", "ptb", "c4"]
    assert parse_ppl_limits("wikitext2=40,ptb=10", 5, corpora) == {"wikitext2": 40, "ptb": 10, "c4": 5}
    assert parse_ppl_limits("7", None, corpora) == dict.fromkeys(corpora, 7)
    assert parse_ppl_limits(None, None, ["ptb"]) == {"ptb": None}


def test_table_legend_names_each_tasks_item_count():
    from compression.evaluation.report import table_legend

    run = {"zeroshot": {"arc_easy": {"num_items": 1188}, "hellaswag": {"num_items": 5021}}}
    legend = table_legend([run])
    assert "items per task 1188, 5021" in legend and "first 1188 items per task" not in legend
