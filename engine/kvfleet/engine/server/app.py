"""The FastAPI application: routes, the gate (readiness, draining, API keys), lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfleet.engine.async_llm import AsyncLLM
from kvfleet.engine.env_settings import EnvSettingError
from kvfleet.engine.server import protocol as P
from kvfleet.engine.server.auth import DEFAULT_TENANT, bearer_token
from kvfleet.engine.server.bodies import BoundedJSONRoute
from kvfleet.engine.server.chat import chat_prompt_ids, create_chat_completion
from kvfleet.engine.server.completions import create_completion
from kvfleet.engine.server.errors import APIError, error_body, install_error_handlers
from kvfleet.engine.server.generation import shutdown_error
from kvfleet.engine.server.metrics import CONTENT_TYPE
from kvfleet.engine.server.protocol_responses import ResponsesRequest
from kvfleet.engine.server.reasoning import reasoning_parser
from kvfleet.engine.server.responses_api import create_response
from kvfleet.engine.server.serving import check_model
from kvfleet.engine.server.state import ServerState, TemplateCall
from kvfleet.engine.server.textbound import tokenizer_chars_per_token

logger = logging.getLogger("kvfleet.server")

VERSION = "0.1.0"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
TENANT_KEY = "kvfleet.tenant"
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": P.ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


class Gate:
    """ASGI middleware (not BaseHTTPMiddleware, which breaks disconnect detection on streams):
    engine routes need a loaded model, a valid key, and a server that is not draining."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        st = self.state
        tenant = DEFAULT_TENANT
        headers = dict(scope.get("headers") or [])
        if st.keys is not None:
            raw = headers.get(b"authorization")
            found = st.keys.tenant_for(bearer_token(raw.decode("latin-1") if raw else None))
            if found is None:
                await self._reject(scope, receive, send, 401, "Missing or invalid API key "
                                   "(send `Authorization: Bearer <key>`).", "invalid_api_key",
                                   {"WWW-Authenticate": "Bearer"})
                return
            tenant = found
        if st.draining:
            st.metrics.observe_rejected(tenant, "draining")
            await self._reject(scope, receive, send, 503, "The server is shutting down; retry on another replica.",
                               "draining", {"Retry-After": "1", "Connection": "close"})
            return
        if not st.ready:
            await self._reject(scope, receive, send, 503, "The model is still loading; retry shortly.",
                               "loading", {"Retry-After": "5"})
            return
        scope[TENANT_KEY] = tenant
        limit = st.max_request_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, 413, f"Request body of {int(declared)} bytes is over this "
                               f"server's limit of {limit} bytes (--max-request-bytes).", "request_too_large",
                               {"Connection": "close"})
            return
        await self._run_until_shutdown(scope, _limited(receive, limit), send)

    async def _run_until_shutdown(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the route; if uvicorn cancels it at shutdown (still reading its body, tokenizing, ...:
        what the cut-off of engine requests does not reach) before any answer, answer 503 instead of
        letting uvicorn log a traceback and send a plain-text 500."""
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not self.state.draining or started:
                raise
            err = shutdown_error()
            await self._reject(scope, receive, send, err.status, err.message, err.code or "", err.headers)

    @staticmethod
    async def _reject(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str,
                      headers: dict[str, str]) -> None:
        await JSONResponse(error_body(status, message, code=code), status_code=status,
                           headers=headers)(scope, receive, send)


class MetricsPort:
    """ASGI middleware for `--metrics-port`: /metrics is answered on that port only, and nothing else is
    (the request metrics name tenants; the API port need not show them)."""

    def __init__(self, app: ASGIApp, port: int) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            server = scope.get("server")
            on_metrics_port = server is not None and server[1] == self.port
            if on_metrics_port != (scope["path"] == "/metrics"):
                await JSONResponse(error_body(404, "Not found: no such route", code="not_found"),
                                   status_code=404)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that counts body bytes: a body without Content-Length (chunked) that grows past the
    limit ends in a 413 (raised where the route reads it) instead of filling memory."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                # an HTTPException passes FastAPI's body parsing as is (other errors become a 400)
                raise StarletteHTTPException(413, f"Request body is over this server's limit of {limit} bytes "
                                             "(--max-request-bytes).")
        return message

    return wrapped


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE


def _tenant(request: Request) -> str:
    return str(request.scope.get(TENANT_KEY, DEFAULT_TENANT))


def build_app(state: ServerState, load_engine: Callable[[], AsyncLLM] | None = None) -> FastAPI:
    """`load_engine` (blocking) builds the AsyncLLM; it runs in a thread after the server starts
    listening, so /health answers 503 while the model loads."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_load(state, load_engine)) if load_engine is not None else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            if state.engine is not None:
                await state.engine.shutdown()
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    extra: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        # FastAPI's built-in OpenTelemetry: off, so nothing is ever exported whatever the environment
        # says (the server talks only to its clients); our metrics are the Prometheus ones.
        extra["telemetry"] = {"auto_configure": False, "tracing": False, "metrics": False, "logs": False,
                              "operation_spans": False}
    app = FastAPI(title="kvfleet", version=VERSION, lifespan=lifespan,
                  description="OpenAI-compatible API of a kvfleet engine.", **extra)
    app.router.route_class = BoundedJSONRoute  # every route below measures its body's nesting first
    install_error_handlers(app)
    app.add_middleware(Gate, state=state)
    if state.metrics_port is not None:
        app.add_middleware(MetricsPort, port=state.metrics_port)

    @app.get("/health", responses={503: {"model": P.ErrorResponse}})
    async def health() -> Response:
        if state.ready and not state.draining:
            return JSONResponse({"status": "ok"})
        status = "draining" if state.draining else ("failed" if state.load_error else "loading")
        return JSONResponse(error_body(503, f"not ready: {status}", code=status), status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics", response_class=PrometheusResponse,
             responses={200: {"description": "Prometheus text exposition format 0.0.4.",
                              "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
             description="Prometheus metrics; on `--metrics-port` instead when the server has one.")
    async def metrics() -> Response:
        return PrometheusResponse(state.metrics.render())

    @app.get("/v1/models", response_model=P.ModelList, responses=ERRORS)
    async def models() -> dict[str, Any]:
        # `root` names the model as clients know it (as vLLM's does), never a path on this machine.
        card = P.ModelCard(id=state.model_name, root=state.model_name, max_model_len=state.max_model_len)
        return P.dump(P.ModelList(data=[card]))

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERRORS)
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        return await create_completion(state, req, request, _tenant(request))

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, req, request, _tenant(request))

    @app.post("/v1/responses", responses=ERRORS)
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        return await create_response(state, req, request, _tenant(request))

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERRORS)
    async def tokenize(req: P.TokenizeRequest) -> dict[str, Any]:
        check_model(state, req.model)
        if req.messages is not None:
            ids = await chat_prompt_ids(state, req.messages, TemplateCall(
                req.add_generation_prompt, req.continue_final_message, kwargs=req.chat_template_kwargs))
        else:
            ids = await state.encode_async(req.prompt or "", "prompt", add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERRORS)
    async def detokenize(req: P.DetokenizeRequest) -> dict[str, Any]:
        check_model(state, req.model)
        if len(req.tokens) < DECODE_INLINE_TOKENS:
            return {"prompt": _detokenize(state, req.tokens)}
        return {"prompt": await state.off_loop(_detokenize, state, req.tokens)}

    return app


