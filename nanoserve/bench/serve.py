"""Load generator for any OpenAI-compatible server: the engine of ``nanoserve bench serve``.

It builds a seeded workload (random token ids, random words, or the shipped prompt set), sends
it as streaming requests at a fixed concurrency or with Poisson arrivals, times every streamed
chunk, and summarizes throughput, latency percentiles and goodput. Torch-free: it speaks HTTP
with aiohttp only, so it measures llama.cpp's or vLLM's server as well as ours.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from nanoserve.bench.chat import Conversation, MultiTurn, build_conversations
from nanoserve.bench.data import (
    FIRST_PLAIN_TOKEN,
    BenchRequest,
    arrival_offsets,
    build_workload,
)
from nanoserve.bench.metrics import (
    RequestResult,
    acceptance,
    busy_delta,
    busy_ratio,
    cpu_us_per_token,
    mib,
    scheduler_ms_per_step,
    summarize,
    us_per_grammar_token,
)
from nanoserve.bench.scrape import Scrape, per_frontend, scrape_frontends
from nanoserve.cli import UserError

SLO_KEYS = ("ttft", "tpot", "e2el")
Clock = Callable[[], float]


@dataclass(frozen=True)
class BenchServeConfig:
    """What to send, how fast, and to which server. Lengths are tokens (words for text)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint_type: str = "completions"  # or "chat"
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    dataset: str = "random"  # or "shipped", "repetitive", "multi-turn" (chat conversations)
    prompt_format: str = "ids"  # or "text"
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    vocab_size: int = 32000
    seed: int = 0
    max_concurrency: int | None = None  # None: no cap
    request_rate: float = math.inf  # requests/s; inf sends all at once
    num_warmups: int = 1
    goodput: dict[str, float] = field(default_factory=dict)  # SLO name -> milliseconds
    temperature: float = 0.0
    extra_body: dict[str, object] = field(default_factory=dict)  # merged into every request
    stream_usage: bool = True
    request_timeout: float = 600.0
    ready_timeout: float = 0.0
    random_prefix_len: int = 0  # random dataset: one seeded prefix shared by every prompt
    num_conversations: int = 8  # multi-turn: conversations at once
    turns: int = 6  # multi-turn: user messages per conversation
    system_len: int = 950  # multi-turn: words of the shared system prompt (~1,000 tokens)

    def __post_init__(self) -> None:
        _choice("endpoint type", self.endpoint_type, ("completions", "chat"))
        _choice("dataset", self.dataset, ("random", "shipped", "multi-turn", "repetitive"))
        if self.dataset == "multi-turn" and self.endpoint_type != "chat":
            raise ValueError("the multi-turn dataset needs --endpoint-type chat")
        for name in ("num_conversations", "turns", "system_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.random_prefix_len < 0:
            raise ValueError("random-prefix-len must be >= 0")
        _choice("prompt format", self.prompt_format, ("ids", "text"))
        if self.endpoint_type == "chat" and self.prompt_format == "ids":
            raise ValueError("the chat endpoint takes text: use --prompt-format text")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.vocab_size <= FIRST_PLAIN_TOKEN:
            raise ValueError(f"vocab-size must be > {FIRST_PLAIN_TOKEN}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max-concurrency must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request-rate must be > 0 (inf: all at once)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.num_warmups < 0 or self.request_timeout <= 0 or self.ready_timeout < 0:
            raise ValueError("num-warmups and ready-timeout must be >= 0, request-timeout > 0")
        for key, value in self.goodput.items():
            if key not in SLO_KEYS or not value > 0:
                raise ValueError(f"goodput SLO {key}:{value}: want {'|'.join(SLO_KEYS)}:MS > 0")

    @property
    def root_url(self) -> str:
        """The server root: base URL without a trailing slash or ``/v1``."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def endpoint_url(self) -> str:
        """The URL every benchmark request is posted to."""
        return f"{self.root_url}/v1/{'chat/completions' if self.is_chat else 'completions'}"

    @property
    def workload_args(self) -> dict[str, object]:
        """The keyword arguments of ``build_workload`` this config implies."""
        names = ("dataset", "prompt_format", "num_prompts", "input_len", "output_len")
        names += ("range_ratio", "vocab_size", "seed", "random_prefix_len")
        return {name: getattr(self, name) for name in names}

    @property
    def is_chat(self) -> bool:
        """True when requests go to /v1/chat/completions."""
        return self.endpoint_type == "chat"


def _choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")


class StreamError(Exception):
    """The server sent an error event inside a 200 stream."""


def request_payload(config: BenchServeConfig, model: str, req: BenchRequest) -> dict:
    """The JSON body of one streaming request: greedy, exactly ``output_len`` tokens."""
    body: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": config.temperature,
        "stream": True,
    }
    if config.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if config.is_chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
    return body | config.extra_body


async def read_stream(
    lines: AsyncIterable[bytes], result: RequestResult, start: float, clock: Clock, chat: bool
) -> None:
    """Fill ``result`` from an SSE stream: the clock is read once per chunk that carries text
    and once at the end. Output tokens come from the usage chunk when there is one."""
    last, chunks, usage, parts = start, 0, None, []
    async for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, ": keep-alive" comments, event: lines
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if not isinstance(event, dict):
            raise StreamError(f"not a JSON object: {data[:80]!r}")
        if "error" in event:
            raise StreamError(str(event["error"])[:200])
        usage = event.get("usage") or usage
        text = _chunk_text(event, chat)
        if not text:
            continue
        parts.append(text)
        now = clock()
        if result.ttft is None:
            result.ttft = now - start
        else:
            result.itl.append(now - last)
        last, chunks = now, chunks + 1
    result.latency = clock() - start
    result.text = "".join(parts)
    result.output_len = int(usage.get("completion_tokens") or chunks) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])


def _chunk_text(event: dict, chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""


async def send_request(
    session: aiohttp.ClientSession, config: BenchServeConfig, body: dict, prompt_len: int
) -> RequestResult:
    """Post one streaming request and time it; any failure is recorded, never raised."""
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    try:
        async with session.post(config.endpoint_url, json=body) as resp:
            if resp.status != 200:
                text = " ".join((await resp.text()).split())
                result.error = f"HTTP {resp.status}: {text[:200]}"
                return result
            await read_stream(resp.content, result, start, time.perf_counter, config.is_chat)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, StreamError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:240]
    return result


async def run_load(
    session: aiohttp.ClientSession,
    config: BenchServeConfig,
    model: str,
    requests: list[BenchRequest],
    offsets: list[float],
) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival offset, at most ``max_concurrency`` in flight.
    Returns the results in workload order and the wall time from first send to last reply."""
    gate = asyncio.Semaphore(config.max_concurrency or len(requests))
    start = time.perf_counter()

    async def one(req: BenchRequest, offset: float) -> RequestResult:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            return await send_request(
                session, config, request_payload(config, model, req), req.prompt_len
            )

    results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    return list(results), time.perf_counter() - start


class LoadWatch(Protocol):
    """Something that measures the server's machine during the timed load only (the GPU
    check's utilization sampler): ``start`` as the load begins, ``stop`` as it ends."""

    def start(self) -> object: ...

    def stop(self) -> object: ...


class BenchServe:
    """One benchmark run against one server: warm up, scrape /metrics, load, scrape, report."""

    def __init__(self, config: BenchServeConfig, watch: LoadWatch | None = None) -> None:
        self.config = config
        self.watch = watch

    async def run(self) -> dict[str, object]:
        """Run the benchmark; returns the JSON-ready report (run info plus ``summarize``)."""
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        async with aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout),
            # limit=0: the semaphore, not the pool, caps load. force_close: a connection per
            # request, so no request lands on a kept-alive socket the server has just closed
            # (llama-server does; those POSTs failed with "Server disconnected").
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            read_bufsize=2**20,  # SSE lines are read whole; leave room for logprobs
        ) as session:
            model = await self._model(session)
            await self._warmup(session, model)
            before, scraped_at = await self._scrape(session), time.perf_counter()
            if self.watch is not None:
                self.watch.start()
            try:
                summary = await self._load(session, model)
            finally:
                if self.watch is not None:
                    self.watch.stop()
            after = await self._scrape(session)
            scrape_wall = time.perf_counter() - scraped_at
        busy_before, busy_after = before.get("worker_busy"), after.get("worker_busy")
        steps = busy_delta(before.get("num_steps"), after.get("num_steps"))
        tokens = summary["total_output_tokens"]
        return {
            **self._run_info(model),
            **summary,
            "worker_busy_metric": busy_after[0] if busy_after else None,
            "worker_busy_seconds": busy_delta(busy_before, busy_after),
            "worker_busy_ratio": busy_ratio(busy_before, busy_after, scrape_wall),
            "scheduler_steps": None if steps is None else int(steps),
            "scheduler_ms_per_step": scheduler_ms_per_step(before, after),
            "worker_rss_mib_start": mib(before.get("worker_resident_memory")),
            "worker_rss_mib_end": mib(after.get("worker_resident_memory")),
            "grammar_fill_us_per_token": us_per_grammar_token(before, after, "grammar_mask_fill"),
            "grammar_apply_us_per_token": us_per_grammar_token(before, after, "grammar_mask_apply"),
            "frontend_cpu_us_per_token": cpu_us_per_token(before, after, "frontend_cpu", tokens),
            "scheduler_cpu_us_per_token": cpu_us_per_token(before, after, "scheduler_cpu", tokens),
            **acceptance(before, after),
            "frontends": after.count if after.frontends else None,
            "per_frontend": per_frontend(before, after),
        }

    async def _load(self, session: aiohttp.ClientSession, model: str) -> dict[str, object]:
        """The timed load: the request workload, or the multi-turn conversations."""
        cfg = self.config
        if cfg.dataset == "multi-turn":
            return await MultiTurn(cfg, self._conversations(cfg.seed)).run(session, model)
        requests = build_workload(**cfg.workload_args)
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
        results, duration = await run_load(session, cfg, model, requests, offsets)
        return summarize(results, duration, cfg.goodput)

    def _conversations(self, seed: int) -> list[Conversation]:
        cfg = self.config
        return build_conversations(
            cfg.num_conversations, cfg.turns, cfg.system_len, cfg.input_len, seed
        )

    def _run_info(self, model: str) -> dict[str, object]:
        cfg = self.config
        return {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "base_url": cfg.root_url,
            "endpoint": cfg.endpoint_url,
            "model": model,
            "dataset": cfg.dataset,
            "prompt_format": cfg.prompt_format,
            "num_prompts": cfg.num_prompts,
            "input_len": cfg.input_len,
            "output_len": cfg.output_len,
            "range_ratio": cfg.range_ratio,
            "seed": cfg.seed,
            "random_prefix_len": cfg.random_prefix_len,
            "max_concurrency": cfg.max_concurrency,
            "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate,
            "temperature": cfg.temperature,
            "extra_body": dict(cfg.extra_body),
            "goodput_slos_ms": dict(cfg.goodput),
        }

    async def _model(self, session: aiohttp.ClientSession) -> str:
        """The configured model, or the first one /v1/models lists (polled until ready)."""
        cfg, url = self.config, f"{self.config.root_url}/v1/models"
        if cfg.model and cfg.ready_timeout == 0:
            return cfg.model
        deadline = time.monotonic() + cfg.ready_timeout
        while True:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    if resp.status == 200:
                        listed = (await resp.json(content_type=None)).get("data") or []
                        if cfg.model or listed:
                            return cfg.model or str(listed[0]["id"])
                        raise UserError(f"{url} lists no models; pass --model")
                    problem = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise UserError(f"no model list from {url} ({problem}); is the server up?")
            await asyncio.sleep(0.25)

    async def _warmup(self, session: aiohttp.ClientSession, model: str) -> None:
        """Send untimed requests first; stop with the server's answer if every one fails."""
        count = self.config.num_warmups
        if count == 0:
            return
        if self.config.dataset == "multi-turn":  # another system prompt: nothing cached ahead
            warm = self._conversations(self.config.seed + 2**32)[:1]
            results = await MultiTurn(self.config, warm).run(session, model)
            if not results["completed"]:
                raise UserError("warmup conversation failed")
            return
        # Prompts of their own, so no timed prompt finds its prefix already cached.
        args = self.config.workload_args | {"num_prompts": count, "seed": self.config.seed + 2**32}
        warm = build_workload(**args)
        results, _ = await run_load(session, self.config, model, warm, [0.0] * count)
        if not any(r.success for r in results):
            raise UserError(f"warmup request failed: {results[0].error}")

    async def _scrape(self, session: aiohttp.ClientSession) -> Scrape:
        """The ``SCRAPED`` metrics /metrics has, every frontend's own summed (nothing when the
        server has no /metrics)."""
        return await scrape_frontends(session, f"{self.config.root_url}/metrics")
