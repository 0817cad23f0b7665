"""Perplexity corpora as one string each, joined the way SVD-LLM's `get_test_data` joins them.

- wikitext2: rows of `wiki.test.raw` as the HF `wikitext-2-raw-v1` test split holds them (each line
  with its newline; whitespace-only lines become ""), joined with "\\n\\n" (GPTQ and SVD-LLM).
- ptb: `ptb.test.txt` lines stripped (the HF `ptb_text_only` `sentence` field), joined with
  "\\n\\n" (SVD-LLM's test loader; GPTQ's `ptb-new` variant joins with " " instead).
- c4: the `text` of the first C4_EVAL_DOCUMENTS documents of the local validation sample, joined with
  "\\n\\n" (SVD-LLM takes the first 2000 documents of its own validation file; ours holds 1500 of unknown
  selection, so C4 numbers are not comparable digit-for-digit with papers). Recovery trains on the
  documents after them, so C4 perplexity after recovery is measured on text it never saw.
"""

from __future__ import annotations

from server.config import data_file
from server.errors import ConfigError
from server.fileio import read_jsonl_texts

CORPORA = ("wikitext2", "ptb", "c4")
# The C4 evaluation split: ~500 windows of 512 tokens, far more than any limited evaluation reads.
C4_EVAL_DOCUMENTS = 500


def wikitext2_text() -> str:
    """WikiText-2 raw test split, "\\n\\n"-joined."""
    lines = data_file("wikitext2", "wiki.test.raw").read_text(encoding="utf-8").splitlines(keepends=True)
    return "\n\n".join(line if line.strip() else "" for line in lines)


def ptb_text() -> str:
    """Penn Treebank test split (Mikolov's preprocessing), one sentence a row, "\\n\\n"-joined."""
    lines = data_file("ptb", "ptb.test.txt").read_text(encoding="utf-8").splitlines()
    return "\n\n".join(line.strip() for line in lines)


def c4_text() -> str:
    """The C4 evaluation split (the sample's first C4_EVAL_DOCUMENTS documents), "\\n\\n"-joined."""
    return "\n\n".join(read_jsonl_texts(data_file("c4", "c4-validation-sample.jsonl"))[:C4_EVAL_DOCUMENTS])


def corpus_text(name: str) -> str:
    """The evaluation text of a corpus by name (wikitext2, ptb, c4)."""
    loaders = {"wikitext2": wikitext2_text, "ptb": ptb_text, "c4": c4_text}
    if name not in loaders:
        raise ConfigError(f"--ppl: unknown corpus {name!r} (choose from {', '.join(CORPORA)})")
    return loaders[name]()
