"""The page's badges tell the truth, in a real headless Chromium against the three real processes.

Under 16 running streams the scheduler throttles its snapshots (an open page may take 3% of its
CPU): the badges keep saying the worker is ready and the scheduler answers, and the snapshots
line says how the feed is paced, as each snapshot's cadence says. A scheduler that stops
answering (SIGSTOP) turns red within seconds, and green again once it runs (SIGCONT). The
health panel shows the worker's plan, as the worker announced it. ``status.js``, which decides
what the badges say, is checked case by case in the same browser: each case changes one input
of a live page and names what must show.
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

STREAMS = 16
WATCH_S = 8.0  # how long the badges are read while all 16 run


# 16 slots, so 16 streams run at once; one worker thread, audited.
server = server_fixture(num_blocks=512, num_slots=STREAMS, threads=1, audit=1)


async def _open(p, server, errors: list[str]):
    browser = await p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
    page = await browser.new_page(viewport={"width": 1440, "height": 1200})
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(server.url + "/")
    return browser, page


# The badges, the snapshots line and what they were drawn from, read in one task right after a
# redraw (so the inputs are the ones the badges were decided on).
READ = """() => {
    const p = window.nanoservePage;
    p.redraw();
    const pill = (id) => {
        const el = document.getElementById(id);
        return { text: el.textContent, level: el.dataset.level };
    };
    const line = document.querySelector("[data-testid=snapshots]");
    return {
        worker: pill("worker-pill"),
        scheduler: pill("link-pill"),
        snapshots: { text: line?.textContent ?? "", cls: line?.className ?? "" },
        worker_line: document.querySelector("[data-testid=worker]")?.textContent ?? "",
        stream: document.getElementById("stream-state").textContent,
        age_s: p.snapshot ? (performance.now() - p.snapshotAt) / 1000 : null,
        frame_age_s: (performance.now() - p.frameAt) / 1000,
        seq: p.snapshot?.seq ?? null,
        cadence: p.snapshot?.cadence ?? null,
        running: p.snapshot?.num_running ?? 0,
        plan: p.snapshot?.health?.plan ?? {},
        plan_lines: Object.fromEntries([...document.querySelectorAll("#plan-list dd")]
            .map((dd) => [dd.dataset.key, dd.textContent])),
    };
}"""


async def _until(page, predicate, what: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        view = await page.evaluate(READ)
        if predicate(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {what}: {view}")
        await asyncio.sleep(0.1)


async def _complete(session: aiohttp.ClientSession, url: str, i: int) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Tell a story about harbour {i}."}
    body |= {"max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for _ in response.content:
            pass


def _healthy(view: dict) -> bool:
    return view["worker"]["text"] == "worker: ready" and view["scheduler"]["level"] == "ok"


def _check_truth(view: dict) -> None:
    """What the badges must say while the scheduler runs and the worker is ready."""
    if view["frame_age_s"] > 3:  # the page itself heard nothing (three stats periods)
        assert view["stream"].startswith("stream: stalled, nothing for"), view
        assert view["worker"] == {"text": "worker: unknown", "level": "warn"}, view
        return
    assert view["worker"] == {"text": "worker: ready", "level": "ok"}, view
    assert view["worker_line"].startswith("ready"), view
    assert view["stream"] == "stream: live", view
    cadence, snapshots = view["cadence"], view["snapshots"]["text"]
    if view["age_s"] <= 2 * cadence["max_gap_s"] + 1:  # on time, throttled or not
        assert view["scheduler"] == {"text": "scheduler: greeted", "level": "ok"}, view
        paced = "throttled, one every" if cadence["throttled"] else "live, one every"
        assert snapshots.startswith(paced), view
        assert view["snapshots"]["cls"] == "ok-text", view
    else:  # late, from a scheduler the frontend still hears: busy, never red, never unknown
        assert view["scheduler"]["level"] in ("ok", "warn"), view
        assert snapshots.startswith(("throttled: last snapshot", "late: last snapshot")), view
        assert view["snapshots"]["cls"] == "warn-text", view


async def test_the_badges_tell_the_truth_under_16_streams(server, tmp_path):
    from playwright.async_api import async_playwright

    errors: list[str] = []
    async with async_playwright() as p, aiohttp.ClientSession() as session:
        browser, page = await _open(p, server, errors)
        view = await _until(page, lambda v: _healthy(v) and v["seq"], "a live page", 30)
        load = [asyncio.create_task(_complete(session, server.url, i)) for i in range(STREAMS)]
        try:
            await _until(page, lambda v: v["running"] == STREAMS, f"{STREAMS} running", 120)
            views, deadline = [], time.monotonic() + WATCH_S
            while time.monotonic() < deadline:
                views.append(view := await page.evaluate(READ))
                _check_truth(view)
                await asyncio.sleep(0.15)
            assert not any(task.done() for task in load), "the load ended while being watched"
            await screenshot(page, tmp_path, "page-16-streams.png")
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
        heard = sum(v["frame_age_s"] <= 3 for v in views)
        assert heard >= len(views) / 2, (
            f"the page heard nothing in {len(views) - heard} of {len(views)}"
        )
        seqs = {v["seq"] for v in views}
        assert len(seqs) >= WATCH_S / 2, f"the feed was not live: {len(seqs)} snapshots"
        assert all(v["running"] > 0 for v in views), "the load did not run while watched"

        # The worker's plan, one line per key as it announced it (this server: one thread).
        plan, lines = view["plan"], view["plan_lines"]
        assert plan["threads"] == "1" and plan["device"] == "cpu" and "attention" in plan, plan
        assert lines == plan, (lines, plan)
        await browser.close()
    assert not errors, errors


async def test_a_scheduler_that_stops_answering_shows_red_then_recovers(server, tmp_path):
    from playwright.async_api import async_playwright

    errors: list[str] = []
    scheduler = server.processes["scheduler"].pid
    async with async_playwright() as p:
        browser, page = await _open(p, server, errors)
        await _until(page, lambda v: _healthy(v) and v["seq"], "a live page", 30)
        os.kill(scheduler, signal.SIGSTOP)
        try:
            view = await _until(
                page, lambda v: v["scheduler"]["level"] == "bad", "the scheduler red", 20
            )
            assert view["scheduler"]["text"].startswith("scheduler: "), view
            assert view["worker"] == {"text": "worker: unknown", "level": "warn"}, view
            assert view["worker_line"].startswith("unknown"), view  # not the last snapshot's
            assert view["snapshots"]["cls"] == "bad-text", view
            await screenshot(page, tmp_path, "page-scheduler-stopped.png")
        finally:
            os.kill(scheduler, signal.SIGCONT)
        await _until(page, lambda v: _healthy(v), "the scheduler back", 60)
        await browser.close()
    assert not errors, errors


# One live page's state, then cases that each change one input: what status.js must say.
CASES = """async () => {
    const { pageStatus } = await import("/static/status.js");
    const now = 100_000;
    const cadence = { interval_s: 0.25, max_gap_s: 1, budget: 0.03, gap_s: 1, throttled: false };
    const link = { state: "greeted", alive: true, heard_s: 0.2, problem: null, pages: 1,
                   worker_ready: true, worker_reason: "", snapshot_age_s: 0.5 };
    const health = { worker: "ready", reason: "" };
    const live = { link, feed: true, periodS: 1, frameAt: now - 300, liveAt: 0,
                   snapshot: { health, cadence }, snapshotAt: now - 500 };
    const with_ = (changes) => ({ ...live, ...changes });
    const cases = {
        live,
        throttled: with_({ snapshot: { health, cadence: { ...cadence, throttled: true } } }),
        late: with_({ snapshotAt: now - 6000, link: { ...link, snapshot_age_s: 6 } }),
        behind: with_({ snapshotAt: now - 6000 }),
        silent: with_({ link: { ...link, alive: false, heard_s: 3 } }),
        disconnected: with_({
            link: { ...link, state: "disconnected", alive: false, heard_s: null } }),
        worker_lost: with_({ snapshot: { cadence, health: { worker: "lost", reason: "gone" } } }),
        late_no_worker: with_({ snapshotAt: now - 6000,
            link: { ...link, snapshot_age_s: 6, worker_ready: false, worker_reason: "lost" } }),
        none_yet: with_({ snapshot: null, liveAt: now - 6000,
            link: { ...link, snapshot_age_s: null } }),
        stalled: with_({ frameAt: now - 5000 }),
        no_feed: with_({ feed: false }),
    };
    return Object.fromEntries(Object.entries(cases).map(([name, state]) => {
        const s = pageStatus(state, now);
        const say = (e) => [e.level, e.text];
        return [name, { scheduler: say(s.scheduler), worker: say(s.worker),
                        snapshots: say(s.snapshots), stream: s.stream && say(s.stream) }];
    }));
}"""


async def test_status_says_what_is_happening_case_by_case(server):
    from playwright.async_api import async_playwright

    errors: list[str] = []
    async with async_playwright() as p:
        browser, page = await _open(p, server, errors)
        got = await page.evaluate(CASES)
        await browser.close()
    assert not errors, errors
    ready, greeted = ["ok", "ready"], ["ok", "greeted"]

    def check(name: str, scheduler, worker, snapshots: tuple[str, str], stream=None) -> None:
        case = got[name]
        assert case["scheduler"] == scheduler and case["worker"] == worker, (name, case)
        level, text = snapshots
        assert case["snapshots"][0] == level and case["snapshots"][1].startswith(text), (name, case)
        assert case["stream"] == stream, (name, case)

    check("live", greeted, ready, ("ok", "live, one every 1.0 s"))
    check("throttled", greeted, ready, ("ok", "throttled, one every 1.0 s: the page may take 3%"))
    busy = ["warn", "busy, snapshot 6.0 s ago"]
    check("late", busy, ready, ("warn", "throttled: last snapshot 6.0 s ago, scheduler busy"))
    check("behind", greeted, ready, ("warn", "late: last snapshot 6.0 s ago; the frontend's"))
    unknown = ["warn", "unknown"]
    silent = ["bad", "not answering (silent 3.0 s)"]
    check("silent", silent, unknown, ("bad", "last 500 ms ago: the scheduler is not answering"))
    down = ["bad", "disconnected"]
    check("disconnected", down, unknown, ("bad", "last 500 ms ago: the scheduler is disconnected"))
    check("worker_lost", greeted, ["bad", "lost"], ("ok", "live"))
    check("late_no_worker", busy, ["bad", "not ready"], ("warn", "throttled: last snapshot"))
    none = ["warn", "busy, no snapshot in 6.0 s"]
    check("none_yet", none, ready, ("warn", "throttled: none in 6.0 s, scheduler busy"))
    check("stalled", unknown, unknown, ("warn", "unknown: this page has heard nothing for 5.0 s"),
          ["bad", "stalled, nothing for 5.0 s"])  # fmt: skip
    check("no_feed", greeted, ready, ("warn", "none: this frontend has no monitor feed"))
