"""Fault injection with real processes: one shared server whose scheduler and worker run under
``nanoserve supervise`` (audit on), plus helpers that stream over HTTP and record timings.

Every test leaves the shared server healthy, with nothing running and every block back.
Timings measured here are written to <log_dir>/timings.json and printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import pytest

from tests.servers import Server, start_server

MODEL = "SmolLM2-135M-Instruct"
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The default model behind three real processes; scheduler and worker supervised."""
    running = start_server(
        tmp_path_factory.mktemp("faults"),
        supervised=("scheduler", "worker"),
        audit=1,
        num_slots=64,
        threads=1,  # other test processes share the cores: one thread never oversubscribes
    )
    try:
        yield running
    finally:
        running.stop()
        print("\nfault timings (s):", json.dumps(TIMINGS, indent=1))
        (running.log_dir / "timings.json").write_text(json.dumps(TIMINGS, indent=1))


@pytest.fixture
def lone_scheduler(tmp_path):
    """A real scheduler process and nothing else: tests talk to its two ROUTERs through raw
    DEALER sockets at ``default_addresses(lone_scheduler.run_id)``."""
    run_id = f"s{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "NANOSERVE_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"}
    running = Server(port=0, run_id=run_id, log_dir=tmp_path, env=env)
    running.start("scheduler")
    try:
        yield running
    finally:
        running.stop()


def record(name: str, seconds: float) -> None:
    """Keep one measured duration for the report."""
    TIMINGS[name] = round(seconds, 3)


async def wait_metrics(server: Server, predicate, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics (bounded) until ``predicate`` holds, without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            metrics = await asyncio.to_thread(server.metrics)
            if predicate(metrics):
                return metrics
        except OSError:
            pass  # the frontend may be restarting
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics condition not met in {timeout}s\n{server.logs()}")
        await asyncio.sleep(0.05)


async def assert_pool_empty(server: Server) -> dict[str, float]:
    """Every block and slot back, nothing running or waiting, and every process alive."""
    metrics = await wait_metrics(
        server,
        lambda m: (
            m["nanoserve:kv_cache_blocks_used"] == 0
            and m["nanoserve:num_requests_running"] == 0
            and m["nanoserve:num_requests_waiting"] == 0
        ),
    )
    server.check_alive()  # --audit: a broken invariant would have ended the scheduler
    return metrics


@dataclass
class Stream:
    """One streamed completion: its text, its events' arrival times, and how it ended."""

    text: str = ""
    times: list[float] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    status: int = 0
    done: bool = False
    finish_reason: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details, when asked for


async def stream_completion(
    session: aiohttp.ClientSession, server: Server, body: dict, into: Stream
) -> Stream:
    """POST a streamed completion and fill ``into`` as events arrive."""
    async with session.post(
        server.url + "/v1/completions", json={"model": MODEL, "stream": True, **body}
    ) as response:
        into.status = response.status
        if response.status != 200:
            into.errors.append(await response.json())
            return into
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                into.done = True
                break
            event = json.loads(line[len(b"data: ") :])
            if "error" in event:
                into.errors.append(event)
                continue
            choice = event["choices"][0]
            into.text += choice["text"]
            into.finish_reason = choice.get("finish_reason") or into.finish_reason
            into.times.append(time.monotonic())
    return into


async def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Wait (bounded) for a predicate over in-process state, yielding to the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.005)
