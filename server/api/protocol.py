"""OpenAI wire types: requests (validated, 400 on bad input) and responses.

Requests accept fields they do not know, as vLLM does (clients send `store`, `service_tier`, ... and
broke when they were refused): `unknown_fields()` names them so the serving layer can log them, or
refuse them with 400 when `server.strict_fields` is on.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from json.encoder import encode_basestring
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator,
                      model_serializer, model_validator)

from server.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutput

MAX_N = 16
MAX_STOP = 16
MAX_STOP_LEN = 256
_MIN_TEMPERATURE = 1e-5
_MIN_TOP_P = 1e-6

Probability = Annotated[float, Field(allow_inf_nan=False)]


class RequestPart(BaseModel):
    """A request part that keeps unknown fields aside (in model_extra) instead of failing.

    Strict: a value of the wrong JSON type (`"stream": 0`, `"max_tokens": "5"`) is a 400, as the
    published schema says, not silently coerced.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of every unknown field in this part and the parts inside it."""
        names = [prefix + key for key in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, RequestPart):
                    where = f"{name}.{i}" if isinstance(value, list) else name
                    names += item.unknown_fields(f"{prefix}{where}.")
        return names


class StreamOptions(RequestPart):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: usage so far in every chunk (with include_usage)")


class JsonSchemaFormat(RequestPart):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class StructuralTag(RequestPart):
    """One structure of vLLM's structural_tag: once the text reaches `begin`, JSON for `schema`, then `end`."""

    begin: str = Field(min_length=1)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str = ""


class StructuralTags(RequestPart):
    """vLLM's structural_tag (its original form): free text in which each structure begins only after one of the
    `triggers` (the start of its `begin`), and is then held to its schema up to its `end`: tool calls in the
    middle of a reply."""

    structures: list[StructuralTag] = Field(min_length=1)
    triggers: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self):
        if any(not trigger for trigger in self.triggers):
            raise ValueError("structural_tag: an empty trigger")
        for i, s in enumerate(self.structures):
            if not any(s.begin.startswith(trigger) for trigger in self.triggers):
                raise ValueError(f"structural_tag: structures[{i}].begin {s.begin!r} starts with none of the triggers")
        return self

    def spec(self) -> StructuredOutput:
        return StructuredOutput("structural_tag", self.model_dump_json(by_alias=True, exclude_none=True))


