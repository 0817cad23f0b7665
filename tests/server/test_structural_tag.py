"""vLLM's structural_tag: free text until a trigger, then the structure's begin, JSON for its schema and its end."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from server.api.protocol import ResponseFormat, StructuredOutputs
from server.engine.sampling_params import StructuredOutput
from server.engine.structured import GrammarMatcher, structural_tag_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TAGS = {"type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}]}


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


def _matcher(tokenizer, value: str) -> GrammarMatcher:
    grammar = structural_tag_grammar(value, frozenset(tokenizer.all_special_tokens))
    return GrammarMatcher(StructuredOutput("lark", grammar), tokenizer, len(tokenizer),
                          frozenset({tokenizer.eos_token_id}))


def _allowed(matcher: GrammarMatcher, tokenizer) -> list[str]:
    logits = torch.zeros(len(tokenizer))
    matcher.mask(logits)
    return [tokenizer.decode([i]) for i in (logits == 0).nonzero().flatten().tolist()]


def test_text_is_free_until_the_trigger_then_the_schema_holds(tokenizer):
    spec = ResponseFormat.model_validate(TAGS).spec()
    assert spec.kind == "structural_tag"
    matcher = _matcher(tokenizer, spec.value)
    text = tokenizer.encode("Let me look that up. ", add_special_tokens=False)
    matcher.advance(text)
    assert len(_allowed(matcher, tokenizer)) > 1000  # free text: nearly any token
    call = text + tokenizer.encode("<function=get_weather>", add_special_tokens=False)
    matcher.advance(call)
    assert _allowed(matcher, tokenizer) == ['{"']  # the schema's object, in the JSON specs' spacing
    done = call + tokenizer.encode('{"city": "Paris"}</function> It is sunny.', add_special_tokens=False)
    matcher.advance(done)
    assert not matcher.matcher.is_error() and matcher.matcher.is_accepting()


def test_a_reply_that_breaks_the_schema_past_the_trigger_is_refused(tokenizer):
    matcher = _matcher(tokenizer, ResponseFormat.model_validate(TAGS).spec().value)
    matcher.advance(tokenizer.encode('<function=get_weather>{"town": 1}', add_special_tokens=False))
    assert matcher.matcher.is_error()


def test_the_json_text_form_reads_as_the_object_form():
    as_text = StructuredOutputs.model_validate({"structural_tag": json.dumps({k: v for k, v in TAGS.items()
                                                                              if k != "type"})})
    assert as_text.spec() == ResponseFormat.model_validate(TAGS).spec()


def test_a_trigger_that_is_a_special_token_is_matched_as_that_token(tokenizer):
    """<|im_start|> is one token of SmolLM2's: the structure starts at that token, not at its spelling in text."""
    value = ResponseFormat.model_validate({"type": "structural_tag", "triggers": ["<|im_start|>"], "structures": [
        {"begin": "<|im_start|>call", "schema": WEATHER, "end": ""}]}).spec().value
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    matcher = _matcher(tokenizer, value)
    matcher.advance([special] + tokenizer.encode("call", add_special_tokens=False))
    assert _allowed(matcher, tokenizer) == ['{"']
    assert "<|im_start|>" in structural_tag_grammar(value, frozenset(tokenizer.all_special_tokens))
    with pytest.raises(ValueError, match="must all be special tokens"):
        structural_tag_grammar(json.dumps({"triggers": ["<|im_start|>", "<f>"], "structures": [
            {"begin": "<f>x", "schema": WEATHER}]}), frozenset(tokenizer.all_special_tokens))
