"""The serving layer between thin routes and the engine: prompts, limits, responses, SSE streams."""

from __future__ import annotations

import asyncio
import codecs
import inspect
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from server.api.errors import APIError
from server.api.lora_adapters import LoraAdapters
from server.api.metrics import ServerMetrics
from server.api.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatMessageOut,
                                 ChatStreamChoice, CompletionChoice, CompletionRequest, CompletionResponse,
                                 CompletionTokensDetails, DetokenizeRequest, DetokenizeResponse, Logprobs,
                                 NamedToolChoice, Prediction, PromptLogprob, PromptLogprobs, PromptTokensDetails,
                                 StreamChunk, StreamOptions, TextDeltaLines, TokenizeChatRequest,
                                 TokenizeCompletionRequest, TokenizeResponse, ToolCallDelta, UsageInfo)
from server.api.beam_search import Beam, beam_search
from server.api.chat_templates import load_chat_template
from server.api.fim import fim_prompt, fim_tokens
from server.api.generation_defaults import check_sampling_defaults
from server.api.reasoning import END, START, ReasoningParser, ReasoningStream, get_reasoning_parser
from server.api.tool_parsers import ToolCallStream, get_tool_parser
from server.config import Config, ConfigError
from server.engine.async_engine import EngineDeadError, QueueFullError
from server.engine.sampling_params import SamplingParams, StructuredOutput
from server.engine.sequence import SeqOutput, TokenLogprob
from server.engine.structured import grammar_error, structural_tag_grammar, token_bytes

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
_DISCONNECT_POLL_S = 0.05
_CONSTRAINT_NAMES = {"json_schema": "schema", "json_object": "schema", "regex": "regex", "choice": "choices",
                     "grammar": "grammar", "lark": "tools' schemas", "structural_tag": "structural tag"}


def _engine_error(out: SeqOutput) -> APIError:
    """The APIError a sequence's error means: the engine's fault (500), or the request's (400: its grammar)."""
    return APIError(out.error_status, out.error, code="engine_error" if out.error_status >= 500 else "grammar_error")


def _check_unicode(text: str, param: str) -> None:
    """400 for text JSON can carry but UTF-8 cannot (lone surrogates such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (lone surrogate)", param=param) from None


_EMBED = SamplingParams(max_tokens=1, temperature=0.0, embed=True)  # a pooling request: no token comes out


class _Choice:
    """Accumulates one choice's text, tokens and logprobs for a non-streamed response."""

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.prediction_tokens: tuple[int, int] | None = None  # with a predicted reply: (kept, refused) so far
        self.embedding: list[float] | None = None  # an embedding request's hidden state