class ResponseFormat(RequestPart):
    """OpenAI's response_format: free text, any JSON object, or JSON for a schema; vLLM's structural_tag."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructuralTag] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        if self.type == "structural_tag":
            StructuralTags(structures=self.structures or [], triggers=self.triggers or [])
        return self

    def spec(self) -> StructuredOutput | None:
        """The decoding constraint this asks for (None for text)."""
        if self.type == "json_schema":
            return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))
        if self.type == "structural_tag":
            return StructuralTags(structures=self.structures, triggers=self.triggers).spec()
        return StructuredOutput("json_object") if self.type == "json_object" else None


class StructuredOutputs(RequestPart):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="GBNF (llama.cpp's) or Lark")
    json_object: bool | None = None
    structural_tag: StructuralTags | str | None = Field(None, description="{structures, triggers}, or it as JSON text")
    whitespace_pattern: str | None = Field(None, description="JSON kinds: the whitespace allowed (default none)")
    # vLLM's backend switches, accepted and without effect here (one backend, llguidance, and JSON is
    # already written without free whitespace)
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if len(self._given()) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object, structural_tag; got "
                             + (", ".join(self._given()) or "none"))
        if isinstance(self.structural_tag, str):  # vLLM's own form: the object as JSON text
            try:
                tags = json.loads(self.structural_tag)
            except ValueError as exc:
                raise ValueError(f"structural_tag: not JSON: {exc}") from None
            self.structural_tag = StructuralTags.model_validate(tags)
        return self

    def _given(self) -> list[str]:
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return [name for name, value in values.items() if value is not None]

    def spec(self) -> StructuredOutput:
        """The decoding constraint this asks for."""
        kind, ws = self._given()[0], self.whitespace_pattern
        if kind == "json":
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput("json_schema", schema, whitespace_pattern=ws)
        if kind == "json_object":
            return StructuredOutput("json_object", whitespace_pattern=ws)
        if kind == "choice":
            return StructuredOutput("choice", json.dumps(self.choice))
        if kind == "structural_tag":
            return self.structural_tag.spec()
        return StructuredOutput(kind, self.regex if kind == "regex" else self.grammar)


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam's step asks for its 2 x width likeliest next tokens

# vLLM's older names for structured_outputs' fields (removed in vLLM 0.12; clients still send them)
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}


class _Request(RequestPart):
    model: str | None = Field(None, description="the served name or an alias; absent: the served model (as vLLM)")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="extension: 0 or -1 disables")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    ignore_eos: bool = Field(False, description="extension (vLLM): keep generating past EOS")
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    # vLLM extensions
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] | None = Field(None, description="words never written (as vLLM: with and without a "
                                                          "leading space)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the prompt's last k tokens "
                                                                       "(-1: max_model_len)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each prompt token's logprob "
                                                                                "and its top alternatives")
    use_beam_search: bool = Field(False, description="vLLM's beam search: the n best replies of a search n beams "
                                                     "wide (n at most 10)")
    length_penalty: float = Field(1.0, allow_inf_nan=False, description="beam search: a reply's score is its "
                                                                       "logprob over length ** length_penalty")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="vLLM's: under --scheduling-policy priority, "
                                                                   "lower runs earlier")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM's: prompt blocks are shared from the "
                                   "prefix cache only with requests of the same salt (one tenant's)")
    return_token_ids: bool = Field(False, description="vLLM's: the prompt's token ids and each choice's generated ones "
                                   "in the reply (streamed: the prompt's on the first chunk, each chunk's new ones)")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM's: logprobs name each token 'token_id:<id>' "
                                             "(tokens whose text is not JSON-encodable stay identifiable)")
    request_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,128}$", description="vLLM's: the reply's id "
                                   "(after cmpl- or chatcmpl-), as the X-Request-Id header sets it")
    # structured output (one constraint at most)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # accepted for compatibility, no effect on generation
    guided_decoding_backend: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop sequences are at most {MAX_STOP_LEN} characters")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise ValueError("stream_options is only allowed with stream: true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or at least 1")
        return self

    @model_validator(mode="after")
    def _check_structured(self):
        guided = {new: getattr(self, old) for old, new in _GUIDED_FIELDS.items() if getattr(self, old) is not None}
        if guided:  # vLLM 0.11's spelling becomes the one structured_outputs reads
            if self.structured_outputs is not None:
                raise ValueError("use structured_outputs or the guided_* fields, not both")
            try:
                self.structured_outputs = StructuredOutputs.model_validate(guided)
            except ValidationError as exc:  # name the field the client sent
                err = exc.errors()[0]
                old = {new: old for old, new in _GUIDED_FIELDS.items()}.get(err["loc"][0] if err["loc"] else None)
                raise ValueError(f"{old or 'guided_*'}: {err['msg'].removeprefix('Value error, ')}") from None
        if self.structured_outputs is not None and self.response_format and self.response_format.type != "text":
            raise ValueError("response_format cannot be combined with structured_outputs (or guided_*)")
        return self

    def output_constraint(self) -> tuple[StructuredOutput, str] | None:
        """The decoding constraint the request asks for, and the field that asked for it (for errors)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec(), "structured_outputs"
        spec = self.response_format.spec() if self.response_format else None
        return (spec, "response_format") if spec else None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _check_beam_search(self):
        if not self.use_beam_search:
            return self
        clash = [name for name, used in (
            ("stream", self.stream), ("stop", self.stop), ("echo", getattr(self, "echo", False)),
            ("logprobs", getattr(self, "logprobs", None) not in (None, False)),
            ("prompt_logprobs", self.prompt_logprobs is not None), ("tools", getattr(self, "tools", None)),
            ("structured output", self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text"))) if used]
        if clash:
            raise ValueError(f"use_beam_search does not combine with {', '.join(clash)}")
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(f"use_beam_search: n (the beam width) is at most {MAX_BEAM_WIDTH}")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The one place request fields turn into engine sampling settings (range errors: ValueError)."""
        # Values the float32 sampler cannot tell from 0 (found by fuzzing): a temperature this small is
        # greedy in effect (logits / t overflow), and a top_p under 1e-6 keeps exactly the top token, as
        # 1e-6 does for any vocabulary under a million (the top token's probability is >= 1/vocab).
        temperature = 0.0 if self.temperature < _MIN_TEMPERATURE else self.temperature
        top_p = max(self.top_p, _MIN_TOP_P)
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=self.top_k,
            seed=self.seed, stop=self.stop_list(), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, logprobs=logprobs,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []), skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, structured=structured,
            allowed_token_ids=self.allowed_token_ids, prompt_logprobs=self.prompt_logprobs, priority=self.priority,
            cache_salt=self.cache_salt)


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = Field(None, description="fill in the middle: the text after the reply (prompt before it), "
                                                 "for a model whose tokenizer has FIM tokens")

    @model_validator(mode="after")
    def _check(self):
        if self.suffix is not None and any(not isinstance(p, str) for p in self.prompts()):
            raise ValueError("suffix goes with text prompts (the prefixes), not token ids")
        if self.suffix is not None and self.echo:
            raise ValueError("suffix and echo do not go together")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (server-side ranking is not supported)")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """As for every request, plus prompt logprobs when echo and logprobs are both set (lm-eval's scoring)."""
        params = super().sampling_params(max_tokens, logprobs, structured)
        wanted = [n for n in (logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return replace(params, prompt_logprobs=max(wanted) if wanted else None)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        return prompt_list(self.prompt)


def prompt_list(p: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A text, texts, token ids or lists of them, as a list of prompts (text or token ids)."""
    if isinstance(p, str):
        return [p]
    if not p:
        return []
    if isinstance(p[0], int):
        return [p]
    return list(p)


class EmbeddingRequest(RequestPart):
    """POST /v1/embeddings (OpenAI's fields, and vLLM's truncate_prompt_tokens and add_special_tokens)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="the first this many values, normalised again (for "
                                                           "models trained for it: Matryoshka embeddings)")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="embed each input's last k tokens")
    add_special_tokens: bool = True
    normalize: bool = Field(True, description="L2-normalise each vector (vLLM's switch; false: the raw state)")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32 values")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ContentPart(RequestPart):
    type: str = Field(description="text (the models served take text only)")
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, v):
        if v != "text":
            raise ValueError(f"content part type {v!r} is not supported: the models served take text parts only")
        return v


def _text_or_parts(value: Any) -> str:
    return "parts" if isinstance(value, list) else "text"


def text_or_parts(part: type) -> Any:
    """A string, or a list of `part` (validated as that list when it is one, so an error names its parts rather
    than the string's failure)."""
    return Annotated[Annotated[str, Tag("text")] | Annotated[list[part], Tag("parts")], Discriminator(_text_or_parts)]


# A message's content: a string, or a list of text parts.
Content = text_or_parts(ContentPart)


class FunctionCall(RequestPart):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, serialised")


class ToolCall(RequestPart):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(RequestPart):
    """Fields every chat message may carry; the role classes below say which are required."""

    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None  # null when it only calls tools (read as empty otherwise)
    # an earlier reply's reasoning, sent back (vLLM's name, and DeepSeek's and llama.cpp's older one): the chat
    # template sees it as `reasoning_content`, the variable thinking models' templates read
    reasoning: str | None = None
    reasoning_content: str | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


# One schema per role (so the OpenAPI document says what is accepted: only an assistant's content may be
# null, a tool message needs tool_call_id), chosen by `role`.
ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(RequestPart):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestPart):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestPart):
    name: str


class NamedToolChoice(RequestPart):
    type: Literal["function"] = "function"
    function: NamedFunction


def check_continuation(messages: list, add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule for continue_final_message (the reply goes on from the last, assistant, message's text): it
    excludes a generation prompt (an opened new turn) and needs an assistant message last."""
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")


class Prediction(RequestPart):
    """OpenAI's Predicted Outputs: text the reply is expected to repeat, drafted and checked by the model (the
    reply stays the model's own; where it follows the prediction, several tokens a step)."""

    type: Literal["content"]
    content: Content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    documents: list[dict[str, str]] | None = Field(None, description="vLLM's: documents for a RAG chat template (each "
                                                   "a dict such as title and text), as transformers renders them")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="OpenAI's: for a template that takes it (gpt-oss's), the reasoning_effort variable")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    prediction: Prediction | None = None

    def template_variables(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort where they lack it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _check(self):
        check_continuation(self.messages, self.add_generation_prompt, self.continue_final_message)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in {t.function.name for t in self.tools}:
                raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not in tools")
        if self.forces_tool_call and self.output_constraint():
            raise ValueError(f"{self.output_constraint()[1]} cannot be combined with a required or named tool_choice")
        return self

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def uses_tools(self) -> bool:
        """Tools reach the prompt and the output is parsed for calls (tool_choice none turns both off)."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[Tool]:
        """The tools a required / named tool_choice lets the model call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools or []) if self.tool_choice == "required" else []


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    """With a predicted reply (OpenAI's names): its drafted tokens the reply kept, and those the model refused."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI error envelope."""

    error: ErrorInfo


class Logprobs(BaseModel):
    """Completions-style logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token, token id -> entry; None for the first


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM's: the stop token id or stop string that ended "
                                                            "the choice (null: EOS or length)")
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, description="vLLM's return_token_ids: the prompt's token ids")
    token_ids: list[int] | None = Field(None, description="vLLM's return_token_ids: the generated token ids")

    @model_serializer(mode="wrap")
    def _prompt_logprobs_when_asked(self, handler):  # streamed chunks are this type too: no null on each
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)
        for field in ("stop_reason", "prompt_token_ids", "token_ids"):  # a streamed chunk's, where it has them
            if field not in self.model_fields_set:
                out.pop(field, None)
        return out


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = Field(None, description="a thinking model's reasoning (server.reasoning_parser); absent "
                                                    "when the server parses none")
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _reasoning_when_parsed(self, handler):
        out = handler(self)
        if out.get("reasoning") is None and "reasoning" not in self.model_fields_set:
            out.pop("reasoning", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM's: the stop token id or stop string that ended "
                                                            "the choice (null: EOS or length)")
    token_ids: list[int] | None = Field(None, description="vLLM's return_token_ids: the generated token ids")


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, description="vLLM's return_token_ids: the prompt's token ids "
                                               "(the chat template's rendering)")


class ToolCallDelta(BaseModel):
    """A tool call as a streamed delta carries it: whole, with its position among the message's calls."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(BaseModel):
    """What a chat chunk adds to the message; only the fields it carries are sent (role once, first)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    stop_reason: int | str | None = None  # on the last chunk of a choice (vLLM's)
    token_ids: list[int] | None = None  # the chunk's new tokens, under return_token_ids

    @model_serializer(mode="wrap")
    def _stop_reason_when_finished(self, handler):
        out = handler(self)
        for field in ("stop_reason", "token_ids"):
            if field not in self.model_fields_set:
                out.pop(field, None)
        return out


# What str.splitlines (and clients that split a stream like it, httpx's aiter_lines among them) takes for a line end
# but JSON leaves raw inside a string; escaped, an SSE event stays one line for such clients too.
_RAW_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class StreamChunk(BaseModel):
    """One SSE event of a streamed completion or chat completion (`usage` only when the client asked)."""

    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[CompletionChoice | ChatStreamChoice]  # a completion chunk's choice is a full one's shape
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # a chat stream's first chunk, under return_token_ids (vLLM's)

    def sse(self, include_usage: bool) -> str:
        """The chunk as an SSE `data:` line."""
        exclude = set() if include_usage else {"usage"}
        if self.prompt_token_ids is None:
            exclude.add("prompt_token_ids")
        data = self.model_dump_json(exclude=exclude or None)
        return f"data: {data if data.isascii() else data.translate(_RAW_LINE_BREAKS)}\n\n"


class TextDeltaLines:
    """The SSE lines of one stream's plain text deltas (a choice's chunk that carries only its new text), each the
    line pydantic gives for that chunk, written without building it.

    Why: at c=1 each token's chunk is built and serialized in a process whose caches the engine's weight stream has
    just emptied, where the two models and their serialization took ~115 us a chunk (4 us warm); a line cut from a
    template and the JSON-escaped text take ~9. The template is pydantic's own line for the same chunk with a
    placeholder text, made once per choice, so the fields and their order are the models' by construction; the text
    is escaped as pydantic escapes it (the same escapes as Python's JSON encoder, non-ASCII characters raw, the line
    breaks JSON leaves raw escaped as `sse` escapes them).
    """

    _PLACEHOLDER = "\x00text\x00"  # (escaped in JSON: no id or model name can spell it)

    def __init__(self, head: StreamChunk, include_usage: bool, choice: Callable[[int, str], BaseModel]):
        """head: the stream's chunk without choices; choice(index, text): that choice's plain delta as a model."""
        self._head, self._include_usage, self._choice = head, include_usage, choice
        self._cuts: dict[int, tuple[str, str]] = {}

    def line(self, index: int, text: str) -> str:
        """The SSE line of choice `index`'s chunk carrying `text` alone."""
        cut = self._cuts.get(index)
        if cut is None:
            chunk = self._head.model_copy(update={"choices": [self._choice(index, self._PLACEHOLDER)]})
            before, _, after = chunk.sse(self._include_usage).rpartition(encode_basestring(self._PLACEHOLDER))
            cut = self._cuts[index] = before, after
        escaped = encode_basestring(text)
        return f"{cut[0]}{escaped if escaped.isascii() else escaped.translate(_RAW_LINE_BREAKS)}{cut[1]}"


class HealthStatus(BaseModel):
    """GET /health: "ok", or why not (loading, draining, error: ...)."""

    status: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "neuronmm"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(RequestPart):
    """POST /tokenize with a prompt (vLLM's shape), or llama-server's `content` and `add_special`."""

    # the published schema requires one of the two, as the validator does: a chat body (messages, neither) must
    # not match this variant of /tokenize's oneOf too
    model_config = ConfigDict(**RequestPart.model_config,
                              json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["content"]}]})
    model: str | None = None
    prompt: str | None = None
    content: str | None = Field(None, description="llama-server's name for the prompt")
    add_special_tokens: bool = True
    add_special: bool | None = Field(None, description="llama-server's name for add_special_tokens")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self):
        if (self.prompt is None) == (self.content is None):
            raise ValueError("give the text as prompt (or llama-server's content), once")
        return self

    def text(self) -> str:
        return self.prompt if self.prompt is not None else self.content

    def special_tokens(self) -> bool:
        return self.add_special if self.add_special is not None else self.add_special_tokens


class TokenizeChatRequest(RequestPart):
    """POST /tokenize with chat messages, rendered through the chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self):
        check_continuation(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self


def _tokenize_kind(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "prompt"


# POST /tokenize's body: chat messages when it has `messages`, else a prompt (so an error names the right one's fields)
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class LoadLoraAdapterRequest(RequestPart):
    """POST /v1/load_lora_adapter (vLLM's, with runtime LoRA updates on)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1, description="a PEFT LoRA folder on the server's machine")


class UnloadLoraAdapterRequest(RequestPart):
    """POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="vLLM's adapter number: accepted, the name decides")


class DetokenizeRequest(RequestPart):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str = Field(description="the same text under llama-server's name")


class VersionResponse(BaseModel):
    version: str


class ServerLoad(BaseModel):
    """GET /load (vLLM's): requests inside the server that may run the model, for a load-aware router."""

    server_load: int


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
