"""Logits processors: logit_bias, min_tokens, repetition_penalty, min_p and the grammar mask."""

from __future__ import annotations

import json
import math
import pickle
import re

import pytest
import torch
from transformers import AutoTokenizer

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.json_grammar import lark_json
from server.engine.logits_processors import apply_logits_processors
from server.engine.sampling_params import SamplingParams, StructuredOutput
from server.engine.sequence import Sequence
from server.engine.structured import grammar_error, token_bytes

VOCAB = 64
EOS = 2


def _seq(prompt=(5, 6), output=(), tokenizer=None, **params) -> Sequence:
    detok = IncrementalDetokenizer(tokenizer, []) if tokenizer is not None else None
    seq = Sequence("r", 0, list(prompt), SamplingParams(max_tokens=64, **params), detok, frozenset({EOS}))
    seq.output_ids = list(output)
    return seq


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


def test_logit_bias_adds_to_the_named_tokens_only():
    logits = torch.zeros(2, VOCAB)
    apply_logits_processors(logits, [_seq(logit_bias={7: 100.0, 9: -100.0}), _seq()])
    assert logits[0, 7] == 100.0 and logits[0, 9] == -100.0 and logits[0].abs().sum() == 200.0
    assert logits[1].abs().sum() == 0  # another row is untouched


def test_allowed_token_ids_leave_only_those():
    logits = torch.zeros(2, VOCAB)
    apply_logits_processors(logits, [_seq(allowed_token_ids=[3, 9]), _seq()])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 9]
    assert torch.isfinite(logits[1]).all()


def test_bad_words_ban_the_token_that_would_complete_them():
    words = [[7], [4, 5, 6]]
    logits = torch.zeros(3, VOCAB)
    apply_logits_processors(logits, [_seq(output=[1, 4, 5], bad_words_ids=words),
                                     _seq(output=[4, 9], bad_words_ids=words), _seq(bad_words_ids=words)])
    assert math.isinf(logits[0, 7]) and math.isinf(logits[0, 6])  # a one-token word always; 4 5 -> not 6
    assert math.isinf(logits[1, 7]) and torch.isfinite(logits[1, 6])  # 9 broke the run
    assert torch.isinf(logits[2]).sum() == 1  # no output yet: only the one-token word


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    apply_logits_processors(logits, [_seq(output=[3], min_tokens=2, stop_token_ids=[11]),
                                     _seq(output=[3, 4], min_tokens=2, stop_token_ids=[11])])
    assert math.isinf(logits[0, EOS]) and math.isinf(logits[0, 11]) and torch.isfinite(logits[0, 12])
    assert torch.isfinite(logits[1]).all()  # two tokens are out: EOS is allowed again


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.full((1, VOCAB), 2.0)
    logits[0, 6] = -2.0
    apply_logits_processors(logits, [_seq(prompt=[5, 6], output=[8, 8], repetition_penalty=2.0)])
    assert logits[0, 5] == 1.0 and logits[0, 8] == 1.0  # positive: divided
    assert logits[0, 6] == -4.0  # negative: multiplied
    assert logits[0, 9] == 2.0  # unseen: untouched


def test_min_p_is_relative_to_the_top_token_at_the_temperature():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(2, 1)
    apply_logits_processors(logits, [_seq(min_p=0.2, temperature=1.0), _seq(min_p=0.2, temperature=0.0)])
    # 0.05 < 0.2 * 0.5 is dropped, 0.15 >= 0.1 stays; greedy rows are left alone
    assert torch.isfinite(logits[0, :3]).all() and math.isinf(logits[0, 3])
    assert torch.isfinite(logits[1]).all()


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "colour": {"enum": ["red", "green"]}},
          "required": ["n", "colour"], "additionalProperties": False}


