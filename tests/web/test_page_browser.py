"""The live web page in a real headless Chromium against the three real processes.

The page loads, asks for the API key and streams; under load held blocks appear on the pool map
and requests move from waiting to running; a SIGKILLed worker shows as lost, then as a restart,
and the pool fills again; a chat message streams its reply. Screenshots go to the test's tmp
directory. Without Chromium the test skips, unless NANOSERVE_REQUIRE_BROWSER=1 (CI) makes that a
failure.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.servers import server_fixture
from tests.web.browser import chromium_path, screenshot

pytestmark = pytest.mark.slow

KEY = "page-test-key"
PROMPTS = [f"Tell a long story about a lighthouse keeper named Keeper {i}." for i in range(8)]


# A small pool (64 blocks, 4 slots), audited, behind an API key; the worker supervised.
server = server_fixture(
    supervised=("worker",), audit=1, num_blocks=64, num_slots=4, threads=1, api_key=KEY
)


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": prompt,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for _ in response.content:
            pass


async def _stream_bytes(session: aiohttp.ClientSession, url: str, snapshots: int) -> bytes:
    """What /page/stream sends, raw, up to its ``snapshots``-th snapshot (10 s at most)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    raw = b""
    async with session.get(url + "/page/stream", headers=headers) as response:
        async with asyncio.timeout(10):
            while raw.count(b"event: snapshot") < snapshots:
                raw += await response.content.readuntil(b"\n\n")
    return raw


async def _view(page) -> dict:
    """What the page shows now: the pool map's counts, the queue rows, the health lines."""
    return await page.evaluate(
        """() => ({
            map: {...document.getElementById('pool-map').dataset},
            rows: [...document.querySelectorAll('#queue-table tbody tr[data-id]')]
                .map(tr => [tr.dataset.id, tr.dataset.state]),
            scheduler: document.querySelector('[data-testid=scheduler]')?.textContent ?? '',
            worker: document.querySelector('[data-testid=worker]')?.textContent ?? '',
            restarts: document.querySelector('[data-testid=restarts]')?.textContent ?? '',
            audit: document.querySelector('[data-testid=audit]')?.textContent ?? '',
            stream: document.getElementById('stream-state').textContent,
        })"""
    )


async def _until(page, predicate, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        view = await _view(page)
        if predicate(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {what}: {view}")
        await asyncio.sleep(0.1)


def _held(view: dict) -> int:
    return int(view["map"].get("held", 0)) + int(view["map"].get("shared", 0))


async def test_the_page_shows_the_pool_queues_a_restart_and_a_chat(server, tmp_path):
    from playwright.async_api import async_playwright

    executable = chromium_path()
    errors: list[str] = []
    async with async_playwright() as p, aiohttp.ClientSession() as session:
        browser = await p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1440, "height": 1200})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(server.url + "/")

        # The stream wants the key: the page asks for it.
        await page.wait_for_selector("#key-dialog[open]", timeout=15_000)
        await page.fill("#key-input", KEY)
        await page.click("#key-save")
        await _until(page, lambda v: v["stream"] == "stream: live", "a live stream", 15)
        await _until(page, lambda v: v["worker"] == "ready", "a ready worker", 15)

        load = [asyncio.create_task(_complete(session, server.url, p)) for p in PROMPTS]
        seen: dict[str, set[str]] = {}
        moved = set()

        def watch(view: dict) -> bool:
            for request_id, state in view["rows"]:
                if state == "running" and "waiting" in seen.get(request_id, set()):
                    moved.add(request_id)
                seen.setdefault(request_id, set()).add(state)
            return _held(view) > 0 and bool(moved)

        await _until(page, watch, "held blocks and a request moving from waiting to running")
        await screenshot(page, tmp_path, "page-under-load.png")
        assert "lighthouse" not in await page.content(), "prompt text on the page"
        raw = await _stream_bytes(session, server.url, snapshots=3)
        assert b"lighthouse" not in raw and b"Keeper" not in raw, "prompt text on the stream"

        os.kill(server.child_pid("worker"), signal.SIGKILL)
        await _until(page, lambda v: v["worker"].startswith("lost"), "the worker lost", 20)
        assert await page.get_attribute("#worker-pill", "data-level") == "bad", "a loss not red"
        await screenshot(page, tmp_path, "page-worker-lost.png")
        view = await _until(
            page,
            # The scheduler's line is the frontend's own view (its SchedulerInfo), which
            # must recover too: it stops naming the lost worker.
            lambda v: v["worker"] == "ready" and v["scheduler"] == "greeted" and _held(v) > 0,
            "the worker back, the frontend told, and the pool filling again",
            120,
        )
        assert view["restarts"].startswith("1 worker(s) lost"), view
        assert view["audit"].startswith("passed"), view
        events = await page.inner_text("#event-list")
        assert "worker was lost" in events and "worker ready" in events, events
        await screenshot(page, tmp_path, "page-restarted.png")
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)

        await page.evaluate(
            """() => {
                window.chatUpdates = 0;
                new MutationObserver(() => window.chatUpdates++).observe(
                    document.getElementById('chat-log'),
                    {subtree: true, childList: true, characterData: true});
            }"""
        )
        await page.fill("#chat-max-tokens", "24")
        await page.fill("#chat-temperature", "0")
        await page.fill("#chat-input", "Say hello to the lighthouse in five words.")
        await page.click("#chat-send")
        reply = page.locator(".msg.assistant").last
        await reply.wait_for()
        done = "() => document.querySelector('.msg.assistant:last-child').dataset.state"
        await page.wait_for_function(f"{done} !== 'streaming'", timeout=60_000)
        assert await reply.get_attribute("data-state") == "done", await reply.inner_text()
        assert (await reply.inner_text()).strip()
        assert await page.evaluate("window.chatUpdates") >= 3, "the reply did not stream"
        await screenshot(page, tmp_path, "page-chat.png")
        await browser.close()
    assert not errors, errors
