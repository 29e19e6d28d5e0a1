"""A scripted OpenAI-compatible server for testing ``nanoserve bench serve``.

It streams ``max_tokens`` deterministic chunks with scripted delays, fails every n-th request
with HTTP 500 when asked, records every request body and arrival time, tracks the peak number
of requests in flight, and exposes a worker-busy counter in /metrics that grows by a fixed,
scripted amount per request (so the busy figure a test expects is exact).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass

from aiohttp import web

MODEL = "stub-model"


@dataclass(frozen=True)
class StubScript:
    """How the stub behaves. Delays are seconds."""

    first_delay: float = 0.02
    token_delay: float = 0.005
    fail_every: int = 0  # 0: never; n: every n-th request (1-based) answers 500
    busy_per_request: float = 0.01
    metrics: bool = True


class StubOpenAIServer:
    """The stub on 127.0.0.1 at a free port; ``async with`` starts and stops it."""

    def __init__(self, script: StubScript) -> None:
        self.script = script
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []  # perf_counter at each completion request
        self.in_flight = 0
        self.peak_in_flight = 0
        self.busy_seconds = 0.0
        self.grammar_tokens = 0  # tokens of requests with a response_format: 8 us fill, 2 apply
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> StubOpenAIServer:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        if self.script.metrics:
            app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP nanoserve:worker_busy_seconds_total Seconds the worker spent in steps.\n"
            "# TYPE nanoserve:worker_busy_seconds_total counter\n"
            f'nanoserve:worker_busy_seconds_total{{worker="0"}} {self.busy_seconds}\n'
            f'nanoserve:worker_busy_seconds_created{{worker="0"}} 1.7e9\n'
            f"nanoserve:scheduler_busy_seconds_total {self.busy_seconds / 100}\n"
            f"nanoserve:num_steps {round(self.busy_seconds * 1000)}\n"
            f"nanoserve:worker_resident_memory_bytes {2**20 * (100 + len(self.bodies))}\n"
            f"nanoserve:grammar_masked_tokens_total {self.grammar_tokens}\n"
            f"nanoserve:grammar_mask_fill_seconds_total {self.grammar_tokens * 8e-6}\n"
            f"nanoserve:grammar_mask_apply_seconds_total {self.grammar_tokens * 2e-6}\n"
            f"nanoserve:frontend_cpu_seconds_total {len(self.bodies) * 0.004}\n"
            f"nanoserve:scheduler_cpu_seconds_total {len(self.bodies) * 0.002}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.perf_counter())
        if self.script.fail_every and len(self.bodies) % self.script.fail_every == 0:
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._stream(request, body)
        finally:
            self.in_flight -= 1
            self.busy_seconds += self.script.busy_per_request
            if "response_format" in body:
                self.grammar_tokens += body["max_tokens"]

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # real servers open a chat stream with a role-only delta: not a token
            await _send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await resp.write(b": keep-alive\n\n")
        await asyncio.sleep(self.script.first_delay)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(self.script.token_delay)
            text = f" t{i}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
            await _send(resp, {"choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await _send(resp, {"choices": [], "usage": _usage(body)})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _usage(body: dict) -> dict:
    """Prompt tokens are words (or ids); a chat request reports every message before its last
    as cached, as a server with a prefix cache would."""
    if "messages" not in body:
        prompt = body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        return {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"]}
    words = [len(m["content"].split()) for m in body["messages"]]
    return {
        "prompt_tokens": sum(words),
        "completion_tokens": body["max_tokens"],
        "prompt_tokens_details": {"cached_tokens": sum(words[:-1])},
    }


async def _send(resp: web.StreamResponse, event: dict) -> None:
    await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
