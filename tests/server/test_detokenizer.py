"""The incremental detokenizer: its Rust stream path and its two-decode path give the same text as decode()."""

import pytest
from transformers import AutoTokenizer

from server.engine.detokenizer import IncrementalDetokenizer, stream_source

# Multi-byte characters split over byte-level tokens (CJK, an emoji with a joiner, accents), spaces and newlines.
TEXT = "Paris, c'est la capitale — 東京は首都です。 👩‍💻 naïve café\n\n  x = [1, 2]; λ > 0 ✓"


class DecodeOnly:
    """A tokenizer that only decodes: no Rust stream to step through, so the detokenizer's other path runs."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    """The default model's fast tokenizer, its text the Rust decoder's alone (transformers 4.48 reads its config with
    clean_up_tokenization_spaces on, 5.x with it off)."""
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def _streamed(detok: IncrementalDetokenizer, ids: list[int], burst: int) -> tuple[str, list[str]]:
    """Feed ids `burst` at a time (a checked draft adds several at once); the text and every delta handed out."""
    deltas = []
    for end in range(burst, len(ids) + burst, burst):
        detok.append(ids[:end])
        deltas.append(detok.take_delta(finished=end >= len(ids)))
    return detok.text, deltas


def test_the_stream_path_is_taken_only_where_it_decodes_as_decode_does(smol_dir, tokenizer):
    assert stream_source(tokenizer) is tokenizer.backend_tokenizer
    assert stream_source(DecodeOnly(tokenizer)) is None  # no Rust tokenizer
    cleaned = AutoTokenizer.from_pretrained(smol_dir)
    cleaned.clean_up_tokenization_spaces = True  # transformers edits the Rust decoder's text
    assert stream_source(cleaned) is None


@pytest.mark.parametrize("burst", [1, 3])
@pytest.mark.parametrize("skip_special", [True, False])
def test_both_paths_give_decode_text_and_no_partial_character(tokenizer, burst, skip_special):
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = encode(TEXT) + [special] + encode(" end")
    want = tokenizer.decode(ids, skip_special_tokens=skip_special)
    for source in (tokenizer, DecodeOnly(tokenizer)):
        text, deltas = _streamed(IncrementalDetokenizer(source, [], skip_special), ids, burst)
        assert text == want and "".join(deltas) == want
        assert not any("\ufffd" in d for d in deltas)  # a character's bytes are held back until it is whole


def test_a_stop_string_split_over_tokens_ends_the_text_on_both_paths(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for source in (tokenizer, DecodeOnly(tokenizer)):
        detok = IncrementalDetokenizer(source, ["首都"], True)
        stopped_at = next(n for n in range(1, len(ids) + 1) if detok.append(ids[:n]))
        assert detok.matched == "首都" and detok.text == TEXT[:TEXT.index("首都")]
        assert "首都" in tokenizer.decode(ids[:stopped_at]) and "首都" not in tokenizer.decode(ids[:stopped_at - 1])
