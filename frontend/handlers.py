"""GenerationHandler: POST /v1/completions and /v1/chat/completions, streamed or whole."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import msgspec
from aiohttp import web

from frontend.auth import TENANT, cache_salt
from frontend.client import SchedulerClient
from frontend.config import FrontendConfig
from frontend.errors import ApiError
from frontend.generation import Generation, TokenLogprob
from frontend.metrics import Metrics
from frontend.request_parser import GenerationRequest, RequestParser
from frontend.responses import ResponseFormatter
from frontend.tool_calls import ToolCallParser, finish_reason
from models.tokenizer import ChatTokenizer

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class GenerationHandler:
    """Parses, admits and answers generation requests."""

    def __init__(
        self,
        config: FrontendConfig,
        client: SchedulerClient,
        tokenizer: ChatTokenizer,
        metrics: Metrics,
        parser: RequestParser,
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.parser = parser
        self.draining = False
        self._encoder = msgspec.json.Encoder()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._handle(request, chat=True)

    def unavailable(self, reason: str) -> ApiError:
        """503 with Retry-After, counted."""
        self.metrics.rejected.labels("503").inc()
        headers = {"Retry-After": str(self.config.retry_after_s)}
        return ApiError(503, reason, code="unavailable", headers=headers)

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._read_body(request)
        if self.draining:
            raise self.unavailable("the server is shutting down")
        geometry = self.client.geometry()
        if geometry is None:
            raise self.unavailable(self.client.unavailable_reason() or "not ready")
        parsed = self.parser.parse(body, chat=chat, geometry=geometry)
        await self.parser.check_grammar(parsed)
        salt = cache_salt(request.get(TENANT), parsed.cache_salt)
        parsed = dataclasses.replace(parsed, cache_salt=salt)
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        generation = Generation(parsed, request_id, self.client, self.tokenizer, self.metrics)
        formatter = ResponseFormatter(
            self.tokenizer, chat=chat, request_id=request_id, model=parsed.model
        )
        generation.start()
        try:
            if parsed.stream:
                return await self._stream(request, parsed, generation, formatter)
            return await self._whole(parsed, generation, formatter)
        finally:
            generation.close()  # aborts in the scheduler whatever is still running

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large") from None

    async def _whole(
        self, parsed: GenerationRequest, generation: Generation, formatter: ResponseFormatter
    ) -> web.Response:
        texts = [""] * parsed.n
        logprobs: list[list[TokenLogprob]] | None = None
        if parsed.logprobs is not None:
            logprobs = [[] for _ in range(parsed.n)]
        async for update in generation.updates():
            texts[update.index] += update.text
            if logprobs is not None:
                logprobs[update.index].extend(update.logprobs)
        reasons = [generation.finish_reason(i) for i in range(parsed.n)]
        usage = formatter.usage(
            generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens
        )
        calls = None
        if parsed.tools is not None:  # the texts become tool calls
            parsers = [ToolCallParser(parsed.tools.named) for _ in texts]
            for parser, text in zip(parsers, texts, strict=True):
                parser.feed(text)
            calls = [parser.calls() for parser in parsers]
            reasons = [finish_reason(r, p) for r, p in zip(reasons, parsers, strict=True)]
        body = formatter.response(texts, logprobs, reasons, usage, calls)
        return web.Response(body=self._encoder.encode(body), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        parsed: GenerationRequest,
        generation: Generation,
        formatter: ResponseFormatter,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        usage = parsed.include_usage
        tools = parsed.tools
        parsers = [ToolCallParser(tools.named) for _ in range(parsed.n)] if tools else None
        try:
            if parsed.chat:
                for index in range(parsed.n):
                    await self._send(response, formatter.role_chunk(index, usage, tools is None))
            async for update in generation.updates():
                if parsers is not None:
                    chunk = formatter.tool_chunk(update, parsers[update.index], usage)
                    if chunk is not None:
                        await self._send(response, chunk)
                elif update.text or update.finish_reason or update.logprobs:
                    await self._send(response, formatter.chunk(update, usage))
            if usage:
                tokens = (generation.prompt_tokens, generation.completion_tokens)
                chunk = formatter.usage_chunk(*tokens, generation.cached_tokens)
                await self._send(response, chunk)
        except ApiError as exc:
            # Headers are gone already: the error travels as an SSE event, then the stream ends.
            await self._send(response, exc.body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _send(self, response: web.StreamResponse, body: dict[str, Any]) -> None:
        await response.write(b"data: " + self._encoder.encode(body) + b"\n\n")
