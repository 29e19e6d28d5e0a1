"""The scheduler's gauges and the worker's plan on /metrics: the gauges ride the scheduler's
heartbeat, the output that ends a request brings them at once, and the plan is an info metric.
A FakeScheduler over real ZeroMQ, the real app over real HTTP."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from tests.frontend.conftest import Server

PLAN = {"device": "cpu", "dtype": "float32", "attention": "cpu-kernels", "threads": "2"}


async def _metrics(server: Server) -> dict[str, float]:
    text = await (await server.http.get(server.url + "/metrics")).text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def _wait_for(server: Server, name: str, value: float, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (await _metrics(server)).get(name) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never reached {value}: {await _metrics(server)}")
        await asyncio.sleep(0.02)


@pytest.mark.fake(worker_plan=PLAN)
async def test_the_workers_plan_is_an_info_metric(server: Server) -> None:
    samples = await _metrics(server)
    (name,) = [n for n in samples if n.startswith("nanoserve:worker_plan_info")]
    assert dict(re.findall(r'(\w+)="([^"]*)"', name)) == PLAN
    assert samples[name] == 1.0


async def test_the_gauges_ride_the_heartbeat(server: Server) -> None:
    """No request runs, so nothing but the heartbeat can bring the fake's new gauge."""
    assert (await _metrics(server))["nanoserve:num_requests_waiting"] == 0
    server.fake.num_waiting = 7
    await _wait_for(server, "nanoserve:num_requests_waiting", 7.0)


@pytest.mark.fake(beat_stats=False)
async def test_a_requests_end_brings_the_gauges_at_once(server: Server) -> None:
    """With no gauges on the beat, /metrics read right after a reply still counts every step
    of it and no request running: the output that ended it carried them."""
    assert (await _metrics(server))["nanoserve:num_steps"] == 0
    response = await server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5})
    assert response.status == 200
    samples = await _metrics(server)
    assert samples["nanoserve:num_steps"] == 5
    assert samples["nanoserve:num_requests_running"] == 0
    assert samples["nanoserve:kv_cache_usage_perc"] == 0
