"""Reasoning parsers: a thinking model's `<think>...</think>` split off its reply, chosen by `server.reasoning_parser`.

vLLM's `--reasoning-parser` names: `deepseek_r1` (DeepSeek-R1 and its Llama / Qwen distills, QwQ), whose chat
template opens the reply inside the reasoning, so the reply may lack `<think>` and everything up to `</think>` is
reasoning; `qwen3`, whose replies reason only when they open with `<think>` (thinking can be switched off with
`chat_template_kwargs: {"enable_thinking": false}`, and the reply is then all content). The reasoning goes to the
message's `reasoning` field (vLLM's name), the rest to `content`, where tool calls are parsed as before.
"""

from __future__ import annotations

from typing import ClassVar

from server.api.tool_parsers.base import partial_suffix

START, END = "<think>", "</think>"


class ReasoningParser:
    """Where a reply's reasoning is: from its start (or its `<think>`) to `</think>`."""

    name: ClassVar[str]
    opens_in_reasoning: ClassVar[bool]  # whether a reply without <think> starts in its reasoning

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished reply; None for a part it does not have."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            body = stripped[len(START):]
        elif self.opens_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, closed, content = body.partition(END)
        if not closed:  # cut off while reasoning (max_tokens), or a reply that never closed it
            return reasoning or None, None
        return reasoning or None, content or None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_reasoning = False


class ReasoningStream:
    """Follows a streamed reply: `feed` each delta, then `finish`; each gives (reasoning, content) to send now.

    It holds back text that may be the start of a tag split across deltas, so the parts it sends add up to
    what `split` gives the whole reply (up to the whitespace before an opening `<think>`)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = "start"  # start (nothing decided yet), reasoning, content
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning = content = ""
        if self.state == "start":
            body = self.buffer.lstrip()
            if START.startswith(body) and len(body) < len(START):
                return "", ""  # empty, whitespace, or a part of <think>: not decided yet
            if body.startswith(START):
                self.state, self.buffer = "reasoning", body[len(START):]
            else:
                self.state = "reasoning" if self.parser.opens_in_reasoning else "content"
        if self.state == "reasoning":
            at = self.buffer.find(END)
            if at == -1:
                keep = partial_suffix(self.buffer, END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:at], self.buffer[at + len(END):], "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back at the end of the stream."""
        rest, self.buffer = self.buffer, ""
        if self.state == "start":
            reasoning, content = self.parser.split(rest)
            return reasoning or "", content or ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser registered under `name`, None for none (ValueError naming the known ones otherwise)."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