def _decode_under_grammar(tokenizer, spec: StructuredOutput, seed: int, n: int = 1) -> list[Sequence]:
    """Greedy over random logits, only the grammar deciding what is valid; stops at EOS."""
    seqs = [_seq(tokenizer=tokenizer, temperature=0.0, structured=spec) for _ in range(n)]
    vocab = len(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(60):
        live = [s for s in seqs if not s.output_ids or s.output_ids[-1] != EOS]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 5
        apply_logits_processors(logits, live)
        for seq, token in zip(live, logits.argmax(-1).tolist()):
            seq.output_ids.append(token)
    return seqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_grammar_forces_valid_output_then_eos(tokenizer, seed):
    seqs = _decode_under_grammar(tokenizer, StructuredOutput("json_schema", json.dumps(SCHEMA)), seed, n=2)
    for seq in seqs:
        assert seq.output_ids[-1] == EOS, "a finished grammar must end the sequence"
        value = json.loads(tokenizer.decode(seq.output_ids[:-1]))
        assert set(value) == {"n", "colour"} and 0 <= value["n"] <= 99 and value["colour"] in ("red", "green")


def test_finished_grammar_allows_only_eos(tokenizer):
    seq = _seq(tokenizer=tokenizer, structured=StructuredOutput("json_object"))
    seq.output_ids = tokenizer.encode('{"a": 1}')
    logits = torch.zeros(1, len(tokenizer))
    apply_logits_processors(logits, [seq])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_lark_grammar_with_embedded_schema(tokenizer):
    lark = 'start: "<tool_call>\\n" ' + lark_json(SCHEMA) + ' "\\n</tool_call>"'
    (seq,) = _decode_under_grammar(tokenizer, StructuredOutput("lark", lark), seed=3)
    text = tokenizer.decode(seq.output_ids[:-1])
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    assert json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])["colour"] in ("red", "green")


@pytest.mark.parametrize("spec, pattern", [
    (StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
    (StructuredOutput("choice", json.dumps(["yes", "no", "a \"quoted\" one"])), r'yes|no|a "quoted" one'),
    (StructuredOutput("grammar", 'root ::= ("on" | "off") " " [0-9] [0-9]?'), r"(on|off) [0-9][0-9]?"),  # GBNF
    (StructuredOutput("grammar", 'start: ("on" | "off") " " /[0-9]{1,2}/'), r"(on|off) [0-9][0-9]?"),  # Lark
])
@pytest.mark.parametrize("seed", [0, 1])
def test_regex_choice_and_grammar_specs_force_matching_output(tokenizer, spec, pattern, seed):
    for seq in _decode_under_grammar(tokenizer, spec, seed, n=2):
        assert seq.output_ids[-1] == EOS
        assert re.fullmatch(pattern, tokenizer.decode(seq.output_ids[:-1]))


def test_whitespace_pattern_lets_json_breathe(tokenizer):
    spec = StructuredOutput("json_object", whitespace_pattern=" {2}")
    seq = _seq(tokenizer=tokenizer, structured=spec)
    seq.output_ids = tokenizer.encode("{")
    logits = torch.zeros(1, len(tokenizer))
    apply_logits_processors(logits, [seq])
    space = tokenizer.encode("  ", add_special_tokens=False)
    assert len(space) == 1 and torch.isfinite(logits[0, space[0]])  # two spaces after "{" are allowed
    seq = _seq(tokenizer=tokenizer, structured=StructuredOutput("json_object"))
    seq.output_ids = tokenizer.encode("{")
    logits = torch.zeros(1, len(tokenizer))
    apply_logits_processors(logits, [seq])
    assert math.isinf(logits[0, space[0]])  # by default JSON gets no free whitespace


def test_spec_is_plain_picklable_data_and_bad_schemas_are_named():
    params = SamplingParams(structured=StructuredOutput("json_schema", json.dumps(SCHEMA)), logit_bias={1: 2.0})
    assert pickle.loads(pickle.dumps(params)) == params
    assert grammar_error(StructuredOutput("json_schema", json.dumps(SCHEMA))) is None
    assert "nonsense" in grammar_error(StructuredOutput("json_schema", '{"type": "nonsense"}'))
    assert grammar_error(StructuredOutput("json_schema", "{not json")).startswith("not JSON")
    assert "unclosed character class" in grammar_error(StructuredOutput("regex", "[a-"))
    assert "GBNF" in grammar_error(StructuredOutput("grammar", "root ::= ("))


def test_token_bytes_of_a_split_character(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test to mean anything"
    assert b"".join(token_bytes(tokenizer, t) for t in ids) == "🙂".encode()


def test_sampling_params_refuse_out_of_range_values():
    for bad in ({"min_p": 1.5}, {"repetition_penalty": 0.0}, {"min_tokens": 99}, {"logit_bias": {1: 101.0}}):
        with pytest.raises(ValueError):
            SamplingParams(max_tokens=16, **bad)
