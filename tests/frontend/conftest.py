"""Shared frontend fixtures: the real default tokenizer (loaded once) and a live server.

``server`` runs the real app over real HTTP on 127.0.0.1 and real ZeroMQ against
``FakeScheduler`` on a private ipc socket.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from frontend.app import CLIENT, create_app
from frontend.client import SchedulerClient
from frontend.config import FrontendConfig
from models.files import resolve_model
from models.tokenizer import ChatTokenizer, load_tokenizer
from protocol.addresses import Addresses, runtime_dir
from protocol.messages import AddRequest
from tests.frontend.fake_scheduler import FakeScheduler

REPLY = "Hello! 你好，世界 🎉 The answer is 42. Done here."


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    """The default model's tokenizer, loaded once per session."""
    return load_tokenizer(resolve_model(None))


@dataclass
class Server:
    """A running frontend plus its fake scheduler."""

    url: str
    fake: FakeScheduler
    client: SchedulerClient
    http: aiohttp.ClientSession
    tokenizer: ChatTokenizer
    app: web.Application

    async def post(self, path: str, body: Any) -> aiohttp.ClientResponse:
        """POST JSON (or raw bytes) and return the response, body read."""
        data = body if isinstance(body, bytes) else None
        json = None if isinstance(body, bytes) else body
        response = await self.http.post(self.url + path, json=json, data=data)
        await response.read()
        return response


def _addresses(monitor: bool = False) -> Addresses:
    """Private ipc sockets of a fresh run; with a monitor feed's when ``monitor``."""
    run = uuid.uuid4().hex[:12]
    directory = runtime_dir()
    return Addresses(
        frontend=f"ipc://{directory}/test-{run}-frontend.sock",
        worker=f"ipc://{directory}/test-{run}-worker.sock",
        monitor=f"ipc://{directory}/test-{run}-monitor.sock" if monitor else None,
    )


def reply_tokens(tokenizer: ChatTokenizer):
    """The fake's script: REPLY's tokens, prefixed with the seed when one is set."""

    def reply(request: AddRequest) -> list[int]:
        seed = request.params.seed
        return tokenizer.encode(REPLY if seed is None else f"seed {seed}: {REPLY}")

    return reply


async def fake_backed_frontend(
    tokenizer: ChatTokenizer,
    fake_options: dict[str, Any],
    wait: bool = True,
    addresses: Addresses | None = None,
    **config: Any,
) -> AsyncIterator[Server]:
    """Start fake + app (on ``addresses``, else a fresh run's); yield a Server; tear everything
    down."""
    addresses = addresses or _addresses()
    fake = FakeScheduler(addresses.frontend, reply_tokens(tokenizer), **fake_options)
    fake.start()
    config.setdefault("api_key", None)
    settings = FrontendConfig(port=0, addresses=addresses, **config)
    app = create_app(settings, tokenizer=tokenizer)
    client = app[CLIENT]
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    running = Server(f"http://127.0.0.1:{port}", fake, client, http, tokenizer, app)
    try:
        if wait:
            await client.wait_ready(timeout=10)
        yield running
    finally:
        await http.close()
        await runner.cleanup()
        await running.fake.close()  # a test may have replaced the fake (restart tests)
        if running.fake is not fake:
            await fake.close()
        for address in (addresses.frontend, addresses.worker, addresses.monitor):
            if address is not None:
                Path(address.removeprefix("ipc://")).unlink(missing_ok=True)


@pytest.fixture
async def server(tokenizer: ChatTokenizer, request: pytest.FixtureRequest) -> AsyncIterator[Server]:
    """A ready server; ``@pytest.mark.fake(...)`` / ``@pytest.mark.frontend(...)`` tune it."""
    fake_marker = request.node.get_closest_marker("fake")
    config_marker = request.node.get_closest_marker("frontend")
    fake_options = fake_marker.kwargs if fake_marker else {}
    config = config_marker.kwargs if config_marker else {}
    wait = fake_options.get("worker_ready", True)
    async for running in fake_backed_frontend(tokenizer, fake_options, wait, **config):
        yield running


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fake(**options): FakeScheduler options for `server`")
    config.addinivalue_line("markers", "frontend(**options): FrontendConfig options for `server`")
