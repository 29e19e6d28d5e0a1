"""The scheduler or a frontend SIGKILLed, and SIGTERM to a frontend: in-flight requests fail fast
(or drain), new ones get 503 with Retry-After, the pool comes back empty, and everything serves
again without restarting anything else."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.faults.conftest import (
    MODEL,
    Stream,
    assert_pool_empty,
    record,
    start_streams,
    stream_completion,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG = {"prompt": "List every prime number.", "max_tokens": 1000, "ignore_eos": True}


async def _post(session: aiohttp.ClientSession, server, body: dict) -> aiohttp.ClientResponse:
    async with session.post(
        server.url + "/v1/completions", json={"model": MODEL, **body}
    ) as response:
        await response.read()
        return response


async def test_sigkilled_scheduler_fails_fast_then_recovers(server):
    async with aiohttp.ClientSession() as session:
        stream = Stream()
        task = asyncio.create_task(stream_completion(session, server, LONG, stream))
        await wait_until(lambda: len(stream.times) >= 1, what="first token")
        mark = server.log_size("scheduler")
        killed = time.monotonic()
        os.kill(server.child_pid("scheduler"), signal.SIGKILL)
        await asyncio.wait_for(task, 5.0)
        record("scheduler_kill_to_stream_error", time.monotonic() - killed)
        assert stream.done and len(stream.errors) == 1, stream.errors
        assert stream.errors[0]["error"]["code"] == "scheduler_unavailable"
        refused = await _post(session, server, {"prompt": "hi", "max_tokens": 2})
        record("scheduler_kill_to_503", time.monotonic() - killed)
        assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        # The restarted scheduler greets the worker, which re-announces itself.
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker ready", mark, 30.0)
        await asyncio.to_thread(server.wait_healthy, 30.0)
        record("scheduler_kill_to_healthy", time.monotonic() - killed)
        served = await _post(session, server, {"prompt": "hi", "max_tokens": 2})
        assert served.status == 200
    await assert_pool_empty(server)


async def test_sigkilled_frontend_is_forgotten_and_its_requests_aborted(server):
    frontend = server.processes["frontend"]
    async with aiohttp.ClientSession() as session:
        streams, tasks = start_streams(session, server, [LONG] * 3)
        await wait_until(lambda: all(s.times for s in streams), what="first tokens")
        mark = server.log_size("scheduler")
        killed = time.monotonic()
        os.kill(frontend.pid, signal.SIGKILL)
        await asyncio.gather(*tasks, return_exceptions=True)  # their connections just reset
    pattern = r"frontend .* lost \(.*\): aborted its 3 requests"
    await asyncio.to_thread(server.wait_log, "scheduler", pattern, mark, 5.0)
    record("frontend_kill_to_scheduler_aborts", time.monotonic() - killed)
    assert frontend.wait(5.0) == -signal.SIGKILL
    server.start("frontend")
    await asyncio.to_thread(server.wait_healthy, 60.0)
    record("frontend_restart_to_healthy", time.monotonic() - killed)
    await assert_pool_empty(server)
    async with aiohttp.ClientSession() as session:
        assert (await _post(session, server, {"prompt": "hi", "max_tokens": 2})).status == 200


async def test_sigterm_drains_the_frontend_then_exits_0(server):
    frontend = server.processes["frontend"]
    async with aiohttp.ClientSession() as session:
        stream = Stream()
        body = {"prompt": "Count slowly:", "max_tokens": 24, "ignore_eos": True}
        task = asyncio.create_task(stream_completion(session, server, body, stream))
        await wait_until(lambda: len(stream.times) >= 1, what="first token")
        mark = server.log_size("frontend")
        frontend.send_signal(signal.SIGTERM)
        await asyncio.to_thread(server.wait_log, "frontend", r"draining 1 in-flight", mark, 5.0)
        refused = await _post(session, server, {"prompt": "hi", "max_tokens": 2})
        assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        await asyncio.wait_for(task, 30.0)
    assert stream.done and not stream.errors and stream.finish_reason == "length"
    assert await asyncio.to_thread(frontend.wait, 30.0) == 0
    server.start("frontend")
    await asyncio.to_thread(server.wait_healthy, 60.0)
    await assert_pool_empty(server)
