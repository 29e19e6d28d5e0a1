"""Fault injection with real processes: one shared server whose scheduler and worker run under
``nanoserve supervise`` (audit on), plus helpers that stream over HTTP and record timings.

Every test leaves the shared server healthy, with nothing running and every block back.
Timings measured here are written to <log_dir>/timings.json and printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from tests.servers import Server, server_fixture

MODEL = "SmolLM2-135M-Instruct"
TIMINGS: dict[str, float] = {}


def _report_timings(server: Server) -> None:
    """Print the timings the session's tests recorded and keep them beside its logs."""
    print("\nfault timings (s):", json.dumps(TIMINGS, indent=1))
    (server.log_dir / "timings.json").write_text(json.dumps(TIMINGS, indent=1))


# The default model behind three real processes; scheduler and worker supervised. Shared by
# every module here (session scope): each test leaves it healthy and its pool empty.
server = server_fixture(
    scope="session",
    after_stop=_report_timings,
    supervised=("scheduler", "worker"),
    audit=1,
    num_slots=64,
    threads=1,  # other test processes share the cores: one thread never oversubscribes
)

# A real scheduler process and nothing else: tests talk to its two ROUTERs through raw DEALER
# sockets at ``default_addresses(lone_scheduler.run_id)``.
lone_scheduler = server_fixture(scope="function", roles=("scheduler",))


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


def start_streams(
    session: aiohttp.ClientSession, server: Server, bodies: list[dict]
) -> tuple[list[Stream], list[asyncio.Task]]:
    """One streamed completion a body, started now; each Stream fills as its events arrive."""
    streams = [Stream() for _ in bodies]
    tasks = [
        asyncio.create_task(stream_completion(session, server, body, stream))
        for body, stream in zip(bodies, streams, strict=True)
    ]
    return streams, tasks


async def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Wait (bounded) for a predicate over in-process state, yielding to the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.005)
