"""Anthropic's Messages API (POST /v1/messages, as vLLM's and llama.cpp's servers take it) on top of chat completions.

A Messages request is a chat request in another shape: `system` becomes a system message, content blocks become
message text, an assistant's `tool_use` blocks its tool calls and a user's `tool_result` blocks tool messages;
tools carry `input_schema` for parameters. The chat path generates; this module maps its answer back into content
blocks (`thinking` under a reasoning parser, `text`, a `tool_use` per tool call) with Anthropic's stop reasons and,
streamed, its chunks into the API's events (`message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`). Errors keep the server's error body, whose status the Anthropic clients map.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, model_validator

from server.api.errors import APIError
from server.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, RequestPart, StreamChunk,
                                 TokenizeChatRequest, text_or_parts)
from server.api.serving import OpenAIServing, chat_stream_parts


# ---- the request -------------------------------------------------------------------------------
class TextBlock(RequestPart):
    """A text content block."""

    type: Literal["text"]
    text: str


class ImageBlock(RequestPart):
    """Accepted by the schema so the error can say why: the served models read text only."""

    type: Literal["image", "document"]


class ToolUseBlock(RequestPart):
    """A tool call the model made earlier, sent back in an assistant message."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestPart):
    """A tool's answer, sent in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: text_or_parts(TextBlock) = ""
    is_error: bool = False

    def text(self) -> str:
        """The result's text (its text blocks joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ThinkingBlock(RequestPart):
    """An earlier reply's reasoning, sent back (its template may show or drop it)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str | None = None
    data: str | None = None


def _block_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return {"image": "image", "document": "image", "redacted_thinking": "thinking"}.get(kind, kind or "text")


ContentBlock = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
                         | Annotated[ToolUseBlock, Tag("tool_use")] | Annotated[ToolResultBlock, Tag("tool_result")]
                         | Annotated[ThinkingBlock, Tag("thinking")], Discriminator(_block_kind)]


class Message(RequestPart):
    """A turn of the conversation: its text, or its content blocks."""

    role: Literal["user", "assistant"]
    content: text_or_parts(ContentBlock)

    def blocks(self) -> list:
        """The content as blocks (a string is one text block)."""
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class AnthropicTool(RequestPart):
    """A tool the model may call: its name, description and input JSON schema."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" (server tools such as web search are not run here)


class ToolChoice(RequestPart):
    """Whether the model may (auto), must (any), must call this one (tool) or may not (none) call tools."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type tool needs a name (and only it takes one)")
        return self


class OutputFormat(RequestPart):
    """A JSON schema the reply follows."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestPart):
    """Anthropic's structured outputs: the reply follows the JSON schema (constrained decoding, as chat's
    response_format); `effort` is a hosted model's and has no effect here."""

    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(RequestPart):
    """POST /v1/messages."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: text_or_parts(TextBlock) | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    # extended thinking: {"type": "enabled" | "disabled", ...} reaches the chat template as enable_thinking (Qwen3's
    # switch); a thinking model's reasoning comes back as thinking blocks under the server's reasoning parser
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages: tool results as tool messages before the user's text."""
        messages = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": text})
        for message in self.messages:
            text, calls, thought = [], [], []
            for block in message.blocks():
                if isinstance(block, ImageBlock):
                    raise APIError(400, f"{block.type} blocks are not supported: the served model reads text",
                                   param="messages")
                if isinstance(block, TextBlock):
                    text.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": json.dumps(block.input)}})
                elif isinstance(block, ToolResultBlock):
                    content = ("Error: " if block.is_error else "") + block.text()
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
                elif isinstance(block, ThinkingBlock) and block.thinking:
                    thought.append(block.thinking)
            if message.role == "assistant":
                turn = {"role": "assistant", "content": "".join(text) or None}
                if calls:
                    turn["tool_calls"] = calls
                if thought:
                    turn["reasoning_content"] = "".join(thought)
                messages.append(turn)
            elif text:
                messages.append({"role": "user", "content": "".join(text)})
        return messages

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request that generates this message; fields the client left unset stay unset."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "max_tokens": self.max_tokens,
                                "stream": self.stream}
        if self.messages[-1].role == "assistant":  # a prefilled reply: the answer goes on from its text (Anthropic's)
            body.update(add_generation_prompt=False, continue_final_message=True)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for ours, chat in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("top_k", "top_k")):
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        if self.thinking is not None and self.thinking.get("type") in ("enabled", "disabled"):
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking["type"] == "enabled"}
        if self.metadata and isinstance(self.metadata.get("user_id"), str):
            body["user"] = self.metadata["user_id"]
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type == "none"):
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # e.g. a tool_choice naming no tool: the 400 the chat route gives
            raise RequestValidationError(exc.errors()) from None


