"""bench.grammar_engines measures llguidance along a real answer; the footprint counts what is installed."""

from __future__ import annotations

import json

from bench.grammar_engines import ANSWER, installed_mib, time_llguidance
from server.runtime import load_tokenizer


def test_llguidance_accepts_the_reference_answer_token_by_token(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    ids = tok.encode(json.dumps(ANSWER), add_special_tokens=False)
    row = time_llguidance(tok, vocab, ids)
    assert row["tokens"] == len(ids) > 20
    assert row["mask_us_p99"] >= row["mask_us_p50"] > 0


def test_footprint_counts_installed_and_names_missing():
    size, missing = installed_mib("llguidance")
    assert size > 1 and missing == []
    assert installed_mib("no-such-distribution-here") == (0.0, ["no-such-distribution-here"])
