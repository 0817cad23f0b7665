"""The serving layer between thin routes and the engine: prompts, limits, responses, SSE streams."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from server.api.errors import APIError
from server.api.metrics import ServerMetrics
from server.api.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut,
                                 CompletionChoice, CompletionRequest, CompletionResponse, Logprobs, UsageInfo)
from server.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import SeqOutput, TokenLogprob

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
_DISCONNECT_POLL_S = 0.05


def _check_unicode(text: str, param: str) -> None:
    """400 for text JSON can carry but UTF-8 cannot (lone surrogates such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (lone surrogate)", param=param) from None


class _Choice:
    """Accumulates one choice's text, tokens and logprobs for a non-streamed response."""

    def __init__(self):
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.num_output_tokens = 0


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int,
                 metrics: ServerMetrics):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.vocab_size = len(tokenizer)
        # No token decodes to more characters than its longest vocabulary string, so a text longer than
        # max_model_len * that (x4 when a normaliser may merge characters) cannot fit: refuse it without
        # spending seconds of the event loop on tokenizing megabytes.
        longest = max((len(t) for t in tokenizer.convert_ids_to_tokens(list(range(self.vocab_size))) if t), default=1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        slack = 1 if backend is not None and backend.normalizer is None else 4
        self.max_prompt_chars = max_model_len * longest * slack

    # ---- prompt handling -------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. Available: {self.model_name}",
                           param="model", code="model_not_found")

    def _too_long(self, what: str) -> APIError:
        return APIError(400, f"{what} is longer than max_model_len ({self.max_model_len} tokens) allows",
                        param="prompt", code="context_length_exceeded")

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise self._too_long(f"prompt of {len(prompt)} characters")
            _check_unicode(prompt, "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            if len(prompt) > self.max_model_len:
                raise self._too_long(f"prompt of {len(prompt)} token ids")
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return ids

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in req.messages]
        num_chars = sum(len(m["content"]) for m in messages)
        if num_chars > self.max_prompt_chars:
            raise self._too_long(f"messages of {num_chars} characters")
        for m in messages:
            _check_unicode(m["content"], "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=req.add_generation_prompt)
        except Exception as exc:  # template errors are the request's fault (e.g. role order)
            raise APIError(400, f"chat template rejected the messages: {exc}", param="messages") from None
        return self._tokenize(text) if text else self._tokenize("")

    def _max_tokens(self, requested: int | None, num_prompt: int, default: int | None) -> int:
        room = self.max_model_len - num_prompt
        if room < 1:
            raise APIError(400, f"prompt has {num_prompt} tokens, max_model_len is {self.max_model_len}",
                           param="prompt", code="context_length_exceeded")
        max_tokens = requested if requested is not None else min(default or room, room)
        if num_prompt + max_tokens > self.max_model_len:
            raise APIError(400, f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                                f"max_model_len ({self.max_model_len})",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    # ---- engine interaction ----------------------------------------------------------------
    def _submit(self, batch: list[tuple[list[int], SamplingParams]], n: int, rid: str) -> list[RequestStream]:
        """Admit every prompt of a request before any response starts (so 429 is a real status)."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, params) in enumerate(batch):
                streams.append(self.engine.submit(ids, params, n, f"{rid}-{i}"))
        except QueueFullError as exc:
            for stream in streams:
                self.engine.release(stream.request_id, abort=True)
            raise APIError(429, f"server busy: {exc}; retry later", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        return streams

    async def _collect(self, raw: Request, gens: list[RequestStream], n: int) -> list[_Choice]:
        """Drain the engine outputs of every prompt; abort all of them if the client goes away."""
        choices = [_Choice() for _ in range(n * len(gens))]

        async def drain(offset: int, gen: RequestStream) -> None:
            async for out in gen:
                if out.error:
                    raise APIError(500, out.error, code="engine_error")
                c = choices[offset + out.index]
                c.text += out.text
                c.logprobs.extend(out.logprobs or [])
                c.num_output_tokens = out.num_output_tokens
                c.finish_reason = out.finish_reason or c.finish_reason

        work = asyncio.gather(*(drain(i * n, g) for i, g in enumerate(gens)))
        watcher = asyncio.ensure_future(self._wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                work.cancel()
                raise APIError(499, "client disconnected")
            work.result()
            return choices
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            # a cancelled gather still records an exception; mark it seen so asyncio does not log it
            work.add_done_callback(lambda fut: fut.cancelled() or fut.exception())
            for gen in gens:
                await gen.aclose()

    @staticmethod
    async def _wait_disconnect(raw: Request) -> None:
        while not await raw.is_disconnected():
            await asyncio.sleep(_DISCONNECT_POLL_S)

    # ---- completions -----------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        """Non-streamed CompletionResponse, or an async iterator of SSE lines when stream is set."""
        self.check_model(req.model)
        prompts = [self._tokenize(p) for p in req.prompts()]
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        requests = []
        for ids in prompts:
            params = req.sampling_params(self._max_tokens(req.max_tokens, len(ids), 16), req.logprobs)
            requests.append((ids, params))
        rid = f"cmpl-{uuid.uuid4().hex}"
        gens = self._submit(requests, req.n, rid)
        usage = UsageInfo(prompt_tokens=sum(len(ids) for ids, _ in requests) * req.n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(gens, req.n, usage, include_usage, rid, "text_completion", self._completion_delta)
        choices = await self._collect(raw, gens, req.n)
        usage.completion_tokens = sum(c.num_output_tokens for c in choices)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=rid, model=self.model_name, usage=usage, choices=[
            CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                             logprobs=self._completion_logprobs(c.logprobs) if req.logprobs is not None else None)
            for i, c in enumerate(choices)])

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, lps: list[TokenLogprob], offset: int = 0) -> Logprobs:
        out = Logprobs()
        for lp in lps:
            token = self._token_text(lp.token_id)
            out.text_offset.append(offset)
            offset += len(token)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self._token_text(t): v for t, v in lp.top})
        return out

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    def _completion_delta(self, out: SeqOutput, index: int) -> dict:
        return {"index": index, "text": out.text, "finish_reason": out.finish_reason,
                "logprobs": (self._completion_logprobs(out.logprobs).model_dump() if out.logprobs else None)}

    # ---- chat ------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request):
        """Non-streamed ChatCompletionResponse, or an async iterator of SSE lines when stream is set."""
        self.check_model(req.model)
        ids = self._chat_prompt(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = self._max_tokens(req.max_completion_tokens or req.max_tokens, len(ids), None)
        params = req.sampling_params(max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gens = self._submit([(ids, params)], req.n, rid)
        usage = UsageInfo(prompt_tokens=len(ids) * req.n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(gens, req.n, usage, include_usage, rid, "chat.completion.chunk", self._chat_delta)
        choices = await self._collect(raw, gens, req.n)
        usage.completion_tokens = sum(c.num_output_tokens for c in choices)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return ChatCompletionResponse(id=rid, model=self.model_name, usage=usage, choices=[
            ChatChoice(index=i, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                       logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None)
            for i, c in enumerate(choices)])

    def _chat_delta(self, out: SeqOutput, index: int) -> dict:
        delta = {"content": out.text}
        if out.num_output_tokens <= 1:
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "finish_reason": out.finish_reason,
                "logprobs": self._chat_logprobs(out.logprobs) if out.logprobs else None}

    # ---- streaming -------------------------------------------------------------------------
    async def _stream(self, gens, n: int, usage: UsageInfo, include_usage: bool, rid: str, obj: str,
                      make_choice) -> AsyncIterator[str]:
        """SSE lines: one chunk per output, an error chunk if the engine fails, then [DONE]."""
        created = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(offset: int, gen) -> None:
            try:
                async for out in gen:
                    await queue.put((offset, out))
            except Exception as exc:  # noqa: BLE001 - forwarded to the client as an error chunk
                await queue.put((offset, exc))
            finally:
                await queue.put((offset, None))

        tasks = [asyncio.ensure_future(pump(i * n, g)) for i, g in enumerate(gens)]
        completion_tokens = {}
        try:
            remaining = len(tasks)
            while remaining:
                offset, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, Exception) or item.error:
                    err = item if isinstance(item, APIError) else APIError(
                        500, item.error if isinstance(item, SeqOutput) else str(item), code="engine_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                completion_tokens[(offset, item.index)] = item.num_output_tokens
                chunk = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                         "choices": [make_choice(item, offset + item.index)]}
                if include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
            else:
                if include_usage:
                    usage.completion_tokens = sum(completion_tokens.values())
                    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                    final = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                             "choices": [], "usage": usage.model_dump()}
                    yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            for gen in gens:
                await gen.aclose()
