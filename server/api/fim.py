"""Fill-in-the-middle prompts: the code a model is to write between a prefix and a suffix, laid out in the FIM tokens
its tokenizer carries (OpenAI's completions `suffix`, llama-server's /infill).

Code models learn FIM as prefix-suffix-middle: PRE prefix SUF suffix MID, the reply then the middle. Each family names
the three tokens its own way; a tokenizer that has none of the sets cannot fill in (a 400). Repository-level context
(other files) goes before, each file behind the family's file separator where it has one (Qwen2.5-Coder's
`<|file_sep|>`), as plain text otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# (prefix, suffix, middle) token names by family, tried in turn
_STYLES = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
           ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, Granite Code
           ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder: begin, hole, end
           ("▁<PRE>", "▁<SUF>", "▁<MID>"))  # CodeLlama
_FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>")


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's FIM token ids, and its file separator (None: it has none)."""

    prefix: int
    suffix: int
    middle: int
    file_separator: int | None


def fim_tokens(vocab: dict[str, int]) -> FimTokens | None:
    """The FIM tokens of a tokenizer's vocabulary (token -> id), or None where it has no complete set."""
    for names in _STYLES:
        if all(name in vocab for name in names):
            separator = next((vocab[name] for name in _FILE_SEPARATORS if name in vocab), None)
            return FimTokens(*(vocab[name] for name in names), separator)
    return None


def fim_prompt(fim: FimTokens, encode: Callable[[str], list[int]], prefix: str, suffix: str,
               files: Sequence[tuple[str, str]] = (), middle: str = "") -> list[int]:
    """The token ids of a FIM prompt: each (filename, text) of other files, then PRE prefix SUF suffix MID, then
    `middle` (text the reply goes on from). `encode` tokenises text without special tokens."""
    ids: list[int] = []
    for name, text in files:
        if fim.file_separator is not None:
            ids += [fim.file_separator] + encode(f"{name}\n{text}")
        else:
            ids += encode(f"{name}\n{text}\n")
    return ids + [fim.prefix] + encode(prefix) + [fim.suffix] + encode(suffix) + [fim.middle] + encode(middle)
