"""The Gateway API Inference Extension's model-server protocol on a real server under load:
/metrics carries each gauge the protocol requires, under vLLM's names, with the values the
scheduler holds. Two slots and six requests that cannot finish during the test (slow steps,
500 tokens each): the scheduler must hold exactly two running and four waiting."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from tests.servers import start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LABELS = f'engine="0",model_name="{MODEL}"'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    running = start_server(
        tmp_path_factory.mktemp("protocol"), audit=1, num_slots=2, debug_step_delay=0.2, threads=1
    )
    try:
        yield running
    finally:
        running.stop()


async def _scrape_where(server, predicate, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = await asyncio.to_thread(server.metrics)
        if predicate(metrics):
            return metrics
        await asyncio.sleep(0.05)
    raise AssertionError(f"no scrape matched within {timeout}s: {server.metrics()}")


async def test_each_required_gauge_carries_the_schedulers_values_under_load(server) -> None:
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 500, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        streams = [
            await session.post(server.url + "/v1/completions", json={**body, "stream": True})
            for _ in range(6)
        ]
        try:
            metrics = await _scrape_where(
                server,
                lambda m: (
                    m[f"vllm:num_requests_running{{{LABELS}}}"] == 2
                    and m[f"vllm:num_requests_waiting{{{LABELS}}}"] == 4
                ),
            )
        finally:
            for stream in streams:
                stream.close()  # a disconnect aborts the request
    # The same scrape's nanoserve: series mirror the scheduler's EngineStats.
    assert metrics["nanoserve:num_requests_running"] == 2
    assert metrics["nanoserve:num_requests_waiting"] == 4
    (config,) = [name for name in metrics if name.startswith("vllm:cache_config_info{")]
    geometry = dict(re.findall(r'(\w+)="([^"]*)"', config))
    assert geometry["block_size"] == "16" and metrics[config] == 1
    used = metrics["nanoserve:kv_cache_blocks_used"]
    assert used >= 2  # each running request holds at least its prompt's block
    usage = used / int(geometry["num_gpu_blocks"])
    assert metrics[f"vllm:kv_cache_usage_perc{{{LABELS}}}"] == pytest.approx(usage)
    assert metrics[f"vllm:gpu_cache_usage_perc{{{LABELS}}}"] == pytest.approx(usage)
    # Everything comes back once the clients are gone.
    await _scrape_where(server, lambda m: m[f"vllm:num_requests_running{{{LABELS}}}"] == 0)
