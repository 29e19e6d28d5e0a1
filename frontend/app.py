"""create_app: the aiohttp application of the API process.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET /openapi.json, and the live web page (``frontend.page``: GET /, /static/*,
/page/stream). Every error is OpenAI's ``{"error": {...}}`` body. The scheduler connection
lives in ``cleanup_ctx``, so it opens with the app and closes with it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web

from frontend.auth import TENANT, ApiKeys
from frontend.client import SchedulerClient
from frontend.config import FrontendConfig
from frontend.errors import ApiError
from frontend.handlers import GenerationHandler
from frontend.metrics import Metrics
from frontend.page import add_page
from frontend.page_feed import PageFeed
from frontend.request_parser import RequestParser
from frontend.schemas import ChatCompletionRequest, CompletionRequest
from models.files import resolve_model
from models.tokenizer import ChatTokenizer, load_tokenizer

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", FrontendConfig)
CLIENT = web.AppKey("client", SchedulerClient)
METRICS = web.AppKey("metrics", Metrics)
HANDLER = web.AppKey("handler", GenerationHandler)
MODEL_NAME = web.AppKey("model_name", str)
API_KEYS = web.AppKey("api_keys", ApiKeys)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    config: FrontendConfig,
    client: SchedulerClient | None = None,
    tokenizer: ChatTokenizer | None = None,
) -> web.Application:
    """Build the app. ``client`` and ``tokenizer`` may be given (tests share them)."""
    files = resolve_model(config.model)
    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model(config.tokenizer or config.model))
    model_name = config.served_model_name or files.model_id
    metrics = client.metrics if client is not None else Metrics()
    metrics.vllm.name(model_name)
    client = client or SchedulerClient(config, metrics)
    parser = RequestParser(config, tokenizer, model_name)
    handler = GenerationHandler(config, client, tokenizer, metrics, parser)

    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_error_middleware, _auth_middleware],
    )
    app[CONFIG] = config
    app[CLIENT] = client
    app[METRICS] = metrics
    app[HANDLER] = handler
    app[MODEL_NAME] = model_name
    app[API_KEYS] = ApiKeys(config.api_keys)
    frontend = {"index": config.api_server_index, "count": config.api_servers, "pid": os.getpid()}
    metrics.frontend.info({key: str(value) for key, value in frontend.items()})
    app.cleanup_ctx.append(_scheduler_connection)
    app.router.add_post("/v1/completions", handler.completions)
    app.router.add_post("/v1/chat/completions", handler.chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    add_page(app, PageFeed(config, client, metrics), app[API_KEYS])
    return app


async def _scheduler_connection(app: web.Application) -> AsyncIterator[None]:
    await app[CLIENT].start()
    yield
    await app[CLIENT].close()


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        if exc.status != 503:  # 503s are counted where they are raised
            request.app[METRICS].rejected.labels(str(exc.status)).inc()
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return ApiError(exc.status, exc.reason, headers=headers).response()


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith("/v1/"):
        keys = request.app[API_KEYS]
        request[TENANT] = keys.tenant(request.headers.get("Authorization", ""))
    return await handler(request)


async def _models(request: web.Request) -> web.Response:
    name = request.app[MODEL_NAME]
    client = request.app[CLIENT]
    info = client.info
    entry = {"id": name, "object": "model", "created": 0, "owned_by": "nanoserve"}
    if info is not None and info.max_model_len:
        entry["max_model_len"] = info.max_model_len
    return web.json_response({"object": "list", "data": [entry]})


async def _health(request: web.Request) -> web.Response:
    reason = health_problem(request.app)
    if reason is None:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable", "reason": reason}, status=503)


def health_problem(app: web.Application) -> str | None:
    """Why the server is unhealthy, or None: a worker must be ready and steps must advance."""
    if app[HANDLER].draining:
        return "the server is shutting down"
    client = app[CLIENT]
    reason = client.unavailable_reason()
    if reason is not None:
        return reason
    stalled_for = time.monotonic() - (client.last_progress or time.monotonic())
    if client.stats.num_running > 0 and stalled_for > app[CONFIG].stall_timeout:
        return f"no step has finished for {stalled_for:.1f} s while requests run"
    return None


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[API_KEYS].required))


def openapi_document(with_api_key: bool) -> dict:
    """An OpenAPI 3.1 description of the endpoints; request bodies come from the msgspec
    structs that decode them, so the two cannot drift apart."""
    (completion, chat), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest], ref_template="#/components/schemas/{name}"
    )
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"]}},
    }
    text = {"text/plain": {"schema": {"type": "string"}}}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "nanoserve", "version": "1"},
        "paths": {
            "/v1/completions": _generation(completion, "Text completion (OpenAI)"),
            "/v1/chat/completions": _generation(chat, "Chat completion (OpenAI)"),
            "/v1/models": {"get": {"responses": {"200": {"description": "served models"}}}},
            "/health": {
                "get": {
                    "responses": {
                        "200": {"description": "a worker is ready and steps advance"},
                        "503": {"description": "unavailable, with the reason"},
                    }
                }
            },
            "/metrics": {
                "get": {"responses": {"200": {"description": "Prometheus", "content": text}}}
            },
            "/openapi.json": {"get": {"responses": {"200": {"description": "this document"}}}},
        },
        "components": {"schemas": components},
    }
    if with_api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in document["paths"].items():
            if path.startswith("/v1/"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return document


_ERRORS = {
    400: "invalid body",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "body too large",
    503: "not ready, draining, or the scheduler or worker is gone: retry later",
}


def _generation(body: dict, summary: str) -> dict:
    """The path item of a generation endpoint: a JSON or streamed answer, or an error."""
    streamed = {"text/event-stream": {"schema": {"type": "string"}}}
    whole = {"application/json": {"schema": {"type": "object"}}}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    responses: dict = {"200": {"description": "the completion", "content": {**whole, **streamed}}}
    for code, described in _ERRORS.items():
        responses[str(code)] = {"description": described, "content": error}
    responses["503"]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": responses,
        }
    }
