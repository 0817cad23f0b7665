"""FastAPI app: thin routes over OpenAIServing, the error envelope, auth, body limit, health, metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.errors import APIError, error_response
from server.api.generation_defaults import sampling_defaults
from server.api.metrics import ServerMetrics
from server.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                 CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                 EmbeddingRequest, EmbeddingResponse, HealthStatus, LoadLoraAdapterRequest, ModelCard,
                                 ModelList, ServerLoad, TokenizeChatRequest, TokenizeRequest, TokenizeResponse,
                                 UnloadLoraAdapterRequest,
                                 VersionResponse)
from server.api.embeddings import EmbeddingsAPI
from server.api.llama_cpp import ApplyTemplateResponse, LlamaCompletionRequest, LlamaCppAPI, LlamaInfillRequest
from server.api.scoring import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse, ScoringAPI
from server.api.messages import CountTokensRequest, CountTokensResponse, MessagesAPI, MessagesRequest, MessagesResponse
from server.api.response_store import ResponseStore
from server.api.responses import DeletedResponse, InputItemList, ResponseObject, ResponsesAPI, ResponsesRequest
from server.api.serving import OpenAIServing
from server.api.shutdown import GracefulServer
from server.backends import check_backend_available
from server.config import Config, ConfigError
from server.engine.async_engine import AsyncEngine
from server.engine.engine_core import EngineCoreClient
from server.gc_heap import freeze_heap
from server.models.source import resolve_model_dir
from server.runtime import Runtime, eos_token_ids, load_runtime, load_tokenizer

log = logging.getLogger(__name__)

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503)}
# a route answering a line of text (as vLLM's LoRA routes do; response_class PlainTextResponse), its errors in JSON
_JSON_ERRORS = {code: {"description": "an OpenAI error body", "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}} for code in _ERRORS}
# A POST answers JSON, or an SSE stream when the request sets `stream: true`.
_POST_RESPONSES = {**_ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}
_OPEN_PATHS = {"/health", "/ping", "/version", "/load"}  # and /metrics unless server.metrics_require_api_key


def _as_json(scope) -> dict:
    """Every POST body here is JSON: read it as JSON whatever its Content-Type says (curl's -d sends a form type,
    which FastAPI would not parse), as llama.cpp's server reads it."""
    headers = scope["headers"]
    kind = next((v for k, v in headers if k == b"content-type"), b"")
    if kind.split(b";")[0].strip().lower().endswith(b"json"):
        return scope
    return {**scope, "headers": [(k, v) for k, v in headers if k != b"content-type"]
            + [(b"content-type", b"application/json")]}


# routes off /v1 that run the model (SageMaker's, vLLM's, llama-server's)
_MODEL_ROOTS = {"/invocations", "/score", "/rerank", "/completion", "/completions", "/infill"}


def _generates(scope) -> bool:
    """A request that may run the model: the OpenAI routes' POSTs (/v1, Cohere's /v2/rerank) and those off them."""
    path = scope["path"]
    return scope["method"] == "POST" and (path.startswith(("/v1/", "/v2/")) or path in _MODEL_ROOTS)


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def package_version() -> str:
    try:
        return version("neuronmm")
    except PackageNotFoundError:  # a checkout that was never installed
        return "0+unknown"


