"""OpenAI's Responses API (POST /v1/responses) on top of chat completions.

A Responses request is a chat request in another shape: `input` (a string, or messages, function calls and their
outputs) and `instructions` become the messages, flat function tools become chat tools, `text.format` becomes
`response_format`. The chat path generates; this module maps its answer back into output items (a message with
`output_text`, then a `function_call` per tool call) and, streamed, its chunks into the API's typed events
(`response.created` ... `response.output_text.delta` ... `response.completed`). A finished response is stored
(unless `store` is false; server/api/response_store.py) for GET /v1/responses/{id} and for a later request's
`previous_response_id`, which continues its conversation.

With `background: true` the request is answered at once with a `queued` response, and the reply is generated on
without its client: GET /v1/responses/{id} polls it (`in_progress`, then `completed`, `incomplete` or `failed`) and
POST /v1/responses/{id}/cancel stops it (`cancelled`; its engine request aborted), as OpenAI's and vLLM's servers do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, model_validator

from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest, ChatCompletionResponse, RequestPart, StreamChunk, text_or_parts
from server.api.response_store import ResponseStore, StoredResponse
from server.api.serving import OpenAIServing, chat_stream_parts

log = logging.getLogger(__name__)


# ---- the request -------------------------------------------------------------------------------
class InputText(RequestPart):
    """A text part of an input message (an earlier answer's text comes back as output_text)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestPart):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or_parts(InputText)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestPart):
    """A function call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestPart):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningTextPart(RequestPart):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(RequestPart):
    """An earlier response's reasoning, sent back with the conversation (its text is not shown to the model again:
    thinking models' templates drop the reasoning of earlier turns)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item_kind(item: Any) -> str:
    """An input item's type; a bare {role, content} is a message (OpenAI's EasyInputMessage)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionTool(RequestPart):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionTool(RequestPart):
    """tool_choice naming a function (the Responses API's flat form)."""

    type: Literal["function"]
    name: str


class TextFormat(RequestPart):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(RequestPart):
    format: TextFormat | None = None


class ReasoningOptions(RequestPart):
    """A Responses request's `reasoning`: its effort reaches the chat template as reasoning_effort (a summary is not
    written: the reasoning comes out whole, as a reasoning item)."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(RequestPart):
    """POST /v1/responses."""

    model: str | None = None
    input: text_or_parts(InputItem)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionTool | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    previous_response_id: str | None = Field(None, description="continue that stored response's conversation")
    store: bool = Field(True, description="keep the finished response for GET and previous_response_id")
    background: bool = Field(False, description="answer at once (queued) and generate on: poll GET, or cancel")
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        if isinstance(self.input, list) and all(isinstance(item, ReasoningItem) for item in self.input):
            raise ValueError("input needs a message or a function call output beside its reasoning items")
        fmt = self.text.format if self.text else None
        if fmt and fmt.type == "json_schema" and fmt.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        if self.background and self.stream:
            raise ValueError("background responses are polled (GET /v1/responses/{id}), not streamed: "
                             "set stream or background, not both")
        if self.background and not self.store:
            raise ValueError("background responses are kept to be polled: background needs store")
        return self

    def input_messages(self) -> list[dict]:
        """The input as chat messages, a run of function calls as one assistant turn."""
        messages = []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages

    def input_items(self) -> list[dict]:
        """The input as OpenAI's item resources, each with an id (the item's own where it brings one), for GET
        /v1/responses/{id}/input_items."""
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out = []
        for item in items:
            if isinstance(item, InputMessage):
                parts = ([InputText(type="input_text", text=item.content)] if isinstance(item.content, str)
                         else item.content)
                out.append({"type": "message", "id": _item_id("msg"), "role": item.role, "status": "completed",
                            "content": [p.model_dump(include={"type", "text"}) for p in parts]})
            elif isinstance(item, FunctionCallItem):
                out.append({"type": "function_call", "id": item.id or _item_id("fc"), "call_id": item.call_id,
                            "name": item.name, "arguments": item.arguments, "status": "completed"})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"type": "function_call_output", "id": _item_id("fco"), "call_id": item.call_id,
                            "output": item.output, "status": "completed"})
            else:
                out.append({**item.model_dump(exclude_none=True), "id": item.id or _item_id("rs")})
        return out

    def as_chat(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat request that generates this response to `conversation` (chat messages: any history it continues,
        then its input), after its instructions (an earlier response's are not carried over, as OpenAI has it);
        fields the client left unset stay unset."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {"model": self.model, "messages": messages + conversation, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        for ours, chat in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                           ("top_p", "top_p"), ("user", "user")):
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        if self.tools:
            body["tools"] = [{"type": "function",
                              "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionTool):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
        elif fmt:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # e.g. a tool_choice naming no tool: the 400 the chat route gives
            raise RequestValidationError(exc.errors()) from None


# ---- the response ------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: _item_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A thinking model's reasoning (server.reasoning_parser), as OpenAI's reasoning item carries it."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: _item_id("rs"))
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: _item_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response as OpenAI's API returns it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[Annotated[OutputReasoning | OutputMessage | OutputFunctionCall, Field(discriminator="type")]]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = False
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)


def _usage(usage, reasoning_tokens: int = 0) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


class InputItemList(BaseModel):
    """GET /v1/responses/{id}/input_items: a page of a stored response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def _output_message(output: list) -> dict:
    """A response's output items as the assistant turn a continuation's chat prompt shows."""
    text = "".join(item.content[0].text for item in output if isinstance(item, OutputMessage) and item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, OutputFunctionCall)]
    thought = "".join(item.content[0].text for item in output if isinstance(item, OutputReasoning) and item.content)
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {}),
            **({"reasoning_content": thought} if thought else {})}


