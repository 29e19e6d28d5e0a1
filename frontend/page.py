"""The live web page: ``GET /`` (static HTML, CSS and JavaScript from ``frontend/static``, no
build step) and ``GET /page/stream``, its read-only data stream (SSE).

With API keys configured the stream wants one (``Authorization: Bearer``), like ``/v1/*``: the
page itself loads and asks for it. A page that stops reading is dropped after
``WRITE_TIMEOUT_S``; one that goes away is forgotten at once (aiohttp cancels its handler).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from frontend.auth import ApiKeys
from frontend.errors import ApiError
from frontend.page_feed import PageFeed

STATIC = Path(__file__).parent / "static"
WRITE_TIMEOUT_S = 10.0

FEED = web.AppKey("page_feed", PageFeed)

# The page loads only its own files and talks only to this server.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def add_page(app: web.Application, feed: PageFeed, keys: ApiKeys) -> None:
    """Serve the page and its stream from ``app``; the feed opens and closes with it."""
    app[FEED] = feed
    app.cleanup_ctx.append(_feed_running)
    app.router.add_get("/", _index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/page/stream", _Stream(keys).handle)


async def _feed_running(app: web.Application):
    await app[FEED].start()
    yield
    await app[FEED].close()


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers=_HEADERS)


class _Stream:
    """GET /page/stream: the hello frame (history), then snapshots and samples as they come."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.keys.tenant(request.headers.get("Authorization", ""))  # ApiError 401
        feed = request.app[FEED]
        watcher = feed.watch()
        if watcher is None:
            raise ApiError(503, "too many pages open", code="unavailable")
        try:
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
            while True:
                frames = await watcher.next()
                try:
                    await asyncio.wait_for(response.write(b"".join(frames)), WRITE_TIMEOUT_S)
                except (TimeoutError, asyncio.TimeoutError, ConnectionError):
                    _drop(request)  # a stalled or vanished browser
                    return response
        finally:
            feed.unwatch(watcher)


def _drop(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()
