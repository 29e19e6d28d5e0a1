"""The scheduler keeps planning while the worker computes: with every step slowed to 1.5 s,
the next step is already queued behind the one computing (overlap), and adds and aborts are
taken in, and take effect, while a step is in flight. One slot, so the
added request must wait for the victim's slot: every snapshot below is one atomic EngineStats
from the scheduler, sent from its loop while the worker is still busy."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from tests.e2e.conftest import generate_offline
from tests.servers import server_fixture

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


slow_server = server_fixture(audit=1, debug_step_delay=1.5, num_slots=1)


async def _snapshot_where(server, predicate, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics without blocking the event loop (the requests under test run on it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = await asyncio.to_thread(server.metrics)
        if predicate(metrics):
            return metrics
        await asyncio.sleep(0.05)
    raise AssertionError(f"no snapshot matched within {timeout}s: {server.metrics()}")


async def test_adds_and_aborts_are_taken_in_during_a_step(slow_server):
    server = slow_server
    long_body = {
        "model": MODEL,
        "prompt": "Count to one hundred:",
        "max_tokens": 500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        victim = await session.post(server.url + "/v1/completions", json=long_body)
        await victim.content.readline()  # the first token: the victim runs
        before = server.metrics()["nanoserve:scheduler_messages_during_step_total"]

        # An add while a step is in flight is queued at once, not after the step.
        added = asyncio.create_task(
            session.post(
                server.url + "/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
            )
        )
        queued = await _snapshot_where(
            server,
            lambda m: (
                m["nanoserve:steps_in_flight"] >= 1 and m["nanoserve:num_requests_waiting"] == 1
            ),
        )
        assert queued["nanoserve:num_requests_running"] == 1

        # An abort while a step is in flight is taken in during that step (the counter moves
        # and the step is still in flight), and its blocks come back; the waiting request then
        # gets the slot. With --audit on, a leaked block would have stopped the scheduler.
        assert queued["nanoserve:kv_cache_blocks_used"] >= 1
        during = queued["nanoserve:scheduler_messages_during_step_total"]
        assert during >= before + 1  # the add
        victim.close()
        await _snapshot_where(
            server, lambda m: m["nanoserve:scheduler_messages_during_step_total"] >= during + 1
        )
        response = await asyncio.wait_for(added, timeout=30)
        assert response.status == 200
        assert (await response.json())["choices"][0]["text"] is not None
    idle = await _snapshot_where(server, lambda m: m["nanoserve:num_requests_running"] == 0)
    assert idle["nanoserve:kv_cache_blocks_used"] == 0
    assert idle["nanoserve:num_requests_waiting"] == 0
    server.check_alive()


async def test_the_next_step_is_queued_while_one_computes(slow_server, tmp_path):
    """Overlap across real processes: two steps in flight, and the tokens still come in order
    and equal a request run on its own."""
    body = {"model": MODEL, "prompt": "The sea is", "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(slow_server.url + "/v1/completions", json=body))
        await _snapshot_where(slow_server, lambda m: m["nanoserve:steps_in_flight"] == 2)
        response = await asyncio.wait_for(task, timeout=60)
        text = (await response.json())["choices"][0]["text"]
    # Each result carries the worker's resident memory: the weights alone are over 128 MiB.
    # Read right after the reply: the output that ended it brought the gauges.
    metrics = slow_server.metrics()
    assert metrics["nanoserve:worker_resident_memory_bytes"] > 2**27
    # The worker's plan, from its WorkerReady: in the scheduler's log and on /metrics.
    (plan,) = [name for name in metrics if name.startswith("nanoserve:worker_plan_info{")]
    assert {"device", "dtype", "attention"} <= set(re.findall(r'(\w+)="', plan))
    assert 'device="cpu"' in plan
    assert "worker plan: device=cpu" in (slow_server.log_dir / "scheduler.log").read_text()
    flags = ("--max-tokens", "4", "--temperature", "0", "--disable-overlap")
    (offline,) = generate_offline(tmp_path, [{"prompt": "The sea is"}], *flags)
    assert text and text == offline["text"]