class AppState:
    """What the routes share: readiness, the async engine, the serving layer, metrics."""

    def __init__(self, cfg: Config, freeze_startup_heap: bool = False):
        self.cfg = cfg
        self.freeze_startup_heap = freeze_startup_heap
        self._heap_frozen = False
        self.metrics = ServerMetrics(cfg.model.name)
        self.ready = False
        self.draining = False
        self.num_active = 0  # generation requests inside the app (the drain waits for 0)
        self.load_error: str | None = None
        # the configuration's mistake that stopped the load, and who ends the server for it (`neuronmm serve`'s;
        # unset, the server stays up and /health says why)
        self.config_error: str | None = None
        self.on_config_error: Callable[[], None] | None = None
        self.runtime: Runtime | None = None  # only when the engine runs in this process
        self.engine: AsyncEngine | EngineCoreClient | None = None
        self.starting_engine: EngineCoreClient | None = None  # an engine core spawned, not yet serving
        self.serving: OpenAIServing | None = None
        self.responses: ResponsesAPI | None = None
        self.messages: MessagesAPI | None = None
        self.embeddings: EmbeddingsAPI | None = None
        self.scoring: ScoringAPI | None = None
        self.llama_cpp: LlamaCppAPI | None = None

    def start(self, runtime: Runtime) -> None:
        """Serve from an engine loaded in this process (its loop runs in a thread)."""
        self.runtime = runtime
        engine = AsyncEngine(runtime.engine, self.cfg.engine.max_queue, on_abort=lambda: self.metrics.finished("abort"))
        runtime.engine.observers.append(self.metrics.observe_step)
        self._serve_with(engine, runtime.tokenizer, runtime.model_dir)

    def start_engine_process(self, loop: asyncio.AbstractEventLoop, core: EngineCoreClient | None = None) -> None:
        """Serve from an engine core in its own process, read by `loop`; blocks until its model is loaded and warm.

        The core is spawned first (or was, by `neuronmm serve`, before this process imported the server: `core`):
        its imports and load run on the other core while this process reads the tokenizer and freezes its own
        start-up heap.
        """
        engine = core or EngineCoreClient(self.cfg)
        engine.on_abort = lambda: self.metrics.finished("abort")
        engine.on_step = self.metrics.observe_step
        if core is None:
            engine.spawn()
        self.starting_engine = engine  # a shutdown while it loads stops it (lifespan)
        try:
            model_dir = resolve_model_dir(self.cfg.model, self.cfg.cache_path)
            tokenizer = load_tokenizer(model_dir)
            self.settle_heap()
            engine.wait_ready(loop)
        except BaseException:
            engine.stop()
            raise
        self._serve_with(engine, tokenizer, model_dir)

    def not_ready_error(self) -> APIError:
        """The 503 a request gets before serving: the model is loading (retry), or its load failed (no retry helps)."""
        if self.load_error:
            return APIError(503, f"model failed to load: {self.load_error}", code="load_failed")
        return APIError(503, "model is loading", code="not_ready", headers={"Retry-After": "5"})

    def settle_heap(self) -> None:
        """Freeze this process's start-up heap, once, if asked to (server.gc_heap): the end of the API's start-up."""
        if self.freeze_startup_heap and not self._heap_frozen:
            self._heap_frozen = True
            freeze_heap("api")

    def _serve_with(self, engine, tokenizer, model_dir: Path | None) -> None:
        self.engine = engine
        # a dead engine runs nothing: its last counts would stay on the gauges for good
        self.metrics.bind_gauges(lambda: self.engine.num_running if self.engine.is_alive else 0,
                                 lambda: self.engine.num_waiting if self.engine.is_alive else 0)
        defaults = sampling_defaults(model_dir, self.cfg.model.generation_config) if model_dir else {}
        serving = OpenAIServing(self.engine, tokenizer, self.cfg, self.metrics, defaults,
                                eos_token_ids(model_dir, tokenizer) if model_dir else None)
        self.responses = ResponsesAPI(serving, ResponseStore(self.cfg.server.responses_store_size))
        self.embeddings = EmbeddingsAPI(serving)
        self.scoring = ScoringAPI(self.embeddings)
        self.llama_cpp = LlamaCppAPI(serving)
        self.messages = MessagesAPI(serving)
        self.serving = serving  # last: a set serving layer means the others are ready (ready_state)
        if isinstance(engine, AsyncEngine):
            engine.start()
        else:
            self.metrics.watch_engine_core(lambda: engine.pid)
        self.ready = True


