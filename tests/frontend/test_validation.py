"""Bad requests get OpenAI-style errors over HTTP, and none of them reaches the scheduler."""

from __future__ import annotations

from typing import Any

import pytest

from tests.frontend.conftest import Server

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}

CASES: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1.01}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4096}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 300}, 400, "prompt"),  # > max_model_len 256
    ("/v1/completions", {"prompt": [5] * 100}, 400, "prompt"),  # > KV pool of 64 tokens
    ("/v1/completions", {"prompt": [99_999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["x"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "Hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", b"[]", 400, None),
]


@pytest.mark.fake(max_model_len=256, num_blocks=4, block_size=16)
@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
async def test_bad_request(
    server: Server, path: str, body: Any, status: int, param: str | None
) -> None:
    response = await server.post(path, body)
    assert response.status == status
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["param"] == param
    assert server.fake.adds == []


@pytest.mark.frontend(max_body_bytes=1000)
async def test_body_over_limit_is_413(server: Server) -> None:
    response = await server.post("/v1/completions", {"prompt": "x" * 2000})
    assert response.status == 413
    assert (await response.json())["error"]["type"] == "invalid_request_error"
    assert server.fake.adds == []


async def test_unknown_route_is_json_404(server: Server) -> None:
    response = await server.http.get(server.url + "/v1/nothing")
    assert response.status == 404
    assert "error" in await response.json()


async def test_default_max_tokens_fills_the_context(server: Server) -> None:
    response = await server.post("/v1/completions", {"prompt": [5, 6, 7]})
    assert response.status == 200
    # FakeScheduler: max_model_len 2048, pool 256 * 16 = 4096 tokens.
    assert server.fake.adds[0].params.max_tokens == 2048 - 3