class _TextOffsets:
    """Character offsets of tokens in the generated text, fed token by token (split characters count once)."""

    def __init__(self, start: int = 0):
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, data: bytes) -> int:
        at = self.offset
        self.offset += len(self._decoder.decode(data))
        return at


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine, tokenizer, cfg: Config, metrics: ServerMetrics, sampling_defaults: dict | None = None,
                 eos_ids: set[int] | None = None):
        self.engine = engine
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else {tokenizer.eos_token_id} - {None})
        self.sampling_defaults = self._checked_defaults(sampling_defaults or {})
        self.tokenizer = tokenizer
        self.fim = fim_tokens(tokenizer.get_vocab())  # the tokenizer's fill-in-the-middle tokens (None: it has none)
        self.special_tokens = frozenset(tokenizer.all_special_tokens) | frozenset(
            t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
        self.model_name = cfg.model.name
        self.model_names = [cfg.model.name, *cfg.server.model_aliases]
        self.adapters = LoraAdapters(engine, cfg)  # LoRA adapters, served under their own names
        self.max_model_len = cfg.engine.max_model_len
        self.strict_fields = cfg.server.strict_fields
        self.stream_interval = cfg.server.stream_interval
        self.by_priority = cfg.engine.scheduling_policy == "priority"
        self.serves_embeddings = cfg.backend == "torch"  # the neuron runner keeps no hidden states
        self.metrics = metrics
        try:
            self.tool_parser = get_tool_parser(cfg.server.tool_call_parser)
        except ValueError as exc:
            raise ConfigError(f"server.tool_call_parser: {exc}") from None
        try:
            self.reasoning_parser = get_reasoning_parser(cfg.server.reasoning_parser)
        except ValueError as exc:
            raise ConfigError(f"server.reasoning_parser: {exc}") from None
        self.chat_template = load_chat_template(cfg.server.chat_template)
        self._renders_tools: bool | None = None
        # apply_chat_template's own arguments, which chat_template_kwargs must not reach
        self._render_arguments = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
        self.vocab_size = len(tokenizer)
        # No token decodes to more characters than its longest vocabulary string, so a text longer than
        # max_model_len * that (x4 when a normaliser may merge characters) cannot fit: refuse it without
        # spending seconds of the event loop on tokenizing megabytes.
        longest = max((len(t) for t in tokenizer.convert_ids_to_tokens(list(range(self.vocab_size))) if t), default=1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        slack = 1 if backend is not None and backend.normalizer is None else 4
        self.max_prompt_chars = self.max_model_len * longest * slack

    @staticmethod
    def _checked_defaults(defaults: dict) -> dict:
        """The model's sampling defaults, checked once as a request's fields are (a bad one stops the start)."""
        if check_sampling_defaults(defaults):
            log.info("sampling defaults from the model's generation config: %s (--generation-config vllm ignores "
                     "them)", defaults)
        return defaults

    def _with_defaults(self, req: CompletionRequest | ChatCompletionRequest):
        """The request with the model's sampling defaults in the fields it left unset."""
        unset = {k: v for k, v in self.sampling_defaults.items() if k not in req.model_fields_set}
        return req.model_copy(update=unset) if unset else req

    # ---- request checks --------------------------------------------------------------------
    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None for the served model, a name of it or None, as vLLM takes it);
        404 for any other name."""
        if model in self.adapters:
            return model
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist. Available: "
                                f"{', '.join(self.model_names + self.adapters.names)}", param="model",
                           code="model_not_found")
        return None

    def reply_model(self, model: str | None) -> str:
        """The `model` a reply names: the adapter's name for a request to one, else the served model's."""
        return model if model in self.adapters else self.model_name

    def check_fields(self, req) -> None:
        """Unknown fields: logged and ignored, as vLLM does, or 400 with server.strict_fields."""
        unknown = req.unknown_fields()
        if unknown and self.strict_fields:
            raise APIError(400, f"{unknown[0]}: unrecognized request argument", param=unknown[0])
        if unknown:
            log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
        if getattr(req, "priority", 0) and not self.by_priority:  # as vLLM answers it
            raise APIError(400, "priority needs the priority scheduling policy (--scheduling-policy priority)",
                           param="priority")

    def _too_long(self, what: str) -> APIError:
        return APIError(400, f"{what} is longer than max_model_len ({self.max_model_len} tokens) allows",
                        param="prompt", code="context_length_exceeded")

    # ---- prompt handling -------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise self._too_long(f"prompt of {len(prompt)} characters")
            _check_unicode(prompt, "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            if len(prompt) > self.max_model_len:
                raise self._too_long(f"prompt of {len(prompt)} token ids")
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return ids

    def _prediction_ids(self, prediction: Prediction) -> list[int] | None:
        """A predicted reply's tokens, as the reply would start (no special tokens); None for an empty one."""
        text = prediction.text()
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"prediction of {len(text)} characters is longer than any reply can be "
                                f"(max_model_len {self.max_model_len})", param="prediction")
        _check_unicode(text, "prediction")
        return self.tokenizer.encode(text, add_special_tokens=False) or None

    def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len; None: all)."""
        if keep is None:
            return ids
        return ids[-(self.max_model_len if keep == -1 else keep):]

    def _template_messages(self, messages) -> list[dict]:
        """Messages as chat templates expect them (tool-call arguments as objects, developer as system)."""
        out = []
        for m in messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            if getattr(m, "reasoning", None) or getattr(m, "reasoning_content", None):
                msg["reasoning_content"] = m.reasoning or m.reasoning_content
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                continue_final_message: bool = False, template_kwargs: dict | None = None,
                documents: list[dict[str, str]] | None = None) -> str:
        clash = sorted(set(template_kwargs or {}) & self._render_arguments)
        if clash:  # the template's variables only, not apply_chat_template's own switches
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(clash)}", param="chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      chat_template=self.chat_template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      documents=documents, **(template_kwargs or {}))
        except Exception as exc:  # template errors are the request's fault (e.g. role order)
            raise APIError(400, f"chat template rejected the messages: {exc}", param="messages") from None

    def renders_tools(self) -> bool:
        """Whether the chat template shows tools to the model (a probe rendered once)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "x"}]
            tool = [{"type": "function", "function": {"name": "probe_tool_xyz", "parameters": {"type": "object"}}}]
            self._renders_tools = "probe_tool_xyz" in self._render(probe, tool, True)
        return self._renders_tools

    def _chat_ids(self, messages, tools, add_generation_prompt: bool, continue_final_message: bool = False,
                  template_kwargs: dict | None = None, documents: list[dict[str, str]] | None = None) -> list[int]:
        converted = self._template_messages(messages)
        num_chars = sum(len(m["content"]) for m in converted)
        if num_chars > self.max_prompt_chars:
            raise self._too_long(f"messages of {num_chars} characters")
        for m in converted:
            _check_unicode(m["content"], "messages")
        tool_dicts = None
        if tools:
            if not self.renders_tools():
                raise APIError(400, "this model's chat template does not render tools; start the server with "
                                    "--chat-template hermes_tools (bundled) or a template that does",
                               param="tools", code="tools_not_supported")
            tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
        text = self._render(converted, tool_dicts, add_generation_prompt, continue_final_message, template_kwargs,
                            documents)
        # the template writes the special tokens (BOS, role markers) itself
        return self._tokenize(text, add_special_tokens=False) if text else self._tokenize("")

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

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                structured: StructuredOutput | None = None) -> SamplingParams:
        try:
            params = req.sampling_params(max_tokens, logprobs, structured)
        except ValueError as exc:  # cross-field limits (e.g. min_tokens > max_tokens)
            raise APIError(400, str(exc)) from None
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias):  # as vLLM: not silently ignored
            raise APIError(400, f"logit_bias token ids must be in [0, {self.vocab_size})", param="logit_bias")
        if any(not 0 <= t < self.vocab_size for t in params.allowed_token_ids or []):
            raise APIError(400, f"allowed_token_ids must be in [0, {self.vocab_size})", param="allowed_token_ids")
        if req.bad_words:
            params = replace(params, bad_words_ids=self._bad_words_ids(req.bad_words))
        adapter = self.check_model(req.model)
        return replace(params, lora=adapter) if adapter else params

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as written and after a space (how it reads mid-sentence), as vLLM bans them."""
        found = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    # ---- engine interaction ----------------------------------------------------------------
    def _submit(self, batch: list[tuple[list[int], SamplingParams]], n: int, rid: str) -> list:
        """Admit every prompt of a request before any response starts (so 429 is a real status)."""
        if len(batch) > self.engine.max_queue:  # each prompt queues: a 429 would ask for retries that never succeed
            raise APIError(400, f"{len(batch)} prompts in one request are more than the server queues at once "
                                f"(engine.max_queue {self.engine.max_queue}); send them in smaller batches")
        streams = []
        nonce = secrets.token_hex(4)  # a client's X-Request-Id need not be unique; engine ids must be
        try:
            for i, (ids, params) in enumerate(batch):
                streams.append(self.engine.submit(ids, params, n, f"{rid}-{nonce}-{i}"))
        except Exception as exc:
            for stream in streams:
                self.engine.release(stream.request_id, abort=True)
            # the one refused too: an engine core whose pipe broke as it was sent had routed its outputs already
            self.engine.release(f"{rid}-{nonce}-{len(streams)}", abort=False)
            if isinstance(exc, QueueFullError):
                raise APIError(429, f"server busy: {exc}; retry later", code="queue_full",
                               headers={"Retry-After": RETRY_AFTER_S}) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc)) from None
            raise
        return streams

    async def _collect(self, raw: Request, gens: list, n: int) -> list[_Choice]:
        """Drain the engine outputs of every prompt; abort all of them if the client goes away."""
        choices = [_Choice() for _ in range(n * len(gens))]

        async def drain(offset: int, gen) -> None:
            async for out in gen:
                if out.error:
                    raise _engine_error(out)
                c = choices[offset + out.index]
                c.text += out.text
                c.token_ids.extend(out.token_ids)
                c.logprobs.extend(out.logprobs or [])
                c.prompt_logprobs = out.prompt_logprobs or c.prompt_logprobs
                c.num_output_tokens = out.num_output_tokens
                c.num_cached_tokens = max(c.num_cached_tokens, out.num_cached_tokens)
                c.prediction_tokens = out.prediction_tokens or c.prediction_tokens
                c.finish_reason = out.finish_reason or c.finish_reason
                c.stop_reason = out.stop_reason if out.finish_reason else c.stop_reason
                c.embedding = out.embedding or c.embedding

        work = asyncio.gather(*(drain(i * n, g) for i, g in enumerate(gens)))
        watcher = asyncio.ensure_future(self.wait_disconnect(raw))
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
    async def wait_disconnect(raw: Request) -> None:
        """Returns once the request's client has gone away (polled)."""
        while not await raw.is_disconnected():
            await asyncio.sleep(_DISCONNECT_POLL_S)

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
               prediction_tokens: list[tuple[int, int] | None] = ()) -> UsageInfo:
        """The usage a response reports; its completion details only where the choices followed a predicted reply
        (`prediction_tokens`: each choice's kept and refused drafted tokens, None without a prediction)."""
        predicted = [p for p in prediction_tokens if p is not None]
        details = None
        if predicted:
            details = CompletionTokensDetails(accepted_prediction_tokens=sum(kept for kept, _ in predicted),
                                              rejected_prediction_tokens=sum(refused for _, refused in predicted))
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                         completion_tokens_details=details)

    @staticmethod
    def _cached(choices: list["_Choice"], n: int) -> int:
        """Prompt tokens served from the prefix cache: per prompt, what its first choice found (the other choices
        share the blocks it computed: the scheduler admits them after it)."""
        return sum(choices[i].num_cached_tokens for i in range(0, len(choices), n))

    # ---- logprobs --------------------------------------------------------------------------
    def token_text(self, token_id: int, as_id: bool = False) -> tuple[str, bytes]:
        """A token as OpenAI shows it: its text, or `bytes:\\xNN..` when it is part of a character; `token_id:<id>`
        with as_id (vLLM's return_tokens_as_token_ids). The bytes are its text's either way."""
        data = token_bytes(self.tokenizer, token_id)
        if as_id:
            return f"token_id:{token_id}", data
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data

    def _completion_logprobs(self, lps: list[TokenLogprob], offsets: _TextOffsets,
                             prompt_ids: list[int] | None = None,
                             prompt_lps: list[TokenLogprob | None] | None = None,
                             num_top: int | None = None, as_ids: bool = False) -> Logprobs:
        """Completions logprobs of the generated tokens, after those of the echoed prompt when given (num_top of
        each prompt token's alternatives: the engine may hold more, for prompt_logprobs); tokens named by id with
        as_ids."""
        out = Logprobs()
        for token_id, lp in zip(prompt_ids or [], prompt_lps or []):
            token, data = self.token_text(token_id, as_ids)
            out.text_offset.append(offsets.next(data))
            out.tokens.append(token)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            # as vLLM does: the prompt token itself is among its top alternatives
            out.top_logprobs.append(None if lp is None else {
                **{self.token_text(t, as_ids)[0]: v for t, v in lp.top[:num_top]}, token: lp.logprob})
        for lp in lps:
            token, data = self.token_text(lp.token_id, as_ids)
            out.text_offset.append(offsets.next(data))
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t, as_ids)[0]: v for t, v in lp.top})
        return out

    def _prompt_logprobs(self, choices: list[_Choice], num_top: int | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of the prompt these choices share: each token, then its likeliest alternatives."""
        lps = next((c.prompt_logprobs for c in choices if c.prompt_logprobs), None)
        if num_top is None or lps is None:
            return None

        def entry(token_id: int, logprob: float, rank: int | None) -> tuple[str, PromptLogprob]:
            return str(token_id), PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.token_text(token_id)[0])

        return [None if lp is None else dict([entry(lp.token_id, lp.logprob, lp.rank)] + [
            entry(t, v, rank) for rank, (t, v) in enumerate(lp.top[:num_top], 1) if t != lp.token_id])
            for lp in lps]

    def _chat_logprobs(self, lps: list[TokenLogprob], as_ids: bool = False) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            token, data = self.token_text(token_id, as_ids)
            return {"token": token, "logprob": logprob, "bytes": list(data)}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    # ---- completions -----------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids (text tokenised with the special tokens, ids checked), as completions
        reads it."""
        return self._tokenize(prompt)

    def infill_ids(self, prefix: str, suffix: str, files: list[tuple[str, str]] = (), middle: str = "",
                   param: str = "input_suffix") -> list[int]:
        """A fill-in-the-middle prompt's token ids (server/api/fim.py), after what the tokenizer puts first (a BOS);
        a 400 naming `param` where the tokenizer has no FIM tokens."""
        if self.fim is None:
            raise APIError(400, "this model's tokenizer has no fill-in-the-middle tokens (a code model's, such as "
                                "Qwen2.5-Coder's <|fim_prefix|>, is needed)", param=param, code="fim_not_supported")
        texts = (prefix, suffix, middle, *(t for pair in files for t in pair))
        if sum(map(len, texts)) > self.max_prompt_chars:
            raise self._too_long(f"a fill-in-the-middle prompt of {sum(map(len, texts))} characters")
        for text in texts:
            _check_unicode(text, param)
        ids = fim_prompt(self.fim, lambda text: self.tokenizer.encode(text, add_special_tokens=False), prefix, suffix,
                         files, middle)
        return self.tokenizer.encode("", add_special_tokens=True) + ids

    def chat_prompt(self, req: TokenizeChatRequest) -> str:
        """The chat template's rendering of a tokenize-chat request's messages (the text /tokenize tokenises)."""
        self.check_fields(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        return self._render(self._template_messages(req.messages), tools, req.add_generation_prompt,
                            req.continue_final_message, req.chat_template_kwargs)

    async def completions(self, req: CompletionRequest, raw: Request, as_chunks: bool = False):
        """Non-streamed CompletionResponse, or an async iterator of SSE lines when stream is set (of the StreamChunk
        objects with as_chunks, for an API built on this one)."""
        self.check_model(req.model)
        self.check_fields(req)
        req = self._with_defaults(req)
        texts = req.prompts() if req.suffix is None else [self.infill_ids(p, req.suffix, param="suffix")
                                                           for p in req.prompts()]
        prompts = [self._truncated(self._tokenize(p), req.truncate_prompt_tokens) for p in texts]
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if req.use_beam_search:
            rid = f"cmpl-{req.request_id or raw.state.request_id}"
            searched = [await self._beam_search(req, ids, self._max_tokens(req.max_tokens, len(ids), 16), raw, rid)
                        for ids in prompts]
            return CompletionResponse(id=rid, model=self.reply_model(req.model), choices=[
                CompletionChoice(index=p * req.n + i, text=text, finish_reason=reason)
                for p, beams in enumerate(searched) for i, (text, reason) in enumerate(self._beam_texts(req, beams))],
                usage=self._usage(sum(len(ids) for ids in prompts),
                                  sum(len(b.tokens) for beams in searched for b in beams)))
        structured = self._structured(req)
        requests = [(ids, self._params(req, self._max_tokens(req.max_tokens, len(ids), 16), req.logprobs, structured))
                    for ids in prompts]
        echoes = [self.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        rid = f"cmpl-{req.request_id or raw.state.request_id}"
        gens = self._submit(requests, req.n, rid)
        num_prompt = sum(len(ids) for ids in prompts)  # once per prompt, whatever n is
        if req.stream:
            state = {"echo": {i: echoes[i // req.n] for i in range(len(prompts) * req.n)},
                     "prompts": {i: prompts[i // req.n] for i in range(len(prompts) * req.n)},
                     "token_ids": req.return_token_ids, "as_ids": req.return_tokens_as_token_ids}
            # after a choice's first chunk, an output with text alone (_completion_delta adds nothing else)
            plain = _PlainDeltas(lambda out, index: (index not in state["prompts"] and _text_only(out)
                                                     and not state["token_ids"]),
                                 lambda index, text: CompletionChoice(index=index, text=text))
            stream = self._chunks if as_chunks else self._stream
            return stream(gens, req.n, num_prompt, req.stream_options, rid, "text_completion",
                          lambda out, index: self._completion_delta(out, index, state), self.reply_model(req.model),
                          plain=None if as_chunks else plain)
        choices = await self._collect(raw, gens, req.n)
        self._observe(prompts, req.n, [c.num_output_tokens for c in choices])
        usage = self._usage(num_prompt, sum(c.num_output_tokens for c in choices), self._cached(choices, req.n))
        shared = [self._prompt_logprobs(choices[p * req.n:(p + 1) * req.n], req.prompt_logprobs)
                  for p in range(len(prompts))]
        ids = req.return_token_ids
        return CompletionResponse(id=rid, model=self.reply_model(req.model), usage=usage, choices=[
            CompletionChoice(index=i, text=echoes[i // req.n] + c.text, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason,
                             logprobs=(self._completion_logprobs(c.logprobs, _TextOffsets(), prompts[i // req.n],
                                                                 c.prompt_logprobs, req.logprobs,
                                                                 req.return_tokens_as_token_ids)
                                       if req.logprobs is not None else None),
                             prompt_logprobs=shared[i // req.n],
                             prompt_token_ids=prompts[i // req.n] if ids else None,
                             token_ids=c.token_ids if ids else None)
            for i, c in enumerate(choices)])

    # ---- beam search -------------------------------------------------------------------------
    async def _beam_search(self, req: CompletionRequest | ChatCompletionRequest, prompt: list[int], max_tokens: int,
                           raw: Request, rid: str) -> list[Beam]:
        """The n best replies of a beam search n wide, each step the engine's one token of every live beam."""
        step = 0

        async def next_tokens(prefixes: list[list[int]], num: int) -> list[TokenLogprob]:
            nonlocal step
            step += 1
            # (prompt + max_tokens fit max_model_len, so every prefix leaves room for its next token)
            params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=num, ignore_eos=True,
                                    skip_special_tokens=req.skip_special_tokens, priority=req.priority,
                                    lora=self.check_model(req.model))
            choices = await self._collect(raw, self._submit([(p, params) for p in prefixes], 1, f"{rid}-{step}"), 1)
            return [c.logprobs[0] for c in choices]

        ends = frozenset(req.stop_token_ids or ()) | (frozenset() if req.ignore_eos else self.eos_ids)
        beams = await beam_search(next_tokens, prompt, req.n, max_tokens, ends, req.length_penalty)
        self._observe([prompt], req.n, [len(b.tokens) for b in beams])
        return beams

    def _beam_texts(self, req, beams: list[Beam]) -> list[tuple[str, str]]:
        """Each beam's text (its end token left out) and finish reason."""
        return [(self.tokenizer.decode(b.tokens[:-1] if b.ended else b.tokens,
                                       skip_special_tokens=req.skip_special_tokens), "stop" if b.ended else "length")
                for b in beams]

    # ---- embeddings --------------------------------------------------------------------------
    async def last_hidden_states(self, prompts: list[str | list[int]], add_special_tokens: bool,
                                 truncate: int | None, raw: Request, rid: str,
                                 lora: str | None = None) -> tuple[list[list[float]], int]:
        """Each prompt's last hidden state (the engine's pooling pass) and the prompts' token count."""
        try:
            ids = [self._truncated(self._tokenize(p, add_special_tokens), truncate) for p in prompts]
            for one in ids:
                self._max_tokens(1, len(one), 1)  # the engine's sequences end within max_model_len
        except APIError as exc:  # the prompt checks name the completions field
            exc.param = "input" if exc.param == "prompt" else exc.param
            raise
        params = replace(_EMBED, lora=lora) if lora else _EMBED
        gens = self._submit([(one, params) for one in ids], 1, rid)
        choices = await self._collect(raw, gens, 1)
        self._observe(ids, 1, [0] * len(ids))
        return [c.embedding for c in choices], sum(len(one) for one in ids)

    def _completion_delta(self, out: SeqOutput, index: int, state: dict) -> CompletionChoice:
        echo = state["echo"].pop(index, "")
        prompt = state["prompts"].pop(index, None)  # the choice's first chunk
        prompt_ids = prompt if out.prompt_logprobs else None
        logprobs = None
        if out.logprobs or prompt_ids:
            offsets = state.setdefault(("offsets", index), _TextOffsets())
            logprobs = self._completion_logprobs(out.logprobs or [], offsets, prompt_ids, out.prompt_logprobs,
                                                 as_ids=state["as_ids"])
        choice = CompletionChoice(index=index, text=echo + out.text, finish_reason=out.finish_reason, logprobs=logprobs)
        if state["token_ids"]:
            choice.token_ids = out.token_ids
            if prompt is not None:
                choice.prompt_token_ids = prompt
        if out.finish_reason is not None:
            choice.stop_reason = out.stop_reason
        return choice

    def _observe(self, prompts: list[list[int]], n: int, num_outputs: list[int]) -> None:
        for i, count in enumerate(num_outputs):
            self.metrics.observe_request(len(prompts[i // n]), count)

    # ---- chat ------------------------------------------------------------------------------
    def _structured(self, req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
        """The decoding constraint a request asks for: a forced tool call, structured_outputs or response_format."""
        if isinstance(req, ChatCompletionRequest) and req.forces_tool_call:
            parallel = req.parallel_tool_calls and req.tool_choice == "required"  # a named function: one call
            grammar = self.tool_parser.forced_grammar(req.forced_tools(), parallel)
            spec, param = StructuredOutput("lark", grammar), "tools"
        elif (constraint := req.output_constraint()) is not None:
            spec, param = constraint
        else:
            return None
        name = _CONSTRAINT_NAMES[spec.kind]
        if spec.kind == "structural_tag":
            try:
                spec = replace(spec, kind="lark", value=structural_tag_grammar(spec.value, self.special_tokens))
            except ValueError as exc:
                raise APIError(400, f"{param}: {exc}", param=param) from None
        error = grammar_error(spec)
        if error:
            raise APIError(400, f"{param}: cannot compile the {name}: {error}", param=param)
        return spec

    async def chat(self, req: ChatCompletionRequest, raw: Request, as_chunks: bool = False):
        """Non-streamed ChatCompletionResponse, or an async iterator of SSE lines when stream is set (of the
        StreamChunk objects with as_chunks, for an API built on this one)."""
        self.check_model(req.model)
        self.check_fields(req)
        req = self._with_defaults(req)
        ids = self._chat_ids(req.messages, req.tools if req.uses_tools else None, req.add_generation_prompt,
                             req.continue_final_message, req.template_variables(), req.documents)
        ids = self._truncated(ids, req.truncate_prompt_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = self._max_tokens(req.max_completion_tokens or req.max_tokens, len(ids), None)
        if req.use_beam_search:
            rid = f"chatcmpl-{req.request_id or raw.state.request_id}"
            beams = await self._beam_search(req, ids, max_tokens, raw, rid)
            return ChatCompletionResponse(id=rid, model=self.reply_model(req.model), choices=[
                ChatChoice(index=i, message=ChatMessageOut(content=text), finish_reason=reason)
                for i, (text, reason) in enumerate(self._beam_texts(req, beams))],
                usage=self._usage(len(ids), sum(len(b.tokens) for b in beams)))
        structured = self._structured(req)
        reasoning = self.reasoning_parser if self._reply_thinks(ids) else None
        if reasoning is not None and structured is not None:  # the constraint applies once the reasoning ends
            structured = replace(structured, after=tuple(self.tokenizer.encode(END, add_special_tokens=False)))
        params = self._params(req, max_tokens, logprobs, structured)
        if req.uses_tools and self.tool_parser.keeps_special_tokens:  # (Mistral's [TOOL_CALLS] is a control token)
            params = replace(params, skip_special_tokens=False)
        if req.prediction is not None:
            params = replace(params, prediction=self._prediction_ids(req.prediction))
        rid = f"chatcmpl-{req.request_id or raw.state.request_id}"
        gens = self._submit([(ids, params)], req.n, rid)
        # a named function is what the client asked for: OpenAI ends that with "stop", others "tool_calls"
        calls_reason = "stop" if isinstance(req.tool_choice, NamedToolChoice) else "tool_calls"
        if req.stream:
            state = {"tools": req.uses_tools, "calls_reason": calls_reason, "reasoning": reasoning,
                     "token_ids": req.return_token_ids, "as_ids": req.return_tokens_as_token_ids}
            # after a choice's first chunk (its role), an output with text alone, which no reasoning or tool-call
            # parser reads (_chat_delta then makes the text the delta's content and adds nothing else)
            plain = _PlainDeltas(lambda out, index: (index in state.get("started", ()) and _text_only(out)
                                                     and not (state["tools"] or state["reasoning"]
                                                              or state["token_ids"])),
                                 lambda index, text: ChatStreamChoice(index=index, delta=ChatDelta(content=text)))
            stream = self._chunks if as_chunks else self._stream
            return stream(gens, req.n, len(ids), req.stream_options, rid, "chat.completion.chunk",
                          lambda out, index: self._chat_delta(out, index, state), self.reply_model(req.model),
                          prompt_ids=ids if req.return_token_ids else None, plain=None if as_chunks else plain)
        choices = await self._collect(raw, gens, req.n)
        self._observe([ids], req.n, [c.num_output_tokens for c in choices])
        usage = self._usage(len(ids), sum(c.num_output_tokens for c in choices), self._cached(choices, req.n),
                            [c.prediction_tokens for c in choices])
        return ChatCompletionResponse(id=rid, model=self.reply_model(req.model), usage=usage, choices=[
            self._chat_choice(i, c, req, calls_reason, reasoning) for i, c in enumerate(choices)],
            prompt_logprobs=self._prompt_logprobs(choices, req.prompt_logprobs),
            prompt_token_ids=ids if req.return_token_ids else None)

    def _reply_thinks(self, prompt_ids: list[int]) -> bool:
        """Whether a reply to this chat prompt reasons first, under a reasoning parser: unless the prompt closes a
        think block after its last opening one (Qwen3's template with enable_thinking false writes an empty one)."""
        if self.reasoning_parser is None:
            return False
        tail = self.tokenizer.decode(prompt_ids[-64:])
        return tail.rfind(END) <= tail.rfind(START) or START not in tail

    def _chat_choice(self, index: int, c: _Choice, req: ChatCompletionRequest, calls_reason: str,
                     reasoning: ReasoningParser | None) -> ChatChoice:
        thought, text = reasoning.split(c.text) if reasoning else (None, c.text)
        content, calls = (self.tool_parser.extract(text or "") if req.uses_tools and text else (text, []))
        finish = calls_reason if calls and c.finish_reason == "stop" else c.finish_reason
        message = (ChatMessageOut(content=content, reasoning=thought, tool_calls=calls) if reasoning
                   else ChatMessageOut(content=content, tool_calls=calls))
        return ChatChoice(index=index, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                          logprobs=self._chat_logprobs(c.logprobs, req.return_tokens_as_token_ids) if req.logprobs
                          else None, token_ids=c.token_ids if req.return_token_ids else None)

    def _chat_delta(self, out: SeqOutput, index: int, state: dict) -> ChatStreamChoice:
        delta = ChatDelta()
        if index not in state.setdefault("started", set()):
            state["started"].add(index)
            delta.role = "assistant"
        finish = out.finish_reason
        text = out.text
        if state["reasoning"] is not None:
            thinking: ReasoningStream = state.setdefault(("reasoning", index), state["reasoning"].stream())
            thought, text = thinking.feed(text)
            if finish is not None:
                more_thought, more_text = thinking.finish()
                thought, text = thought + more_thought, text + more_text
            delta.reasoning = thought or None
        if state["tools"]:
            follower: ToolCallStream = state.setdefault(("calls", index), self.tool_parser.stream())
            text, calls = follower.feed(text)
            if finish is not None:
                rest, more = follower.finish()
                text, calls = text + rest, calls + more
                finish = state["calls_reason"] if follower.calls and finish == "stop" else finish
            first = len(follower.calls) - len(calls)
            if calls:
                delta.tool_calls = [ToolCallDelta(index=first + k, id=c.id, function=c.function)
                                    for k, c in enumerate(calls)]
        if text or not (delta.tool_calls or delta.reasoning):
            delta.content = text
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=finish,
                                  logprobs=self._chat_logprobs(out.logprobs, state["as_ids"]) if out.logprobs else None)
        if state["token_ids"]:
            choice.token_ids = out.token_ids
        if finish is not None:
            choice.stop_reason = out.stop_reason
        return choice

    # ---- streaming -------------------------------------------------------------------------
    async def _stream(self, gens, n: int, num_prompt_tokens: int, options: StreamOptions | None, rid: str, obj: str,
                      make_choice, model: str, prompt_ids: list[int] | None = None,
                      plain: _PlainDeltas | None = None) -> AsyncIterator[str]:
        """SSE lines of `_chunks`, then [DONE] (after an error chunk if making them fails)."""
        include_usage = bool(options and options.include_usage)
        try:
            async with aclosing(self._chunks(gens, n, num_prompt_tokens, options, rid, obj, make_choice, model,
                                             prompt_ids, plain)) as chunks:
                async for chunk in chunks:
                    if isinstance(chunk, StreamChunk):
                        yield chunk.sse(include_usage)
                    else:  # a plain text delta's line, or an error body
                        yield chunk if isinstance(chunk, str) else f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # a bug: the headers are sent, so an error chunk, not a connection cut mid-body
            log.exception("stream %s failed", rid)
            yield f"data: {json.dumps(APIError(500, f'internal error: {exc.__class__.__name__}').body())}\n\n"
        yield "data: [DONE]\n\n"

    async def _chunks(self, gens, n: int, num_prompt_tokens: int, options: StreamOptions | None, rid: str, obj: str,
                      make_choice, model: str, prompt_ids: list[int] | None = None,
                      plain: _PlainDeltas | None = None) -> AsyncIterator[StreamChunk | dict | str]:
        """A chunk per output (with a stream interval above 1, a choice's first token, then a chunk per that many
        tokens and the last), or an error body (a dict) if the engine fails, which ends the stream; with
        include_usage a last chunk with the usage (and with continuous_usage_stats the usage so far in every one).
        `prompt_ids` (a chat request's, under return_token_ids) go on the first chunk. With `plain`, the chunk of a
        plain text delta comes as its SSE line (TextDeltaLines)."""
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        created = int(time.time())
        lines = None
        if plain is not None and not continuous:
            lines = TextDeltaLines(StreamChunk(id=rid, object=obj, created=created, model=model, choices=[]),
                                   include_usage, plain.choice)
        completion_tokens, cached_tokens = {}, {}  # a choice's output tokens sent so far; a prompt's cached ones
        predicted = {}  # a choice's kept and refused drafted tokens of a predicted reply, so far
        held: dict[tuple[int, int], SeqOutput] = {}  # a choice's outputs not sent yet (stream interval > 1)
        outputs = _merged(gens, n)
        try:
            async for offset, item in outputs:
                if isinstance(item, Exception) or item.error:
                    err = item if isinstance(item, APIError) else _engine_error(item) if isinstance(
                        item, SeqOutput) else APIError(500, str(item), code="engine_error")
                    yield err.body()
                    return
                choice = (offset, item.index)
                if choice in held:
                    item = held.pop(choice).followed_by(item)
                if (item.finish_reason is None and choice in completion_tokens
                        and item.num_output_tokens - completion_tokens[choice] < self.stream_interval):
                    held[choice] = item
                    continue
                completion_tokens[choice] = item.num_output_tokens
                if item.index == 0:  # a prompt's first choice (the others share what it computed)
                    cached_tokens[offset] = item.num_cached_tokens
                predicted[choice] = item.prediction_tokens
                if item.finish_reason is not None:
                    self.metrics.observe_request(item.num_prompt_tokens, item.num_output_tokens)
                if lines is not None and prompt_ids is None and plain.applies(item, offset + item.index):
                    yield lines.line(offset + item.index, item.text)
                    continue
                chunk = StreamChunk(id=rid, object=obj, created=created, model=model,
                                    choices=[make_choice(item, offset + item.index)], prompt_token_ids=prompt_ids)
                prompt_ids = None
                if continuous:
                    chunk.usage = self._usage(num_prompt_tokens, sum(completion_tokens.values()),
                                              sum(cached_tokens.values()), list(predicted.values()))
                yield chunk
            if include_usage:
                usage = self._usage(num_prompt_tokens, sum(completion_tokens.values()), sum(cached_tokens.values()),
                                    list(predicted.values()))
                yield StreamChunk(id=rid, object=obj, created=created, model=model, choices=[], usage=usage)
        except Exception as exc:  # a bug in making a chunk: every stream format built on these ends with its error
            log.exception("stream %s failed", rid)
            yield APIError(500, f"internal error: {exc.__class__.__name__}").body()
        finally:
            await outputs.aclose()
            for gen in gens:
                await gen.aclose()

    # ---- tokenizer endpoints ---------------------------------------------------------------
    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(req.model)
        self.check_fields(req)
        if isinstance(req, TokenizeChatRequest):
            ids = self._chat_ids(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs)
        else:
            ids = self._tokenize(req.text(), req.special_tokens()) if req.text() else []
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        self.check_fields(req)
        if any(not 0 <= t < self.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {self.vocab_size})", param="tokens")
        text = self.tokenizer.decode(req.tokens)
        return DetokenizeResponse(prompt=text, content=text)


async def chat_stream_parts(chunks: AsyncIterator[StreamChunk | dict]) -> AsyncIterator[tuple[str, Any]]:
    """A streamed chat's chunks (OpenAIServing.chat with as_chunks) for an API built on it, each as (kind, item):
    ("error", the error body) and then nothing, ("usage", UsageInfo) at the end, or ("choice", its first choice);
    the chunks are closed however the caller stops reading."""
    async with aclosing(chunks) as stream:
        async for chunk in stream:
            if isinstance(chunk, dict):  # the engine failed: the stream ends
                yield "error", chunk
                return
            if chunk.usage is not None and not chunk.choices:
                yield "usage", chunk.usage
            else:
                yield "choice", chunk.choices[0]


@dataclass(frozen=True)
class _PlainDeltas:
    """A stream's plain text deltas: which outputs' chunks are one (applies(output, choice index)), and such a
    chunk's choice as its model (choice(index, text)), for TextDeltaLines."""

    applies: Callable[[SeqOutput, int], bool]
    choice: Callable[[int, str], CompletionChoice | ChatStreamChoice]


def _text_only(out: SeqOutput) -> bool:
    """Whether an output adds only text to its choice (no logprobs, not its last)."""
    return out.finish_reason is None and not out.logprobs


async def _merged(gens: list, n: int) -> AsyncIterator[tuple[int, SeqOutput | Exception]]:
    """(choice offset, output or the exception that ended a generator) from every prompt's generator as it comes.

    One generator (the usual request) is read in place: a task and a queue per request cost two event-loop
    hops per streamed token, a fifth of the API process's time per token at c=16.
    """
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        except Exception as exc:  # noqa: BLE001 - forwarded to the client as an error chunk
            yield 0, exc
        return
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
    try:
        remaining = len(tasks)
        while remaining:
            offset, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            yield offset, item
    finally:
        for task in tasks:
            task.cancel()


def _json_or_text(arguments: str):
    """Tool-call arguments as an object for the template (they arrive serialised); text if not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
