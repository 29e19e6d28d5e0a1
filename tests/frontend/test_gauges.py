"""The scheduler's gauges and the worker's plan on /metrics: the gauges ride the scheduler's
heartbeat, the output that ends a request brings them at once, and the plan is an info metric.
A FakeScheduler over real ZeroMQ, the real app over real HTTP."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from nanoserve.bench.metrics import samples
from tests.frontend.conftest import Server

PLAN = {"device": "cpu", "dtype": "float32", "attention": "cpu-kernels", "threads": "2"}


async def _metrics(server: Server) -> dict[str, float]:
    return samples(await (await server.http.get(server.url + "/metrics")).text())


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


def _vllm(name: str, **labels: str) -> str:
    """A vLLM series' sample name, its labels sorted as the exposition writes them."""
    every = {"engine": "0", "model_name": "SmolLM2-135M-Instruct", **labels}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(every.items())) + "}"


async def test_the_routers_gauges_exist_before_any_stats(server: Server) -> None:
    """A picker that scrapes a replica before its first heartbeat still finds every name the
    model-server protocol requires (at 0), labelled with the served model."""
    samples = await _metrics(server)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        assert samples[_vllm(name)] == 0.0, name


@pytest.mark.fake(num_blocks=64, token_delay=0.05)
async def test_the_routers_gauges_carry_the_schedulers_values(server: Server) -> None:
    """Each vLLM-named gauge equals the scheduler's figure while a request runs: the fake's
    gauges count one running request holding one block of 64, and 3 waiting."""
    server.fake.num_waiting = 3
    task = asyncio.create_task(server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 40}))
    await _wait_for(server, _vllm("vllm:num_requests_running"), 1.0)
    await _wait_for(server, _vllm("vllm:num_requests_waiting"), 3.0)
    samples = await _metrics(server)
    assert samples[_vllm("vllm:kv_cache_usage_perc")] == 1 / 64
    assert samples[_vllm("vllm:gpu_cache_usage_perc")] == 1 / 64
    assert samples[_vllm("vllm:cache_config_info", block_size="16", num_gpu_blocks="64")] == 1
    assert (await task).status == 200


@pytest.mark.fake(worker_ready=False)
async def test_no_cache_config_while_no_worker_is_ready(server: Server) -> None:
    """The geometry is the ready worker's: with none, the info series has no sample."""
    samples = await _metrics(server)
    assert not [name for name in samples if name.startswith("vllm:cache_config_info")]
    assert samples[_vllm("vllm:num_requests_running")] == 0.0