class GuardMiddleware:
    """Pure ASGI guard (streams pass through untouched): API key, body size limit, readiness, draining."""

    def __init__(self, app, state: "AppState"):
        self.app = app
        self.state = state
        self.api_key = state.cfg.server.api_key
        self.max_body = state.cfg.server.max_body_bytes
        self.body_timeout = state.cfg.server.body_timeout_s
        self.open_paths = _OPEN_PATHS | (set() if state.cfg.server.metrics_require_api_key else {"/metrics"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rejection = self._check(scope)
        if rejection is not None:
            return await rejection(scope, receive, send)
        if scope["method"] == "POST":
            scope = _as_json(scope)
        counted = _generates(scope)
        self.state.num_active += counted
        try:
            await self._call_limited(scope, receive, send)
        finally:
            self.state.num_active -= counted

    def _authorized(self, headers: dict[str, str]) -> bool:
        """`Authorization: Bearer <key>` (scheme in any case), or Anthropic's `x-api-key: <key>` (its clients send
        that); the key never reaches a log line."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # compare_digest's time does not depend on where the strings differ, so it leaks no prefix
        bearer = hmac.compare_digest(token.strip().encode(), self.api_key.encode()) and scheme.lower() == "bearer"
        return bearer or hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), self.api_key.encode())

    def _check(self, scope) -> JSONResponse | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if self.api_key and path not in self.open_paths and not self._authorized(headers):
            return error_response(401, "missing or invalid API key", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return error_response(413, f"request body over {self.max_body} bytes", code="body_too_large")
        if _generates(scope):
            if self.state.draining:
                return error_response(503, "server is shutting down", code="shutting_down")
            if not self.state.ready:
                return self.state.not_ready_error().response()
        return None

    async def _call_limited(self, scope, receive, send) -> None:
        """Run the app, cutting a body at max_body bytes (413) or when it stalls for body_timeout_s (408).

        The Content-Length check in _check cannot see chunked bodies, and nothing else bounds a client
        that sends a body slowly. Either way the app is told the client left (it stops reading) and
        whatever it answers to that is dropped in favour of the 413 / 408.
        """
        seen = 0
        cut: JSONResponse | None = None
        body_done = False

        async def receive_limited():
            nonlocal seen, cut, body_done
            if cut is not None:
                return {"type": "http.disconnect"}
            if body_done:  # e.g. a streaming response listening for the disconnect: no time limit
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                cut = error_response(408, f"request body not received within {self.body_timeout:g} s",
                                     code="body_timeout")
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_body:
                    cut = error_response(413, f"request body over {self.max_body} bytes", code="body_too_large")
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_cut(message):
            if cut is None:
                await send(message)

        await self.app(scope, receive_limited, send_unless_cut)
        if cut is not None:
            await cut(scope, receive, send)


class RequestIdMiddleware:
    """Pure ASGI: the request id (a client's X-Request-Id if sane, else a new one) in request.state and
    echoed in the response headers; every response counted by method, route and status class."""

    def __init__(self, app, state: "AppState"):
        self.app = app
        self.metrics = state.metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = sent if _REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start, status = time.monotonic(), 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            handler = route.path if route is not None else "unmatched"
            self.metrics.observe_http(scope["method"], handler, status, time.monotonic() - start)


def _install_middleware(app: FastAPI, state: "AppState") -> None:
    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(RequestIdMiddleware, state=state)  # outside the guard: its 401/413/503 count too
    if state.cfg.server.cors_origins:
        # Added last, so outermost: preflights (which carry no API key) are answered before the guard,
        # and the guard's 401/413/503 bodies get CORS headers a browser can read.
        app.add_middleware(CORSMiddleware, allow_origins=state.cfg.server.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":  # its loc is ("body", character offset): no field to name
            where = err.get("loc", ())[-1]
            reason = (err.get("ctx") or {}).get("error", "JSON decode error")
            return error_response(400, f"request body is not valid JSON: {reason} (at character {where})")
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's prefix for our checks
        if err.get("type") == "extra_forbidden":
            msg = "unrecognized request argument"
        return error_response(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {exc.__class__.__name__}")


def _install_routes(app: FastAPI) -> None:
    def serving(request: Request) -> OpenAIServing:
        return request.app.state.neuronmm.serving

    @app.get("/health", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
    @app.head("/health", include_in_schema=False)
    @app.get("/ping", response_model=HealthStatus, responses={503: {"model": HealthStatus}})  # SageMaker's name
    @app.post("/ping", include_in_schema=False)
    async def health(request: Request):
        state: AppState = request.app.state.neuronmm
        if state.ready and not state.draining and state.engine.is_alive:
            return {"status": "ok"}
        if state.load_error:
            status = "error: " + state.load_error
        elif state.draining:
            status = "draining"
        elif state.ready:  # loaded, but the engine thread is gone: requests would get 503
            status = "error: engine loop stopped"
        else:
            status = "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: {"model": ErrorResponse}})
    async def metrics(request: Request):
        return PlainTextResponse(request.app.state.neuronmm.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/load", response_model=ServerLoad)
    async def server_load(request: Request):
        """vLLM's load report for routers: the requests inside the server that may run the model."""
        return ServerLoad(server_load=request.app.state.neuronmm.num_active)

    @app.get("/version", response_model=VersionResponse)
    async def server_version():
        return VersionResponse(version=package_version())

    def model_cards(state: AppState) -> list[ModelCard]:
        """The served model under each of its names, then each LoRA adapter (its folder, its base), as vLLM lists."""
        cfg = state.cfg
        adapters = state.serving.adapters.paths if state.serving is not None else cfg.engine.lora_modules
        return [ModelCard(id=name, max_model_len=cfg.engine.max_model_len)
                for name in (cfg.model.name, *cfg.server.model_aliases)] + [
                ModelCard(id=name, max_model_len=cfg.engine.max_model_len, root=path, parent=cfg.model.name)
                for name, path in adapters.items()]

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(request: Request):
        return ModelList(data=model_cards(request.app.state.neuronmm))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str, request: Request):
        for card in model_cards(request.app.state.neuronmm):
            if card.id == model_id:
                return card
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")

    def ready_state(request: Request) -> AppState:
        """The app's state once the model serves (its serving layer and Responses API set), or 503 while it loads:
        the guard lets these paths through."""
        state: AppState = request.app.state.neuronmm
        if state.serving is None:
            raise state.not_ready_error()
        return state

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: Annotated[TokenizeRequest, Body()], request: Request):  # Body(): FastAPI 0.115 needs it
        return ready_state(request).serving.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request):
        return ready_state(request).serving.detokenize(body)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_JSON_ERRORS)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
        """vLLM's runtime LoRA loading (server.allow_runtime_lora_updating): a success line, as vLLM answers."""
        return PlainTextResponse(await ready_state(request).serving.adapters.load(body))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_JSON_ERRORS)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
        """vLLM's runtime LoRA unloading: the adapter must have no request in flight."""
        return PlainTextResponse(await ready_state(request).serving.adapters.unload(body))

    async def respond(result):
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return result

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_POST_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await respond(await serving(request).completions(body, request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_POST_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request):
        return await respond(await serving(request).chat(body, request))

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_POST_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await ready_state(request).embeddings.create(body, request)

    @app.post("/completion", responses=_POST_RESPONSES)
    @app.post("/completions", responses=_POST_RESPONSES)
    async def llama_cpp_completion(body: LlamaCompletionRequest, request: Request):
        """llama-server's own completion API (its fields, defaults and answer), on the completions path."""
        return await respond(await ready_state(request).llama_cpp.completion(body, request))

    @app.get("/props", responses=_ERRORS)
    async def llama_cpp_props(request: Request):
        """llama-server's: the context size, slots, chat template and default sampling of this server."""
        state = ready_state(request)
        return state.llama_cpp.props(state.cfg.engine.max_num_seqs, package_version())

    @app.post("/infill", responses=_POST_RESPONSES)
    async def llama_cpp_infill(body: LlamaInfillRequest, request: Request):
        """llama-server's fill in the middle: the code between input_prefix and input_suffix, /completion's answer."""
        return await respond(await ready_state(request).llama_cpp.completion(body, request))

    @app.post("/apply-template", response_model=ApplyTemplateResponse, responses=_ERRORS)
    async def apply_template(body: TokenizeChatRequest, request: Request):
        """llama-server's: the chat template's rendering of the messages."""
        return ready_state(request).llama_cpp.apply_template(body)

    @app.post("/score", response_model=ScoreResponse, responses=_POST_RESPONSES)
    @app.post("/v1/score", response_model=ScoreResponse, responses=_POST_RESPONSES)
    async def score(body: ScoreRequest, request: Request):
        """vLLM's score: the cosine similarity of text_1's and each text_2's embeddings."""
        return await ready_state(request).scoring.score(body, request)

    @app.post("/rerank", response_model=RerankResponse, responses=_POST_RESPONSES)
    @app.post("/v1/rerank", response_model=RerankResponse, responses=_POST_RESPONSES)
    @app.post("/v2/rerank", response_model=RerankResponse, responses=_POST_RESPONSES)
    async def rerank(body: RerankRequest, request: Request):
        """vLLM's rerank (Jina's and Cohere's shape): the documents by their embeddings' similarity to the query."""
        return await ready_state(request).scoring.rerank(body, request)

    @app.post("/v1/responses", response_model=ResponseObject, responses=_POST_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request):
        return await respond(await ready_state(request).responses.create(body, request))

    @app.post("/v1/messages", response_model=MessagesResponse, responses=_POST_RESPONSES)
    async def messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API (as vLLM and llama.cpp serve it), on the chat path."""
        return await respond(await ready_state(request).messages.create(body, request))

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=_ERRORS)
    async def count_message_tokens(body: CountTokensRequest, request: Request):
        return ready_state(request).messages.count_tokens(body)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
    async def stored_response(response_id: str, request: Request):
        return ready_state(request).responses.get(response_id)

    @app.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=_ERRORS)
    async def response_input_items(response_id: str, request: Request,
                                   limit: Annotated[int, Query(ge=1, le=100)] = 20,
                                   order: Literal["asc", "desc"] = "desc", after: str | None = None,
                                   before: str | None = None):
        return ready_state(request).responses.input_items(response_id, limit, order, after, before)

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
    async def delete_response(response_id: str, request: Request):
        return await ready_state(request).responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=_ERRORS)
    async def cancel_response(response_id: str, request: Request):
        """Stop a background response (OpenAI's and vLLM's route)."""
        return await ready_state(request).responses.cancel(response_id)

    either_body = {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"}
                             for m in (ChatCompletionRequest, CompletionRequest)]}

    @app.post("/invocations", response_model=ChatCompletionResponse | CompletionResponse, responses=_POST_RESPONSES,
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"application/json": {"schema": either_body}}}})
    async def invocations(request: Request):
        """SageMaker's inference route, as vLLM serves it: a chat body (with messages) or a completions body."""
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "request body is not valid JSON") from None
        kind = ChatCompletionRequest if isinstance(body, dict) and "messages" in body else CompletionRequest
        try:
            req = kind.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        handle = serving(request).chat if kind is ChatCompletionRequest else serving(request).completions
        return await respond(await handle(req, request))


