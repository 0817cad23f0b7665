"""The evaluation loaders parse every shared dataset the way the harness and the papers read it."""

from __future__ import annotations

import pytest

from compression.evaluation import corpora, tasks
from server.config import data_file
from server.fileio import read_jsonl_texts
from server.errors import ConfigError

EXPECTED_ITEMS = {"arc_easy": 1188, "arc_challenge": 586, "piqa": 919, "hellaswag": 5021, "winogrande": 633,
                  "boolq": 1635, "openbookqa": 250}
NUM_CHOICES = {"arc_easy": {3, 4, 5}, "arc_challenge": {3, 4, 5}, "piqa": {2}, "hellaswag": {4}, "winogrande": {2},
               "boolq": {2}, "openbookqa": {4}}


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_task_loads_with_valid_gold(name):
    items = tasks.get_task(name).load()
    assert len(items) == EXPECTED_ITEMS[name]
    for item in items:
        assert len(item.requests) in NUM_CHOICES[name]
        assert 0 <= item.gold < len(item.requests)
        assert len(item.choice_texts) == len(item.requests)
        assert all(cont.startswith(" ") and cont.strip() for _, cont in item.requests)
    # Not degenerate: gold is not always the same index.
    assert len({item.gold for item in items}) > 1


def test_prompt_formats_match_the_harness():
    arc = tasks.arc_easy()[0]
    assert arc.requests[0][0].startswith("Question: Which statement best explains")
    assert arc.requests[0][0].endswith("\nAnswer:")
    assert arc.requests[arc.gold][1] == " Sunlight is the source of energy for nearly all ecosystems."
    boolq = tasks.boolq()[0]
    assert boolq.requests[0][0].startswith("Ethanol fuel -- ")
    assert boolq.requests[0][0].endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert [c for _, c in boolq.requests] == [" no", " yes"] and boolq.gold == 0
    piqa = tasks.piqa()[0]
    assert piqa.requests[0][0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    obqa = tasks.openbookqa()[0]
    assert obqa.requests[0][0].endswith("the best way to save money is to") and obqa.gold == 1


def test_hellaswag_restores_capitalised_ctx_b():
    first = tasks.hellaswag()[0]
    assert first.requests[0][0] == "Roof shingle removal: A man is sitting on a roof. He"
    assert first.gold == 3 and first.requests[3][1] == " starts pulling up roofing on a roof."
    assert tasks.hellaswag_preprocess("Clean the tub [title] Fill it [step] up.") == "Clean the tub. Fill it up."


def test_winogrande_partial_scoring_shares_the_continuation():
    item = tasks.winogrande()[0]
    (ctx0, cont0), (ctx1, cont1) = item.requests
    assert cont0 == cont1 == " always got the easier cases."
    assert ctx0.endswith("so Sarah") and ctx1.endswith("so Maria") and item.gold == 1


def test_corpora_follow_the_protocol():
    wiki = corpora.wikitext2_text()
    assert wiki.startswith("\n\n = Robert Boulter = \n\n\n")  # blank first row, then "\n\n"-joined rows
    ptb = corpora.ptb_text()
    assert ptb.startswith("no it was n't black monday\n\nbut while")
    c4 = corpora.c4_text()
    assert c4.startswith("We offer valet parking") and c4.count("\n\n") >= corpora.C4_EVAL_DOCUMENTS - 1
    assert len(c4) < len("\n\n".join(read_jsonl_texts(data_file("c4", "c4-validation-sample.jsonl"))))


def test_missing_data_dir_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURONMM_DATA_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="evaluation data not found: .*wiki.test.raw"):
        corpora.corpus_text("wikitext2")
    with pytest.raises(ConfigError, match="unknown task"):
        tasks.get_task("mmlu")


def test_malformed_record_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "boolq").mkdir()
    (tmp_path / "boolq" / "val.jsonl").write_text('{"question": "q", "passage": "p", "label": "true"}\n{"question": 1}\n')
    monkeypatch.setenv("NEURONMM_DATA_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"val.jsonl:2: BoolQ record"):
        tasks.boolq()
