"""bench.recovery's table: the gap closed is measured against the whitened-uniform row of the same keep ratio."""

import pytest

from bench.recovery import _gaps, markdown


def test_gap_closed_is_against_uniform_of_the_same_keep():
    rows = [{"label": "dense", "keep_ratio": None, "ppl": {"wikitext2": 30.0}},
            {"label": "whitened uniform", "keep_ratio": 0.8, "ppl": {"wikitext2": 150.0}},
            {"label": "whitened uniform", "keep_ratio": 0.9, "ppl": {"wikitext2": 80.0}},
            {"label": "whitened sensitivity", "keep_ratio": 0.8, "ppl": {"wikitext2": 90.0}},
            {"label": "whitened sensitivity + LoRA recovery", "keep_ratio": 0.9, "ppl": {"wikitext2": 55.0}}]
    _gaps(rows)
    assert rows[3]["gap_closed"]["wikitext2"] == pytest.approx(0.5)
    assert rows[4]["gap_closed"]["wikitext2"] == pytest.approx(0.5)
    assert "gap_closed" not in rows[1] and "gap_closed" not in rows[0]
    table = markdown({"rows": rows}).splitlines()
    assert len(table) == 2 + len(rows) and "| 50% |" in table[5] and table[2].startswith("| - | dense |")


def test_row_without_a_uniform_baseline_gets_no_gap():
    rows = [{"label": "dense", "ppl": {"wikitext2": 30.0}},
            {"label": "whitened sensitivity", "keep_ratio": 0.8, "ppl": {"wikitext2": 90.0}}]
    _gaps(rows)
    assert "gap_closed" not in rows[1]
