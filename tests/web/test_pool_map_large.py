"""The pool map of a real 5,825-block pool (the default CPU pool of SmolLM2-135M in float32: 4 GiB
of K/V) in a real headless Chromium, under a load of 32 requests that share a prompt prefix.

The page shows all four block states, keeps up with the snapshots without a long task, names a
shared block's holders on hover, and draws even a worst-case pool (every block its own run)
within a frame's budget. The screenshots are the README's (tests/web/browser.py).
"""

from __future__ import annotations

import asyncio
import random
import re

import aiohttp
import pytest

from tests.servers import server_fixture
from tests.web.browser import chromium_path, screenshot

# Serial: the redraw bound below is a frame's budget, and two test processes' servers beside
# the browser on 2 cores measured 501 ms; the 4 GiB pool is the suite's largest too.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

NUM_BLOCKS = 5825
CONCURRENCY = 32
# A redraw must end before the next snapshot arrives (every 250 ms), or frames queue and the
# page freezes. Not a speed target: a 2-core CI machine running the server beside the browser
# measured 105 ms where a quiet one measures 30-60.
MAX_RENDER_MS = 200
MAX_LONG_TASK_MS = 250
STATES = ("free", "cached", "held", "shared")  # the pool summary's counts

# Every frame's longest main-thread tasks, counted from when the test says so.
LONG_TASKS = """
window.longTasks = [];
new PerformanceObserver((list) => {
  for (const entry of list.getEntries()) window.longTasks.push(entry.duration);
}).observe({ type: "longtask" });
"""

# The same PoolMap drawing a pool where every block is a run of its own (128 owners, a shared
# block in every seven): the most a snapshot of this pool can ask of the page.
WORST_CASE = """async (n) => {
  const { PoolMap } = await import("/static/pool_map.js");
  const canvas = document.createElement("canvas");
  canvas.style.width = "1000px";
  document.body.append(canvas);
  const tip = document.createElement("div");
  const map = new PoolMap(canvas, tip);
  const sets = [[]];
  for (let i = 0; i < 128; i++) sets.push([i]);
  for (let i = 0; i < 16; i++) sets.push([i, i + 1, i + 2]);
  const runs = [];
  for (let b = 0; b < n; b++) {
    const state = b % 7 === 0 ? 3 : b % 5 === 0 ? 0 : b % 11 === 0 ? 1 : 2;
    const owners = state === 3 ? 129 + (b % 16) : state === 2 ? 1 + (b % 128) : 0;
    runs.push(state, owners, 1);
  }
  const pool = { num_blocks: n, block_size: 16, watermark_blocks: 58, runs, owner_sets: sets };
  const requests = [...Array(128).keys()].map((i) => ({ request_id: `cmpl-${i}`, slot: i }));
  const times = [];
  for (let i = 0; i < 20; i++) {
    const started = performance.now();
    map.update(pool, requests);
    times.push(performance.now() - started);
  }
  canvas.remove();
  return { max: Math.max(...times), drawn: canvas.dataset.drawn, held: canvas.dataset.held };
}"""


# 5,825 blocks, 32 slots, audited, in the dtype ``auto`` picks: bfloat16 (float32's ledger in
# half the memory) where the CPU computes it natively, else float32. On a CPU without AVX-512,
# bfloat16 runs torch's slow generic matmuls: this test took 137 s there against 51 s in float32.
server = server_fixture(
    num_blocks=NUM_BLOCKS, num_slots=CONCURRENCY, dtype="auto", threads=1, audit=1
)


def _prompts(seed: int = 0) -> tuple[str, list[str]]:
    """A prefix of about 20 blocks, and 32 prompts that open with it."""
    rng = random.Random(seed)
    words = ["harbour", "signal", "copper", "meadow", "lantern", "granite", "orbit", "willow"]
    prefix = " ".join(rng.choice(words) for _ in range(300))
    return prefix, [f"{prefix} Question {i}: {rng.choice(words)}?" for i in range(CONCURRENCY)]


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def _counts(page) -> dict[str, int]:
    found = await page.evaluate("() => ({...document.getElementById('pool-summary').dataset})")
    return {k: int(v) for k, v in found.items() if k in ("blocks", *STATES)}


