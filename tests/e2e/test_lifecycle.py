"""Real processes: a client that disconnects gives its blocks back; bad input never gets past
the frontend; nothing kills a process."""

from __future__ import annotations

import time

import aiohttp
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def _wait_for(server, predicate, timeout: float = 15.0) -> dict[str, float]:
    """Poll /metrics (bounded) until ``predicate(metrics)`` holds; return those metrics."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if predicate(metrics):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {metrics}")
        time.sleep(0.05)


async def test_client_disconnect_mid_stream_frees_its_blocks(server):
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            chunks = 0
            async for line in response.content:
                chunks += line.startswith(b"data: ")
                if chunks == 3:
                    break
            held = _wait_for(server, lambda m: m["nanoserve:num_requests_running"] == 1)
            assert held["nanoserve:kv_cache_blocks_used"] >= 1
        # leaving the block closes the connection mid-stream
    freed = _wait_for(
        server,
        lambda m: (
            m["nanoserve:kv_cache_blocks_used"] == 0 and m["nanoserve:num_requests_running"] == 0
        ),
    )
    assert freed["nanoserve:num_requests_waiting"] == 0
    server.check_alive()  # the scheduler runs with --audit: a leaked block would have killed it


BAD_BODIES = [
    ("temperature", {"prompt": "hi", "temperature": -0.5}),
    ("top_p", {"prompt": "hi", "top_p": 0}),
    ("top_p", {"prompt": "hi", "top_p": 1.5}),
    ("max_tokens", {"prompt": "hi", "max_tokens": 0}),
    ("max_tokens", {"prompt": "hi", "max_tokens": "ten"}),
    ("stop", {"prompt": "hi", "stop": [f"s{i}" for i in range(64)]}),
    ("prompt", {"prompt": [7] * 9000}),
]


@pytest.mark.parametrize(
    "param,body", BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_BODIES)]
)
async def test_bad_input_gets_400_with_an_openai_error_body(server, param, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.url + "/v1/completions", json={"model": MODEL, **body}
        ) as response:
            payload = await response.json()
    assert response.status == 400, payload
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param, error
    server.check_alive()


async def test_invalid_json_unknown_model_and_huge_body(server):
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.url + "/v1/chat/completions",
            data=b"{not json",
            headers={"content-type": "application/json"},
        ) as response:
            assert response.status == 400
            assert "error" in await response.json()
        async with session.post(
            server.url + "/v1/completions", json={"model": "no-such-model", "prompt": "hi"}
        ) as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] is not None
        async with session.post(
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x" * (4 << 20)},
        ) as response:
            assert response.status == 413
    assert server.get("/health")[0] == 200
    server.check_alive()


async def test_a_prompt_larger_than_the_pool_is_refused_before_the_scheduler(tmp_path):
    from tests.servers import start_server

    small = start_server(tmp_path, num_blocks=8, block_size=16, max_model_len=4096)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                small.url + "/v1/completions",
                json={"model": MODEL, "prompt": [7] * 200, "max_tokens": 4},
            ) as response:
                payload = await response.json()
        assert response.status == 400, payload
        assert "pool" in payload["error"]["message"] or "KV" in payload["error"]["message"]
        assert small.metrics()["nanoserve:prompt_tokens_total"] == 0  # never reached the scheduler
        small.check_alive()
    finally:
        small.stop()
