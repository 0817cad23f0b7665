"""llama.cpp server's own completion API (POST /completion, its alias /completions, and POST /infill: fill in the
middle, server/api/fim.py) and POST /apply-template, as llama-server's clients call them, on the completions path: a
script written for llama-server runs against this server unchanged.

A request's llama.cpp fields map onto an OpenAI completion's (n_predict → max_tokens, -1 to the end of the context,
0 the prompt evaluated into the prefix cache and no token returned;
repeat_penalty → repetition_penalty; n_probs → logprobs; grammar and json_schema → structured outputs), with
llama.cpp's sampling defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). The answer is llama.cpp's:
`content`, `tokens` (with return_tokens), `stop_type` (eos, word, limit) and `stopping_word`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `timings` and, with n_probs, `completion_probabilities` (each token's logprob
and its likeliest alternatives); streamed, a `data:` event per piece of text and a last one with `stop: true`
and the totals (no [DONE], as llama-server ends that stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from server.api.errors import APIError
from server.api.protocol import MAX_LOGPROBS, CompletionRequest, RequestPart, StreamChunk, TokenizeChatRequest
from server.api.serving import OpenAIServing

_RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's "a new seed each time"


class LlamaCompletionRequest(RequestPart):
    """POST /completion: llama-server's fields (the ones this server honours; cache_prompt and id_slot are accepted
    and need nothing: the prefix cache serves every request)."""

    prompt: str | list[int]
    n_predict: int = Field(-1, ge=-1, description="tokens to generate (-1: until the context is full; 0: none, the "
                                                  "prompt only evaluated into the cache)")
    temperature: float = Field(0.8, ge=0.0, le=2.0, allow_inf_nan=False)
    top_k: int = Field(40, description="0 or less: off")
    top_p: float = Field(0.95, gt=0.0, le=1.0, allow_inf_nan=False)
    min_p: float = Field(0.05, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int = Field(-1, ge=-1, le=0xFFFFFFFF)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS, description="each token's likeliest alternatives, this many")
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    ignore_eos: bool = False
    logit_bias: list[list[int | float | bool]] | dict[str, float | bool] | None = Field(
        None, description="[[token id, bias], ...] or {token id: bias}; a bias of false bans the token")
    grammar: str | None = Field(None, description="a grammar the reply follows: GBNF (llama.cpp's) or Lark")
    json_schema: dict[str, Any] | None = None
    return_tokens: bool = False
    cache_prompt: bool = True
    id_slot: int = -1

    def as_completion(self, prompt_ids: list[int], max_model_len: int) -> CompletionRequest:
        """The OpenAI completion (streamed, with its usage and token ids) that generates this request's reply."""
        body: dict[str, Any] = {
            "prompt": prompt_ids, "temperature": self.temperature, "top_k": max(self.top_k, 0), "top_p": self.top_p,
            "min_p": self.min_p, "stop": self.stop or None, "stream": True, "stream_options": {"include_usage": True},
            "repetition_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "ignore_eos": self.ignore_eos, "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "max_tokens": self._max_tokens(len(prompt_ids), max_model_len)}
        if self.seed not in _RANDOM_SEEDS:
            body["seed"] = self.seed
        if self.n_probs:
            body["logprobs"] = self.n_probs
        if self.logit_bias:
            body["logit_bias"] = self._bias()
        if self.grammar is not None:
            body["structured_outputs"] = {"grammar": self.grammar}
        elif self.json_schema is not None:
            body["structured_outputs"] = {"json": self.json_schema}
        try:
            return CompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None

    def _max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        if self.n_predict == 0:  # the prompt's pass alone; the one token it yields is not returned (_Reply)
            return 1
        return self.n_predict if self.n_predict > 0 else max(1, max_model_len - prompt_len)

    def _bias(self) -> dict[str, float]:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        out = {}
        for pair in pairs:
            token, bias = pair if len(pair) == 2 else (None, None)
            if isinstance(token, str) and token.isdigit():
                token = int(token)
            if not isinstance(token, int) or isinstance(token, bool) or not isinstance(bias, (int, float)):
                raise APIError(400, "logit_bias: each entry is a token id and a bias (or false, to ban it)",
                               param="logit_bias")
            out[str(token)] = -100.0 if bias is False else float(bias)
        return out

    def settings(self) -> dict[str, Any]:
        """llama.cpp's generation_settings: what the reply was generated with."""
        return {key: getattr(self, key) for key in (
            "n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "n_probs", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "ignore_eos", "stream", "grammar")}


class InfillFile(RequestPart):
    """Another file of the repository, context for an infill."""

    filename: str = ""
    text: str


class LlamaInfillRequest(LlamaCompletionRequest):
    """POST /infill: the code between input_prefix and input_suffix (input_extra: other files before them; prompt:
    text the reply goes on from, after the middle token), with /completion's fields."""

    prompt: str = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillFile] = Field(default_factory=list)


class ApplyTemplateResponse(BaseModel):
    """POST /apply-template's answer."""

    prompt: str


class _Reply:
    """A reply's pieces gathered from the completion's chunks, and its clock."""

    def __init__(self, prompt_tokens: int, evaluate_only: bool = False):
        self.evaluate_only = evaluate_only  # n_predict 0: the pieces are dropped, the reply ends at its limit
        self.start = time.perf_counter()
        self.first: float | None = None  # when the first piece came (the prompt's pass ended)
        self.content, self.tokens, self.probabilities = "", [], []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_tokens, self.cached = prompt_tokens, 0


class LlamaCppAPI:
    """llama-server's /completion and /apply-template through an OpenAIServing."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def completion(self, req: LlamaCompletionRequest, raw: Request):
        """llama.cpp's completion answer, or an async iterator of its SSE events when stream is set."""
        self.serving.check_fields(req)
        if isinstance(req, LlamaInfillRequest):
            ids = self.serving.infill_ids(req.input_prefix, req.input_suffix,
                                          [(f.filename, f.text) for f in req.input_extra], req.prompt)
        else:
            ids = self.serving.prompt_ids(req.prompt)
        chunks = await self.serving.completions(req.as_completion(ids, self.serving.max_model_len), raw,
                                                as_chunks=True)
        reply = _Reply(len(ids), evaluate_only=req.n_predict == 0)
        if req.stream:
            return self._events(req, ids, chunks, reply)
        work = asyncio.ensure_future(self._gathered(chunks, reply))
        watcher = asyncio.ensure_future(self.serving.wait_disconnect(raw))
        try:  # a client that leaves stops its generation (as the completions path's own collector does)
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                raise APIError(499, "client disconnected")
            work.result()
        finally:
            watcher.cancel()
            work.cancel()
        return self._final(req, ids, reply, whole=True)

    async def _gathered(self, chunks: AsyncIterator[StreamChunk | dict], reply: _Reply) -> None:
        """The whole reply into `reply`; an engine error raised as its APIError."""
        async for piece in self._pieces(chunks, reply):
            if "error" in piece:
                error = piece["error"]
                raise APIError(500, error["message"], code=error.get("code") or "engine_error")

    def props(self, total_slots: int, version: str) -> dict[str, Any]:
        """GET /props: what llama-server says of itself (its clients read the context size and the chat template)."""
        defaults = LlamaCompletionRequest.model_construct(prompt="").settings()
        return {"default_generation_settings": {"n_ctx": self.serving.max_model_len, "params": defaults},
                "total_slots": total_slots, "model_path": self.serving.reply_model(None),
                "chat_template": self.serving.chat_template or self.serving.tokenizer.chat_template or "",
                "modalities": {"vision": False, "audio": False}, "build_info": f"neuronmm {version}"}

    def apply_template(self, req: TokenizeChatRequest) -> ApplyTemplateResponse:
        """POST /apply-template: the chat template's rendering of the messages (the prompt /completion would take)."""
        return ApplyTemplateResponse(prompt=self.serving.chat_prompt(req))

    async def _pieces(self, chunks: AsyncIterator[StreamChunk | dict], reply: _Reply) -> AsyncIterator[dict]:
        """Each chunk's piece as llama.cpp streams it (its text, tokens and probabilities), gathered into `reply`;
        an error body ends them. The chunks are closed however the reader stops (their engine requests aborted)."""
        async with aclosing(chunks):
            async for chunk in chunks:
                if isinstance(chunk, dict):
                    yield chunk
                    return
                if chunk.usage is not None:
                    reply.cached = chunk.usage.prompt_tokens_details.cached_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                reply.first = reply.first or time.perf_counter()
                if reply.evaluate_only:
                    reply.finish_reason = "length"
                    continue
                reply.content += choice.text
                reply.tokens += choice.token_ids or []
                reply.finish_reason = choice.finish_reason or reply.finish_reason
                reply.stop_reason = choice.stop_reason if choice.finish_reason else reply.stop_reason
                probabilities = self._probabilities(choice.logprobs) if choice.logprobs else []
                reply.probabilities += probabilities
                piece = {"content": choice.text, "tokens": choice.token_ids or [], "stop": False}
                if probabilities:
                    piece["completion_probabilities"] = probabilities
                yield piece

    def _probabilities(self, logprobs) -> list[dict]:
        """llama.cpp's completion_probabilities of a chunk's tokens (its logprobs name tokens `token_id:<id>`)."""
        def entry(name: str, logprob: float) -> dict:
            token_id = int(name.removeprefix("token_id:"))
            text, data = self.serving.token_text(token_id)
            return {"id": token_id, "token": text, "bytes": list(data), "logprob": logprob}

        return [{**entry(name, logprob), "top_logprobs": [entry(n, v) for n, v in sorted(
            top.items(), key=lambda item: -item[1])]}
                for name, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)]

    async def _events(self, req: LlamaCompletionRequest, ids: list[int], chunks, reply: _Reply) -> AsyncIterator[str]:
        """The streamed answer: an event a piece, then the totals (a client that leaves closes the pieces at once)."""
        async with aclosing(self._pieces(chunks, reply)) as pieces:
            async for piece in pieces:
                if "error" in piece:
                    yield f"data: {json.dumps(piece)}\n\n"
                    return
                if not req.return_tokens:
                    piece["tokens"] = []
                event = {"index": 0, **piece, "id_slot": 0, "tokens_predicted": len(reply.tokens),
                         "tokens_evaluated": len(ids)}
                yield f"data: {json.dumps(event)}\n\n"
        yield f"data: {json.dumps(self._final(req, ids, reply, whole=False))}\n\n"

    def _final(self, req: LlamaCompletionRequest, ids: list[int], reply: _Reply, whole: bool) -> dict:
        """The answer (whole: the reply's text and tokens; streamed: the last event, its text already sent)."""
        end = time.perf_counter()
        first = reply.first or end
        word = reply.stop_reason if isinstance(reply.stop_reason, str) else ""
        stop_type = "limit" if reply.finish_reason == "length" else "word" if word else "eos"
        prompt_n, predicted_n = reply.prompt_tokens - reply.cached, len(reply.tokens)
        prompt_ms, predicted_ms = 1000 * (first - reply.start), 1000 * (end - first)
        answer = {
            "index": 0, "content": reply.content if whole else "",
            "tokens": reply.tokens if whole and req.return_tokens else [], "id_slot": 0, "stop": True,
            "model": self.serving.reply_model(None), "tokens_predicted": predicted_n, "tokens_evaluated": len(ids),
            "generation_settings": req.settings(),
            "prompt": req.prompt if isinstance(req.prompt, str) and not isinstance(req, LlamaInfillRequest)
            else self.serving.tokenizer.decode(ids),
            "has_new_line": "\n" in reply.content, "truncated": False, "stop_type": stop_type,
            "stopping_word": word, "tokens_cached": reply.cached,
            "timings": {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
                        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
                        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / max(predicted_n, 1),
                        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0}}
        if whole and req.n_probs:
            answer["completion_probabilities"] = reply.probabilities
        return answer