def _calls(tool_calls: list) -> list[OutputFunctionCall]:
    """Function call items from chat tool calls (whole ones, or a stream's deltas, which carry whole calls)."""
    return [OutputFunctionCall(call_id=c.id, name=c.function.name, arguments=c.function.arguments) for c in tool_calls]


class _Detached:
    """What the chat path reads of a request (its id, whether its client left) for a background response, which
    generates on after its own request was answered: no client to leave."""

    def __init__(self, request_id: str):
        self.state = SimpleNamespace(request_id=request_id)

    async def is_disconnected(self) -> bool:
        return False


class ResponsesAPI:
    """The Responses API's routes through an OpenAIServing's chat path, with its stored responses."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore):
        self.serving = serving
        self.store = store
        self._background: dict[str, asyncio.Task] = {}  # the background responses generating, by id

    async def create(self, req: ResponsesRequest, raw: Request):
        """A ResponseObject, or an async iterator of the API's SSE events when stream is set."""
        self.serving.check_fields(req)
        conversation = self._history(req.previous_response_id) + req.input_messages()
        chat = req.as_chat(conversation)
        inputs = req.input_items()
        # a new id whatever X-Request-Id says: it keys the store, where a client's repeated header would overwrite
        shell = self._shell(req, f"resp_{uuid.uuid4().hex}")
        if req.background:
            return self._queued(shell, chat, conversation, inputs, raw.state.request_id)
        if req.stream:
            return self._events(shell, await self.serving.chat(chat, raw, as_chunks=True), conversation, inputs)
        return self._kept(self._answered(shell, await self.serving.chat(chat, raw)), conversation, inputs)

    def _queued(self, shell: ResponseObject, chat: ChatCompletionRequest, conversation: list[dict],
                inputs: list[dict], request_id: str) -> ResponseObject:
        """A background response, stored as queued, and its generation started."""
        if not shell.store:
            raise APIError(400, "background responses are kept to be polled, and this server stores none "
                                "(server.responses_store_size is 0)", param="background")
        self.serving.check_model(chat.model)  # (the rest of the chat path's checks fail the response instead)
        queued = shell.model_copy(update={"status": "queued", "background": True})
        self.store.put(queued.id, StoredResponse(queued.model_dump(mode="json"), [], inputs))
        task = asyncio.create_task(self._generate(queued, chat, conversation, inputs, request_id))
        self._background[queued.id] = task
        task.add_done_callback(lambda _: self._background.pop(queued.id, None))
        return queued

    async def _generate(self, queued: ResponseObject, chat: ChatCompletionRequest, conversation: list[dict],
                        inputs: list[dict], request_id: str) -> None:
        """A background response's reply, stored when it ends (completed, incomplete, or failed with the error)."""
        running = queued.model_copy(update={"status": "in_progress"})
        self._put_state(running, inputs)
        try:
            answer = await self.serving.chat(chat, _Detached(request_id))
        except APIError as exc:
            self._put_state(running.model_copy(update={"status": "failed", "error": ResponseError(
                code=exc.code or ("server_error" if exc.status >= 500 else "invalid_request"),
                message=exc.message)}), inputs)
            return
        except Exception as exc:  # noqa: BLE001 - the response fails; the server goes on
            log.exception("background response %s failed", queued.id)
            self._put_state(running.model_copy(update={"status": "failed", "error": ResponseError(
                code="server_error", message=f"{exc.__class__.__name__}: {exc}")}), inputs)
            return
        self._kept(self._answered(running, answer), conversation, inputs)

    def _put_state(self, response: ResponseObject, inputs: list[dict]) -> None:
        """Store a background response as it stands (a running or failed one continues no conversation)."""
        self.store.put(response.id, StoredResponse(response.model_dump(mode="json"), [], inputs))

    async def cancel(self, response_id: str) -> dict:
        """POST /v1/responses/{id}/cancel: stop a background response still queued or generating (its engine request
        aborted) and keep it as cancelled; a 400 for any other (a response answered in its request is done)."""
        stored = self._stored(response_id, "response_id")
        status = stored.response["status"]
        task = self._background.get(response_id)
        if task is None or status not in ("queued", "in_progress"):
            raise APIError(400, f"Cannot cancel response '{response_id}': only a background response that is queued "
                                f"or in progress can be cancelled (this one is {status})", param="response_id")
        task.cancel()
        await asyncio.wait({task})  # its engine request aborted when this returns
        cancelled = {**stored.response, "status": "cancelled"}
        self.store.put(response_id, StoredResponse(cancelled, [], stored.input_items))
        return cancelled

    def _answered(self, shell: ResponseObject, answer: ChatCompletionResponse) -> ResponseObject:
        """The response a chat answer makes (its message, reasoning and function calls as output items)."""
        choice = answer.choices[0]
        output: list = []
        if choice.message.reasoning:
            output.append(OutputReasoning(content=[ReasoningText(text=choice.message.reasoning)]))
        if choice.message.content or not (choice.message.tool_calls or choice.message.reasoning):
            output.append(OutputMessage(content=[OutputText(text=choice.message.content or "")]))
        output += _calls(choice.message.tool_calls)
        usage = _usage(answer.usage, self._reasoning_tokens(choice.message.reasoning))
        return self._finished(shell, output, choice.finish_reason, usage)

    def _reasoning_tokens(self, reasoning: str | None) -> int:
        """The reasoning's tokens (the parser splits the reply's text; its tokens are counted again from it)."""
        return len(self.serving.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    def get(self, response_id: str) -> dict:
        """GET /v1/responses/{id}: a stored response."""
        return self._stored(response_id, "response_id").response

    def input_items(self, response_id: str, limit: int, order: Literal["asc", "desc"], after: str | None = None,
                    before: str | None = None) -> InputItemList:
        """GET /v1/responses/{id}/input_items: the input items the request gave (not those of the responses it
        continued), newest first unless `order` is asc; `after` / `before` an item id of the list as ordered."""
        items = self._stored(response_id, "response_id").input_items
        items = items[::-1] if order == "desc" else items
        ids = [item["id"] for item in items]
        for cursor, param in ((after, "after"), (before, "before")):
            if cursor is not None and cursor not in ids:
                raise APIError(400, f"{param}: no input item '{cursor}' in response '{response_id}'", param=param)
        window = items[ids.index(after) + 1 if after else 0:ids.index(before) if before else len(items)]
        page = window[-limit:] if before else window[:limit]  # a page back from `before`, else on from `after`
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(window) > limit)

    async def delete(self, response_id: str) -> DeletedResponse:
        """DELETE /v1/responses/{id}: forget a stored response (those that continued it keep their own copy); a
        background one still generating is stopped first."""
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        if not self.store.delete(response_id):
            raise self._not_found(response_id, "response_id")
        return DeletedResponse(id=response_id)

    def _history(self, previous_response_id: str | None) -> list[dict]:
        """The conversation a request continues: its previous response's, output included ([] for none)."""
        if previous_response_id is None:
            return []
        return list(self._stored(previous_response_id, "previous_response_id").conversation)

    def _stored(self, response_id: str, param: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise self._not_found(response_id, param)
        return stored

    def _not_found(self, response_id: str, param: str) -> APIError:
        why = ("" if self.store.capacity else
               " (this server stores no responses: server.responses_store_size is 0)")
        return APIError(404, f"Response with id '{response_id}' not found.{why}", param=param,
                        code="response_not_found")

    def _kept(self, done: ResponseObject, conversation: list[dict], inputs: list[dict]) -> ResponseObject:
        """A finished response, stored with its conversation and input items when the request asked and the server
        keeps any."""
        if done.store and self.store.capacity:
            self.store.put(done.id, StoredResponse(done.model_dump(mode="json"),
                                                   conversation + [_output_message(done.output)], inputs))
        return done

    def _shell(self, req: ResponsesRequest, rid: str) -> ResponseObject:
        """The response before any output: what the request asked for, echoed as OpenAI echoes it."""
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionTool) else (
            req.tool_choice or "auto")
        text = (req.text.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
                if req.text and req.text.format else None)
        return ResponseObject(
            id=rid, created_at=int(time.time()), status="in_progress", model=self.serving.reply_model(req.model),
            output=[],
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, tools=[t.model_dump(exclude_none=True) for t in req.tools or []], tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls, metadata=req.metadata or {},
            previous_response_id=req.previous_response_id, store=req.store and self.store.capacity > 0,
            **({"text": text} if text else {}))

    @staticmethod
    def _finished(shell: ResponseObject, output: list, finish_reason: str | None,
                  usage: ResponseUsage | None) -> ResponseObject:
        cut = finish_reason == "length"
        for item in output:
            if isinstance(item, OutputMessage):
                item.status = "incomplete" if cut else "completed"
            elif isinstance(item, OutputReasoning):  # cut off while reasoning: nothing came after it
                item.status = "incomplete" if cut and item is output[-1] else "completed"
        return shell.model_copy(update={
            "status": "incomplete" if cut else "completed", "output": output, "usage": usage,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None})

    async def _events(self, shell: ResponseObject, chunks: AsyncIterator[StreamChunk | dict],
                      conversation: list[dict], inputs: list[dict]) -> AsyncIterator[str]:
        """The chat chunks as the Responses API's typed SSE events, each with its sequence number; the finished
        response stored (a failed or abandoned one is not)."""
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        def dump(model: BaseModel) -> dict:
            return model.model_dump(mode="json", exclude_none=False)

        def opened(item: OutputMessage | OutputReasoning) -> list[str]:
            output.append(item)
            part = item.content[0].model_copy()
            return [event("response.output_item.added", output_index=len(output) - 1,
                          item={**dump(item), "content": []}),
                    event("response.content_part.added", item_id=item.id, output_index=len(output) - 1,
                          content_index=0, part=dump(part))]

        def closed(item: OutputMessage | OutputReasoning) -> list[str]:
            index, part = output.index(item), item.content[0]
            kind = "response.reasoning_text" if isinstance(item, OutputReasoning) else "response.output_text"
            return [event(f"{kind}.done", item_id=item.id, output_index=index, content_index=0, text=part.text),
                    event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                          part=dump(part)),
                    event("response.output_item.done", output_index=index, item=dump(item))]

        yield event("response.created", response=dump(shell))
        yield event("response.in_progress", response=dump(shell))
        output: list = []
        thinking: OutputReasoning | None = None  # the reasoning streamed
        thinking_open = False  # until the reply goes on past it
        message: OutputMessage | None = None  # the message being streamed, while text comes
        finish, usage = None, None
        async for kind, item in chat_stream_parts(chunks):
            if kind == "error":  # the engine failed: the response failed
                failed = shell.model_copy(update={"status": "failed", "output": output, "error": ResponseError(
                    code=item["error"].get("code") or "server_error", message=item["error"]["message"])})
                yield event("response.failed", response=dump(failed))
                return
            if kind == "usage":
                usage = _usage(item)
                continue
            choice = item
            finish = choice.finish_reason or finish
            thought, text, calls = choice.delta.reasoning, choice.delta.content, choice.delta.tool_calls or []
            if thought:
                if thinking is None:
                    thinking, thinking_open = OutputReasoning(status="in_progress",
                                                              content=[ReasoningText(text="")]), True
                    for line in opened(thinking):
                        yield line
                thinking.content[0].text += thought
                yield event("response.reasoning_text.delta", item_id=thinking.id,
                            output_index=output.index(thinking), content_index=0, delta=thought)
            if (text or calls) and thinking_open:  # the reply went on past its reasoning
                thinking.status, thinking_open = "completed", False
                for line in closed(thinking):
                    yield line
            if text:
                if message is None:
                    message = OutputMessage(status="in_progress", content=[OutputText(text="")])
                    for line in opened(message):
                        yield line
                message.content[0].text += text
                yield event("response.output_text.delta", item_id=message.id, output_index=len(output) - 1,
                            content_index=0, delta=text)
            for call in _calls(calls):
                output.append(call)
                index = len(output) - 1
                yield event("response.output_item.added", output_index=index,
                            item={**dump(call), "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=call.id, output_index=index,
                            delta=call.arguments)
                yield event("response.function_call_arguments.done", item_id=call.id, output_index=index,
                            arguments=call.arguments)
                yield event("response.output_item.done", output_index=index, item=dump(call))
        if message is None and thinking is None and not output:  # nothing was said: an empty message, as a
            message = OutputMessage(content=[OutputText(text="")])  # non-streamed answer has
            output.append(message)
            yield event("response.output_item.added", output_index=0, item={**dump(message), "content": []})
        if usage is not None and thinking is not None:
            usage.output_tokens_details.reasoning_tokens = self._reasoning_tokens(thinking.content[0].text)
        done = self._kept(self._finished(shell, output, finish, usage), conversation, inputs)
        for item in ([thinking] if thinking_open else []) + ([message] if message is not None else []):
            for line in closed(item):
                yield line
        yield event("response.incomplete" if done.status == "incomplete" else "response.completed", response=dump(done))