class CountTokensRequest(RequestPart):
    """POST /v1/messages/count_tokens: the prompt a Messages request would send, counted."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: text_or_parts(TextBlock) | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


# ---- the response ------------------------------------------------------------------------------
class MessagesUsage(BaseModel):
    """Token counts, as Anthropic's usage splits the prompt (cache reads apart)."""

    input_tokens: int  # the prompt's tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessagesResponse(BaseModel):
    """The answer: a message of content blocks."""

    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    """POST /v1/messages/count_tokens's answer."""

    input_tokens: int


def _stop(finish: str | None, stop_reason: int | str | None, stops: list[str] | None) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for the chat's finish_reason and vLLM's stop_reason."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (stops or []):
        return "stop_sequence", stop_reason
    return ("end_turn", None) if finish is not None else (None, None)


def _usage(usage) -> MessagesUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return MessagesUsage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                         cache_read_input_tokens=cached)


def _tool_use(call) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:  # a parsed call's arguments are JSON; keep what came if not
        arguments = {"arguments": call.function.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.function.name, "input": arguments}


def _event(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=True)}\n\n"


class MessagesAPI:
    """The Messages API's routes through an OpenAIServing's chat path."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, req: MessagesRequest, raw: Request):
        """A MessagesResponse, or an async iterator of the API's SSE events when stream is set."""
        self.serving.check_fields(req)
        chat = req.as_chat()
        model = self.serving.reply_model(req.model)
        if req.stream:
            return self._events(await self.serving.chat(chat, raw, as_chunks=True), model, req.stop_sequences)
        answer: ChatCompletionResponse = await self.serving.chat(chat, raw)
        choice = answer.choices[0]
        content = []
        if choice.message.reasoning:
            content.append({"type": "thinking", "thinking": choice.message.reasoning, "signature": ""})
        if choice.message.content or not choice.message.tool_calls:
            content.append({"type": "text", "text": choice.message.content or ""})
        content += [_tool_use(call) for call in choice.message.tool_calls]
        stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason, req.stop_sequences)
        return MessagesResponse(id=f"msg_{answer.id.removeprefix('chatcmpl-')}", model=model, content=content,
                                stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(answer.usage))

    def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens as the chat template renders it (vLLM's /tokenize on the same messages)."""
        self.serving.check_fields(req)
        # the request's own fields only: an unknown one (kept aside, as everywhere) may be a Messages field of
        # another type, which rendering through MessagesRequest would refuse
        fields = req.model_dump(exclude_none=True, include=set(CountTokensRequest.model_fields))
        probe = MessagesRequest.model_validate({**fields, "max_tokens": 1}).as_chat()
        tokenize = TokenizeChatRequest(model=req.model, messages=probe.messages, tools=probe.tools,
                                       add_generation_prompt=probe.add_generation_prompt,
                                       continue_final_message=probe.continue_final_message,
                                       chat_template_kwargs=probe.chat_template_kwargs)
        return CountTokensResponse(input_tokens=self.serving.tokenize(tokenize).count)

    async def _events(self, chunks: AsyncIterator[StreamChunk | dict], model: str,
                      stops: list[str] | None) -> AsyncIterator[str]:
        """The chat chunks as Messages events: one content block a kind of delta, in the order they come."""
        index, open_kind = -1, None  # the content block being streamed (thinking or text)
        finish, stop_reason, usage = None, None, None
        # (the prompt's token count comes with the last chunk: message_delta carries the usage whole)
        yield _event("message_start", message={
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}})
        async for kind, item in chat_stream_parts(chunks):
            if kind == "error":  # the engine failed: an error event ends the stream
                yield _event("error", error={"type": "api_error", "message": item["error"]["message"]})
                return
            if kind == "usage":
                usage = _usage(item)
                continue
            choice = item
            finish = choice.finish_reason or finish
            stop_reason = choice.stop_reason if "stop_reason" in choice.model_fields_set else stop_reason
            parts = [("thinking", choice.delta.reasoning), ("text", choice.delta.content)]
            for block_kind, piece in parts:
                if not piece:
                    continue
                if open_kind != block_kind:
                    if open_kind is not None:
                        yield _event("content_block_stop", index=index)
                    index, open_kind = index + 1, block_kind
                    block = {"type": "thinking", "thinking": "", "signature": ""} if block_kind == "thinking" else {
                        "type": "text", "text": ""}
                    yield _event("content_block_start", index=index, content_block=block)
                delta = ({"type": "thinking_delta", "thinking": piece} if block_kind == "thinking"
                         else {"type": "text_delta", "text": piece})
                yield _event("content_block_delta", index=index, delta=delta)
            for call in choice.delta.tool_calls or []:
                if open_kind is not None:
                    yield _event("content_block_stop", index=index)
                    open_kind = None
                index += 1
                use = _tool_use(call)
                yield _event("content_block_start", index=index, content_block={**use, "input": {}})
                yield _event("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": json.dumps(use["input"])})
                yield _event("content_block_stop", index=index)
        if open_kind is not None:
            yield _event("content_block_stop", index=index)
        reason, sequence = _stop(finish, stop_reason, stops)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage=(usage or MessagesUsage(input_tokens=0, output_tokens=0)).model_dump())
        yield _event("message_stop")
