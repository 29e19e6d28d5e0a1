"""``nanoserve bench serve``'s scrape across frontends (``nanoserve.bench.scrape``): a server
whose /metrics answers come from two frontends in turn is read whole, each frontend's own CPU
and tokens summed and the scheduler's series taken once; one that never shows a frontend
leaves the frontends' sum unknown, never half of it."""

from __future__ import annotations

import socket

import aiohttp
import pytest
from aiohttp import web

from nanoserve.bench.scrape import frontend_labels, per_frontend, scrape_frontends

pytestmark = pytest.mark.timeout(20)


def _text(index: int, count: int, pid: int, cpu: float, tokens: float, steps: float) -> str:
    return (
        f'nanoserve:frontend_info{{count="{count}",index="{index}",pid="{pid}"}} 1.0\n'
        f"nanoserve:frontend_cpu_seconds_total {cpu}\n"
        f"nanoserve:generation_tokens_total {tokens}\n"
        f"nanoserve:generation_tokens_created 1.7e9\n"
        f"nanoserve:num_steps {steps}\n"
        f"nanoserve:scheduler_cpu_seconds_total 3.5\n"
    )


class Rotating:
    """A /metrics that answers as each of ``texts`` in turn (``texts[i]`` may change)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.calls = texts, 0

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.calls += 1
        return web.Response(text=self.texts[self.calls % len(self.texts)])


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def test_two_frontends_are_each_read_and_their_own_series_summed():
    texts = [_text(0, 2, 11, 1.0, 100, 7), _text(1, 2, 12, 2.5, 40, 7)]
    async with Rotating(texts) as url, _session() as session:
        before = await scrape_frontends(session, url)
        texts[0], texts[1] = _text(0, 2, 11, 1.5, 160, 9), _text(1, 2, 12, 2.75, 80, 9)
        after = await scrape_frontends(session, url)
    assert before.count == 2 and sorted(before.frontends) == ["0", "1"]
    assert before.get("frontend_cpu") == ("nanoserve:frontend_cpu_seconds_total", 3.5)
    assert after.get("frontend_cpu")[1] == pytest.approx(4.25)
    assert before.get("num_steps") == ("nanoserve:num_steps", 7)  # the scheduler's: once
    assert per_frontend(before, after) == [
        {"index": 0, "pid": 11, "tokens": 60, "cpu_s": 0.5},
        {"index": 1, "pid": 12, "tokens": 40, "cpu_s": 0.25},
    ]


async def test_a_frontend_that_never_answers_leaves_the_sum_unknown():
    # The server says two, but every connection reaches frontend 0.
    async with Rotating([_text(0, 2, 11, 1.0, 100, 7)]) as url, _session() as session:
        scrape = await scrape_frontends(session, url, tries_per_frontend=3)
    assert scrape.get("frontend_cpu") is None  # never half the CPU as if it were all
    assert scrape.get("scheduler_cpu") == ("nanoserve:scheduler_cpu_seconds_total", 3.5)
    assert sorted(scrape.frontends) == ["0"]


async def test_a_restarted_frontend_is_left_out_of_the_shares():
    texts = [_text(0, 2, 11, 1.0, 100, 7), _text(1, 2, 12, 2.5, 40, 7)]
    async with Rotating(texts) as url, _session() as session:
        before = await scrape_frontends(session, url)
        texts[1] = _text(1, 2, 99, 0.1, 5, 9)  # a new pid: its counters began again
        after = await scrape_frontends(session, url)
    assert [row["index"] for row in per_frontend(before, after)] == [0]


async def test_a_server_without_the_info_is_read_from_one_answer():
    text = "nanoserve:frontend_cpu_seconds_total 2.0\nvllm:num_steps 3\n"
    assert frontend_labels(text) is None
    async with Rotating([text]) as url, _session() as session:
        scrape = await scrape_frontends(session, url)
    assert scrape.count == 1 and scrape.get("frontend_cpu")[1] == 2.0