def _install_openapi(app: FastAPI) -> None:
    """The generated schema, less FastAPI's 422 entries: validation errors are answered 400, as OpenAI does."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for item in schema["paths"].values():
                for op in item.values():
                    op["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def create_app(cfg: Config, loader: Callable[[Config], Runtime] | None = None,
               freeze_startup_heap: bool = False, engine_core: EngineCoreClient | None = None) -> FastAPI:
    """The ASGI app; the model loads in the background after start-up (/health is 503 until warm).

    With no `loader` and `server.engine_process` on, the engine runs in its own process; a loader (tests
    inject faulty ones) loads it into this process instead. `freeze_startup_heap` (the server's own process sets
    it): this process's start-up heap is frozen once loading ends (server.gc_heap). `engine_core`: one already
    spawned (`neuronmm serve` starts it before importing the server), served instead of spawning another.
    """
    state = AppState(cfg, freeze_startup_heap)
    state.starting_engine = engine_core  # stopped by the lifespan if the app stops before serving from it

    async def load() -> None:
        try:
            if loader is None and cfg.server.engine_process:
                await asyncio.to_thread(state.start_engine_process, asyncio.get_running_loop(), engine_core)
            else:
                state.start(await asyncio.to_thread(loader or load_runtime, cfg))
            log.info("ready: serving %s on the %s backend", cfg.model.name, cfg.backend)
        except Exception as exc:  # keep the server up so /health can say why, unless the config is at fault
            state.load_error = f"{exc.__class__.__name__}: {exc}"
            if state.draining:  # the shutdown stopped the engine core while it loaded
                log.info("start-up stopped by the shutdown")
            else:
                log.error("model failed to load: %s", state.load_error)
                if isinstance(exc, ConfigError) and state.on_config_error is not None:
                    state.config_error = str(exc)
                    state.on_config_error()
        finally:
            state.settle_heap()  # (the engine-process path settles it earlier, while the core loads)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(load())
        yield
        state.draining = True
        task.cancel()
        engine = state.engine or state.starting_engine
        if engine:
            engine.stop()

    app = FastAPI(title="neuronmm", version=package_version(), lifespan=lifespan)
    app.state.neuronmm = state
    _install_middleware(app, state)
    _install_error_handlers(app)
    _install_routes(app)
    _install_openapi(app)
    return app


def serve(cfg: Config, engine_core: EngineCoreClient | None = None) -> int:
    """Run the app under uvicorn; SIGTERM drains in-flight requests (503 for new ones), then returns 0.
    `engine_core`: one already spawned for `cfg` (create_app)."""
    import uvicorn

    # Check the backend and resolve (convert) the model before binding the port, so a bad path or a
    # missing SDK is a one-line CLI error rather than a server that never gets healthy.
    check_backend_available(cfg)
    if engine_core is None:  # with a core, `neuronmm serve` resolved it before the spawn (each resolve hashes the GGUF)
        resolve_model_dir(cfg.model, cfg.cache_path)
    app = create_app(cfg, freeze_startup_heap=True, engine_core=engine_core)
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
                            access_log=cfg.server.access_log)
    state = app.state.neuronmm
    server = GracefulServer(config, state, cfg.server.shutdown_grace_s)
    # A mistake in the config that only the loaded model shows (a KV pool too small for one sequence, an adapter
    # that does not fit): the server ends and `neuronmm serve` exits 2 with it, as vLLM exits when its engine
    # cannot start, rather than staying up to answer 503.
    state.on_config_error = lambda: server.begin_drain("configuration error")
    server.run()
    if state.config_error is not None:
        raise ConfigError(state.config_error)
    return 0
