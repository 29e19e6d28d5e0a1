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
    # Ranges SamplingParams carries, checked by the protocol's check_params.
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "Hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [99_999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [1] * 1025}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", b'{"prompt": "Hi", "temperature": 1e999}', 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "speculative": {"num_tokens": 17}}, 400, "speculative"),
    ("/v1/completions", {"prompt": "Hi", "speculative": {"num_tokens": -1}}, 400, "speculative"),
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


@pytest.mark.frontend(max_logprobs=2)
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ],
)
async def test_configured_logprobs_limit(server: Server, path: str, body: Any, param: str) -> None:
    response = await server.post(path, body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param and "[0, 2]" in error["message"]
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


@pytest.mark.fake(max_model_len=256, num_blocks=4, block_size=16)
@pytest.mark.parametrize(
    ("speculative", "want"), [({"num_tokens": 3}, 3), ({}, None), (None, None)]
)
async def test_speculative_reaches_the_scheduler(server: Server, speculative, want) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    if speculative is not None:
        body["speculative"] = speculative
    response = await server.post("/v1/completions", body)
    assert response.status == 200
    (add,) = server.fake.adds
    assert add.params.num_speculative_tokens == want
