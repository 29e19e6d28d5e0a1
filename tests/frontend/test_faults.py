"""The scheduler going away: in-flight requests fail fast, new ones get 503, then it recovers.
And the real `nanoserve frontend` process drains and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import aiohttp
import pytest

from frontend.client import Link
from frontend.config import FrontendConfig
from protocol.messages import PROTOCOL_VERSION
from tests.frontend.conftest import (
    REPLY,
    Server,
    _addresses,
    fake_backed_frontend,
    reply_tokens,
)
from tests.frontend.fake_scheduler import FakeScheduler
from tests.servers import new_server


@pytest.mark.fake(token_delay=0.05)
async def test_scheduler_loss_fails_streams_then_recovers(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 100, "stream": True}
    response = await server.http.post(server.url + "/v1/completions", json=body)
    await response.content.readuntil(b"\n\n")
    started = time.monotonic()
    await server.fake.close()
    rest = (await response.content.read()).decode()
    assert time.monotonic() - started < 2.5
    events = [e.removeprefix("data: ") for e in rest.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable"

    refused = await server.post("/v1/completions", {"prompt": "Hi"})
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert (await server.http.get(server.url + "/health")).status == 503

    server.fake = FakeScheduler(server.fake.address, reply_tokens(server.tokenizer))
    server.fake.start()
    await server.client.wait_ready(timeout=5)
    again = await server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 100})
    assert (await again.json())["choices"][0]["text"] == REPLY


async def test_a_scheduler_on_another_protocol_version_is_refused(tokenizer, caplog) -> None:
    """Its SchedulerInfo is refused with one error line; /health and each 503 say why."""
    other = PROTOCOL_VERSION - 1
    with caplog.at_level(logging.ERROR, logger="frontend.client"):
        async for server in fake_backed_frontend(tokenizer, {"protocol_version": other}, False):
            deadline = time.monotonic() + 10
            while server.client.link is not Link.REFUSED and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the hello and its answer cross real sockets
            assert server.client.link is Link.REFUSED
            why = f"scheduler speaks protocol {other}, not {PROTOCOL_VERSION}"
            health = await server.http.get(server.url + "/health")
            assert health.status == 503 and (await health.json())["reason"] == why
            refused = await server.post("/v1/completions", {"prompt": "Hi"})
            assert refused.status == 503 and refused.headers["Retry-After"] == "1"
            assert (await refused.json())["error"]["message"] == why
            await asyncio.sleep(0.3)  # heartbeats and stats keep arriving: still refused
            assert server.client.link is Link.REFUSED and server.fake.adds == []
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert lines == [
        f"scheduler protocol {other} != frontend protocol {PROTOCOL_VERSION}: refusing it"
    ]


async def test_frontend_process_drains_and_exits_0_on_sigterm(tokenizer, tmp_path) -> None:
    addresses = _addresses()
    FrontendConfig(addresses=addresses)  # the same addresses validate
    fake = FakeScheduler(addresses.frontend, reply_tokens(tokenizer), token_delay=0.05)
    fake.start()
    server = new_server(tmp_path, api_key="")
    options = ["--frontend-address", addresses.frontend, "--drain-timeout", "10"]
    process = server.start("frontend", *options)
    try:
        await asyncio.to_thread(server.wait_healthy, 60.0)
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "Hi", "max_tokens": 10, "stream": True}
            async with http.post(server.url + "/v1/completions", json=body) as response:
                await response.content.readuntil(b"\n\n")
                process.send_signal(signal.SIGTERM)
                rest = (await response.content.read()).decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert "error" not in rest  # the in-flight stream finished normally
        assert await asyncio.to_thread(process.wait, 20) == 0
    finally:
        server.stop()
        await fake.close()
