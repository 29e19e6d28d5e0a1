"""The web page's side of the frontend against a fake scheduler and a fake monitor feed: the page
and its strict policy, the stream's key, the relay of snapshots while (and only while) a page
is open, the frontend's own view of the scheduler in every stats frame, and pages that fall
behind, stall or vanish."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from frontend import page as page_module
from frontend.page import FEED
from frontend.page_feed import Watcher
from protocol.monitor import FREE, HELD, PoolSnapshot, PoolStates, RequestRow
from tests.frontend.conftest import _addresses, fake_backed_frontend
from tests.frontend.fake_scheduler import FakeScheduler


@dataclass
class PageServer:
    url: str
    app: web.Application
    feed: zmq.asyncio.Socket  # the fake scheduler's monitor XPUB
    http: aiohttp.ClientSession
    scheduler: FakeScheduler

    def streams(self) -> int:
        return len(self.app[FEED].watchers)


@pytest.fixture
async def server(tokenizer, request: pytest.FixtureRequest) -> AsyncIterator[PageServer]:
    marker = request.node.get_closest_marker("frontend")
    addresses = _addresses(monitor=True)
    context = zmq.asyncio.Context()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.bind(addresses.monitor)
    options = marker.kwargs if marker else {}
    try:
        async for running in fake_backed_frontend(tokenizer, {}, False, addresses, **options):
            yield PageServer(running.url, running.app, xpub, running.http, running.fake)
    finally:
        context.destroy(linger=0)


def snapshot(seq: int, padding: int = 0) -> bytes:
    row = RequestRow(
        request_id="cmpl-1" + "x" * padding,
        running=True,
        slot=0,
        num_blocks=2,
        num_computed=20,
        num_prompt_tokens=18,
        num_output_tokens=3,
        max_tokens=16,
        num_preemptions=0,
        age_s=1.5,
        blocks=[0, 1],
    )
    states = bytes([HELD, HELD] + [FREE] * 6)  # one byte per block, as the scheduler sends it
    pool = PoolStates(num_blocks=8, block_size=16, watermark_blocks=1, states=states)
    message = PoolSnapshot(seq=seq, pool=pool, requests=[row], num_running=1)
    return msgspec.msgpack.encode(message)


async def events(response: aiohttp.ClientResponse, count: int) -> list[tuple[str, dict]]:
    """The next ``count`` SSE events of a page stream."""
    found = []
    while len(found) < count:
        block = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 10)
        kind, data = block.decode().strip().split("\n")
        found.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return found


async def subscription(feed: zmq.asyncio.Socket) -> bytes:
    return await asyncio.wait_for(feed.recv(), 5)


async def test_the_page_loads_with_a_strict_policy(server):
    async with server.http.get(server.url + "/") as response:
        assert response.status == 200 and response.content_type == "text/html"
        assert "default-src 'self'" in response.headers["Content-Security-Policy"]
        assert "pool-map" in await response.text()
    async with server.http.get(f"{server.url}/static/vendor/uPlot.iife.min.js") as response:
        assert response.status == 200
    # No build step: the browser follows page.js's imports, so each must be served as it is.
    modules, queue = set(), ["page.js"]
    while queue:
        path = queue.pop()
        async with server.http.get(f"{server.url}/static/{path}") as response:
            assert response.status == 200, path
            assert "javascript" in response.content_type, path
            source = await response.text()
        modules.add(path)
        queue += set(re.findall(r'from "\./([\w.]+\.js)"', source)) - modules
    assert {"page.js", "stream.js", "status.js", "health.js", "pool_map.js"} <= modules
    async with server.http.get(server.url + "/static/vendor/uPlot.LICENSE") as response:
        assert "MIT License" in await response.text()


async def test_the_page_and_its_stream_are_read_only(server):
    """Nothing the page serves takes a write: every other method is refused."""
    for path in ("/", "/page/stream", "/static/page.js"):
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            async with server.http.request(method, server.url + path, data=b"{}") as response:
                assert response.status == 405, (method, path)
    assert server.streams() == 0


@pytest.mark.frontend(api_key="first,second")
async def test_the_stream_needs_a_key_when_keys_are_set(server):
    async with server.http.get(server.url + "/page/stream") as response:
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "invalid_api_key"
    async with server.http.get(server.url + "/", headers={}) as response:
        assert response.status == 200  # the page loads, then asks for a key
    headers = {"Authorization": "Bearer second"}
    async with server.http.get(server.url + "/page/stream", headers=headers) as response:
        assert response.status == 200
        ((kind, hello),) = await events(response, 1)
        assert kind == "hello" and hello["feed"] is True


async def test_snapshots_flow_only_while_a_page_is_open(server):
    async with server.http.get(server.url + "/page/stream") as response:
        assert await subscription(server.feed) == b"\x01"
        await server.feed.send(snapshot(1))
        got = dict(await events(response, 2))
        assert got["snapshot"]["pool"]["runs"] == [HELD, 1, 2, 0, 0, 6]
        assert got["snapshot"]["requests"][0]["request_id"] == "cmpl-1"
        assert got["snapshot"]["requests"][0]["slot"] == 0
        assert "blocks" not in got["snapshot"]["requests"][0]  # the runs carry them
        kind, stats = (await events(response, 1))[0]
        assert kind == "stats" and stats["link"]["pages"] == 1
        assert {"tok_s", "ttft_ms", "itl_ms", "kv_usage", "busy", "hit_rate"} <= set(
            stats["sample"]
        )
    assert await subscription(server.feed) == b"\x00"  # the last page left
    await asyncio.sleep(0.05)
    assert server.streams() == 0


async def next_stats(response: aiohttp.ClientResponse) -> dict:
    """The link of the next stats frame (one a second), skipping other frames."""
    while True:
        ((kind, data),) = await events(response, 1)
        if kind == "stats":
            return data["link"]


async def test_the_stats_say_how_this_frontend_hears_the_scheduler(server):
    """Every second, whether snapshots come or not: the scheduler heard, the worker ready (its
    SchedulerInfo), the age of the latest snapshot; and, once it is gone, that it is gone."""
    async with server.http.get(server.url + "/page/stream") as response:
        assert await subscription(server.feed) == b"\x01"
        link = await next_stats(response)
        assert link["state"] == "greeted" and link["alive"] is True and link["heard_s"] < 2
        assert link["worker_ready"] is True and link["worker_reason"] == ""
        assert link["snapshot_age_s"] is None  # none sent yet
        await server.feed.send(snapshot(1))
        link = await next_stats(response)
        assert 0 <= link["snapshot_age_s"] < 2
        await server.scheduler.close()
        for _ in range(10):
            link = await next_stats(response)
            if not link["alive"]:
                break
        assert link["alive"] is False and link["state"] != "greeted", link
        assert link["problem"] == "the scheduler is not connected"


async def test_a_snapshot_whose_pool_does_not_add_up_is_dropped(server):
    """Held blocks that no running row holds: the frame is dropped, the next one goes out."""
    held = PoolStates(num_blocks=8, block_size=16, watermark_blocks=0, states=bytes([HELD]) * 8)
    bad = msgspec.msgpack.encode(PoolSnapshot(seq=1, pool=held))
    async with server.http.get(server.url + "/page/stream") as response:
        assert await subscription(server.feed) == b"\x01"
        await server.feed.send(bad)
        await server.feed.send(snapshot(2))
        got = dict(await events(response, 2))
        assert got["snapshot"]["seq"] == 2


async def test_a_slow_page_misses_old_frames():
    watcher = Watcher(depth=4)
    for i in range(10):
        watcher.push(b"%d" % i)
    assert await watcher.next() == [b"6", b"7", b"8", b"9"]
    assert watcher.dropped == 6


async def test_pages_that_vanish_or_stall_are_forgotten(server, monkeypatch):
    monkeypatch.setattr(page_module, "WRITE_TIMEOUT_S", 0.5)
    port = int(server.url.rsplit(":", 1)[1])
    request = b"GET /page/stream HTTP/1.1\r\nHost: x\r\n\r\n"
    vanished = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", port))
    for sock in [*vanished, stalled]:
        sock.sendall(request)
    for _ in range(100):
        if server.streams() == 6:
            break
        await asyncio.sleep(0.02)
    assert server.streams() == 6
    for sock in vanished:
        sock.close()
    for seq in range(400):  # big frames, fast: the stalled page's buffers fill
        await server.feed.send(snapshot(seq, padding=20_000))
        await asyncio.sleep(0.005)
        if server.streams() == 0:
            break
    assert server.streams() == 0, "a vanished or stalled page is still held"
    stalled.close()


async def test_too_many_pages_get_503(server):
    server.app[FEED].max_watchers = 1
    async with server.http.get(server.url + "/page/stream") as first:
        assert first.status == 200
        async with server.http.get(server.url + "/page/stream") as second:
            assert second.status == 503