async def _wait_counts(page, predicate, what: str, timeout: float = 120.0) -> dict[str, int]:
    """Poll the pool summary's counts (bounded) until ``predicate`` holds."""
    counts: dict[str, int] = {}
    try:
        async with asyncio.timeout(timeout):
            while not predicate(counts := await _counts(page)):
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"the page never showed {what}: {counts}") from None
    return counts


async def _hover_shared_block(page) -> str:
    """Hover over a block the page draws as shared; the tooltip's text."""
    where = await page.evaluate(
        """() => {
            const map = nanoservePage.poolMap, L = map.layout;
            const b = map.blocks.state.indexOf(3);
            const box = map.canvas.getBoundingClientRect();
            return { b, x: box.left + (b % L.cols + 0.5) * L.cell,
                     y: box.top + (Math.floor(b / L.cols) + 0.5) * L.cell };
        }"""
    )
    assert where["b"] >= 0, "no shared block to hover over"
    await page.mouse.move(where["x"], where["y"])
    return await page.inner_text("#tooltip")


async def test_a_5825_block_pool_under_load_stays_smooth(server, tmp_path):
    from playwright.async_api import async_playwright

    prefix, prompts = _prompts()
    errors: list[str] = []
    async with async_playwright() as p, aiohttp.ClientSession() as session:
        browser = await p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1440, "height": 1200})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.add_init_script(LONG_TASKS)
        await page.goto(server.url + "/")
        idle = await _wait_counts(page, lambda c: c.get("blocks") == NUM_BLOCKS, "the pool", 30)
        assert idle["free"] + idle["cached"] == NUM_BLOCKS, idle

        # One request computes the prefix; the others share its blocks, and the short ones
        # leave cached-free blocks behind while the long ones run. Every eighth runs long
        # enough (160 tokens) to still share the prefix when the test hovers over it.
        await _complete(session, server.url, prefix, 1)
        lengths = [160 if i % 8 == 7 else 16 + 8 * (i % 8) for i in range(len(prompts))]
        load = [
            asyncio.create_task(_complete(session, server.url, prompt, length))
            for prompt, length in zip(prompts, lengths, strict=True)
        ]
        counts = await _wait_counts(
            page,
            lambda c: c.get("held", 0) > 0 and c.get("shared", 0) > 0 and c.get("cached", 0) > 0,
            "held, shared and cached-free blocks at once",
        )
        assert sum(counts[k] for k in STATES) == NUM_BLOCKS
        assert await page.get_attribute("#pool-map", "data-drawn") == "blocks", "a block a cell"

        # Keeping up: ten more redraws as snapshots come, none slow, no long task meanwhile.
        reset = "() => { window.longTasks = []; return nanoservePage.renders; }"
        renders = await page.evaluate(reset)
        more = "(n) => nanoservePage.renders >= n"  # a function: the page's CSP forbids eval
        await page.wait_for_function(more, arg=renders + 10, timeout=30_000)
        slowest = await page.evaluate("nanoservePage.renderMaxMs")
        assert slowest < MAX_RENDER_MS, f"a redraw took {slowest:.1f} ms"
        long_tasks = await page.evaluate("window.longTasks")
        assert max(long_tasks, default=0) < MAX_LONG_TASK_MS, long_tasks

        tooltip = await _hover_shared_block(page)
        holders = re.search(r"block \d+ · shared · refs (\d+)", tooltip)
        assert holders and int(holders[1]) >= 2 and "cmpl-" in tooltip, tooltip
        assert "harbour" not in await page.content(), "prompt text on the page"
        await page.mouse.move(0, 0)
        await screenshot(page, tmp_path, "page-5825-blocks.png")

        worst = await page.evaluate(WORST_CASE, NUM_BLOCKS)
        assert worst["drawn"] == "blocks" and worst["max"] < MAX_RENDER_MS, worst
        await asyncio.gather(*load)
        await browser.close()
    assert not errors, errors
