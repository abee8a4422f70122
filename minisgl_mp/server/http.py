"""The HTTP API: FastAPI on uvicorn, inside the tokenizer process's event loop.

    POST /v1/completions, /v1/chat/completions   OpenAI-compatible (openai_protocol, openai_serving)
    GET  /v1/models, /v1/models/{id}
    POST /generate                               SGLang's native shape (native_api)
    /get_model_info, /get_server_info, /get_load, /version, /abort_request, /tokenize, /detokenize
                                                 SGLang's and vLLM's helpers (sglang_routes)
    GET  /health                                 200 while the scheduler answers between its steps
    GET  /health_generate                        200 once a one-token generation goes through
    GET  /metrics                                Prometheus text
    POST /flush_cache, GET /engine_stats         admin: the scheduler's prefix cache and stats

Bodies are parsed by hand rather than by pydantic models, so every rejection is a 400 in
OpenAI's error shape whose message names the field and its allowed range. With --api-key every
endpoint but /health and /health_generate needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.server.http_io import (HttpError, SSEResponse, check_api_key, error_response, read_json,
                                       until_disconnect)
from minisgl_mp.server.metrics import Metrics
from minisgl_mp.server.native_api import generate_once, generate_stream, parse_native
from minisgl_mp.server.sglang_routes import add_sglang_routes
from minisgl_mp.server.openai_protocol import OpenAIRequest, parse_chat, parse_completion
from minisgl_mp.server.openai_serving import TokenTexts, complete, stream
from minisgl_mp.server_config import ServerConfig
from minisgl_mp.tokenizer.manager import SHUTDOWN_RETRY_AFTER_S, TokenizerManager
from minisgl_mp.tokenizer.requests import GenerateRequest, RequestError

logger = logging.getLogger("minisgl_mp.server.http")

# /metrics refreshes its gauges from the scheduler; a slow answer leaves the previous values.
METRICS_STATS_TIMEOUT_S = 2.0
# The endpoints whose refusals count in the metrics; /health, /metrics, /get_load ... are probes.
REQUEST_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})
# Status for a response nobody will read: the client disconnected first (nginx's convention).
CLIENT_CLOSED = 499


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM belongs to the tokenizer process (its stop
    flag), which stops the server by setting `should_exit`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def create_http_server(config: ServerConfig, manager: TokenizerManager) -> uvicorn.Server:
    server = config.server
    uv_config = uvicorn.Config(
        build_app(config, manager), host=server.host, port=server.port,
        loop="none",  # run in the caller's (uvloop) event loop
        lifespan="off", log_config=None,  # keep the process's own logging setup
        log_level=server.log_level, access_log=server.log_level == "debug",
        timeout_graceful_shutdown=5)
    return _Server(uv_config)


def _install_error_handlers(app: FastAPI, metrics: Metrics | None) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_request: Request, exc: RequestError) -> Response:
        if metrics is not None and _request.url.path in REQUEST_PATHS:  # probes are not requests
            metrics.refused(exc.kind)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return error_response(HttpError(f"invalid request: {exc.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in the HTTP API")
        return error_response(HttpError(f"internal server error: {type(exc).__name__}", kind="internal"))


def build_app(config: ServerConfig, manager: TokenizerManager) -> FastAPI:
    server, model = config.server, config.model
    app = FastAPI(title="minisgl_mp", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app, manager.metrics)
    texts = TokenTexts(manager.tokenizer)
    started = int(time.time())

    async def authorized(request: Request) -> None:
        check_api_key(request, server.api_key)

    api = APIRouter(dependencies=[Depends(authorized)])

    async def serve_openai(request: Request, req: OpenAIRequest) -> Response:
        if req.stream:
            return SSEResponse(stream(req, manager, texts))
        result = await until_disconnect(request, complete(req, manager, texts))
        return JSONResponse(result) if result is not None else Response(status_code=CLIENT_CLOSED)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, server.max_payload_bytes)
        return await serve_openai(request, await parse_completion(body, manager))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, server.max_payload_bytes)
        return await serve_openai(request, await parse_chat(body, manager))

    def model_card() -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": started, "owned_by": "minisgl_mp",
                "root": model.name, "max_model_len": model.context_len}

    @api.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if model_id != model.name:
            raise HttpError(f"the model {model_id!r} does not exist; this server serves {model.name!r}",
                            kind="not_found", param="model", code="model_not_found")
        return JSONResponse(model_card())

    @api.post("/generate")
    async def generate(request: Request) -> Response:
        req = await parse_native(await read_json(request, server.max_payload_bytes), manager)
        if req.stream:
            return SSEResponse(generate_stream(req, manager))
        result = await until_disconnect(request, generate_once(req, manager))
        return JSONResponse(result) if result is not None else Response(status_code=CLIENT_CLOSED)

    add_sglang_routes(api, config, manager)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the scheduler answers between two of its steps (a hung step, or a dead
        process, does not). No generation and not a request in the metrics."""
        if manager.stopping:
            raise HttpError("the server is shutting down", kind="unavailable", retry_after=SHUTDOWN_RETRY_AFTER_S)
        try:
            await manager.admin("ping", timeout=server.health_timeout)
        except RequestError as e:
            raise HttpError(f"the scheduler did not answer: {e.message}", kind="unavailable") from None
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Readiness, end to end: a one-token generation through all three processes."""
        if manager.stopping:
            raise HttpError("the server is shutting down", kind="unavailable", retry_after=SHUTDOWN_RETRY_AFTER_S)
        probe = GenerateRequest(rid=None, params=SamplingParams(max_tokens=1, temperature=0.0), input_ids=[0])

        async def one_token() -> None:
            async with contextlib.aclosing(manager.generate(probe, probe=True)) as outs:
                async for _ in outs:
                    pass

        try:
            await asyncio.wait_for(one_token(), server.health_timeout)
        except asyncio.TimeoutError:
            raise HttpError(f"no token was generated within {server.health_timeout:g}s "
                            "(--health-timeout): starting, stuck or overloaded", kind="unavailable") from None
        except RequestError as e:
            raise HttpError(f"the health probe failed: {e.message}", kind="unavailable") from None
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def metrics() -> Response:
        if manager.metrics is None:
            raise HttpError("metrics are not enabled", kind="not_found")
        try:
            reply = await manager.admin("stats", timeout=METRICS_STATS_TIMEOUT_S)
            if reply.ok:
                manager.metrics.update_from_stats(reply.result, time.monotonic())
        except RequestError as e:
            logger.warning("/metrics: gauges not refreshed: %s", e.message)
        return Response(manager.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @api.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang takes both
    async def flush_cache() -> Response:
        reply = await manager.admin("flush_cache")
        if not reply.ok:
            raise HttpError(str(reply.result.get("error") or "the prefix cache could not be flushed"))
        return JSONResponse({"ok": True, **reply.result})

    @api.get("/engine_stats")
    async def engine_stats() -> Response:
        reply = await manager.admin("stats")
        return JSONResponse(reply.result)

    app.include_router(api)
    return app