DECODE_INLINE_TOKENS = 4096   # longer lists are checked and decoded on the tokenizer threads


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    bad = next((t for t in tokens if t >= state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                       "tokens", "invalid_value")
    if state.tokenizer is None:
        raise APIError(400, "tokens: this model has no tokenizer", "tokens", "no_tokenizer")
    return state.decode(tokens)


async def _load(state: ServerState, load_engine: Callable[[], AsyncLLM]) -> None:
    try:
        engine = state.engine = await asyncio.to_thread(load_engine)
        if engine.tokenizer is not None:
            state.chars_per_token = tokenizer_chars_per_token(engine.tokenizer)
        if state.reasoning_parser is not None:
            state.reasoning = reasoning_parser(state.reasoning_parser, engine.tokenizer)
        await _warm_up(engine)
        # After the warm-up, not beside it: building the table holds the GIL (~0.3-1 s) and the first
        # constrained request would otherwise wait that long for its first token.
        await asyncio.to_thread(engine.prepare_structured_outputs)
    except EnvSettingError as exc:   # the operator's setting, not our bug: its one line says what to change
        state.load_error = str(exc)
        logger.error("model load failed: %s", exc)
        return
    except Exception as exc:
        state.load_error = f"{exc.__class__.__name__}: {exc}"
        logger.exception("model load failed")
        return
    state.ready = True
    logger.info("model ready", extra={"model": state.model_name, "max_model_len": state.max_model_len,
                                      "max_prompt_chars": state.max_prompt_chars})


async def _warm_up(engine: AsyncLLM) -> None:
    """/health is 200 only once the engine has run every step shape and sampler path it will meet
    (kvfleet.engine.warmup: nothing is compiled or loaded on a request's time), or where that plan buys nothing
    (a CPU; `warmup_runs_plan`) or KVFLEET_WARMUP=0 says so, one real one-token step."""
    from kvfleet.engine.warmup import ONE_STEP_PLAN, TRITON_COMPILES, warmup_runs_plan

    await engine.warm_up(None if warmup_runs_plan(engine.device_type) else ONE_STEP_PLAN)
    TRITON_COMPILES.serving()
