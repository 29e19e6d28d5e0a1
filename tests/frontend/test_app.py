"""The frontend over real HTTP and real ZeroMQ, against a scripted fake scheduler."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.frontend.conftest import REPLY, Server


def _events(raw: bytes) -> list[str]:
    text = raw.decode()
    if not text.endswith("\n\n"):
        raise AssertionError(f"stream does not end with a blank line: {text[-40:]!r}")
    events = text.split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: "), event
    return [event.removeprefix("data: ") for event in events]


async def test_completion_whole(server: Server) -> None:
    response = await server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 100})
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == REPLY
    assert body["choices"][0]["finish_reason"] == "stop"
    completion = len(server.tokenizer.encode(REPLY)) + 1  # the EOS token counts
    prompt = len(server.tokenizer.encode("Hi"))
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_stream_equals_whole_with_usage(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 10}
    whole = await (await server.post("/v1/completions", body)).json()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = await server.post("/v1/completions", stream_body)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = _events(await response.read())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == whole["choices"][0]["text"]
    assert "\ufffd" not in text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.fake(tokens_per_step=4)
async def test_a_step_of_several_tokens_streams_a_chunk_per_token(server: Server) -> None:
    """Verified drafts reach the frontend four tokens to an output. The client still gets one
    chunk per token, as from llama.cpp's server, each with its own logprob, and the same text;
    a stop string inside such a step still cuts the text there."""
    ids = server.tokenizer.encode(REPLY)
    body = {"prompt": "Hi", "max_tokens": 100, "stream": True, "logprobs": 1}
    events = _events(await (await server.post("/v1/completions", body)).read())
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert server.fake.steps == -(-(len(ids) + 1) // 4)  # the EOS token rides the last step
    assert len(chunks) == len(ids)
    assert all(len(c["logprobs"]["token_logprobs"]) == 1 for c in chunks)
    assert "".join(c["text"] for c in chunks) == REPLY
    assert [c["finish_reason"] for c in chunks] == [None] * (len(ids) - 1) + ["stop"]
    stop = {"prompt": "Hi", "max_tokens": 100, "stream": True, "stop": ["answer"]}
    events = _events(await (await server.post("/v1/completions", stop)).read())
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == REPLY[: REPLY.index("answer")]
    assert chunks[-1]["finish_reason"] == "stop"


async def test_chat_stream_format(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 50}
    events = _events(await (await server.post("/v1/chat/completions", body)).read())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    prompt = server.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert server.fake.adds[0].prompt_token_ids == prompt


async def test_openai_client(server: Server) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        models = await client.models.list()
        name = models.data[0].id
        chat = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=50
        )
        assert chat.choices[0].message.content == REPLY
        stream = await client.completions.create(
            model=name, prompt="Hi", max_tokens=50, stream=True, stop=["42"]
        )
        text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        assert text == REPLY[: REPLY.index("42")]
    finally:
        await client.close()


@pytest.mark.fake(token_delay=0.02)  # so the request is still running at the stop string
async def test_stop_string_aborts_scheduler_request(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 100, "stop": ["answer"]}
    result = await (await server.post("/v1/completions", body)).json()
    assert result["choices"][0]["text"] == REPLY[: REPLY.index("answer")]
    assert result["choices"][0]["finish_reason"] == "stop"
    await asyncio.wait_for(server.fake.aborted.wait(), 5)
    assert server.fake.aborts == [server.fake.adds[0].request_id]


async def test_n_choices_fan_out_with_seeds(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 100, "n": 3, "seed": 7, "stream": True}
    events = _events(await (await server.post("/v1/completions", body)).read())
    texts = ["", "", ""]
    for event in events[:-1]:
        choice = json.loads(event)["choices"][0]
        texts[choice["index"]] += choice["text"]
    assert texts == [f"seed {7 + i}: {REPLY}" for i in range(3)]
    assert sorted(add.params.seed for add in server.fake.adds) == [7, 8, 9]


@pytest.mark.fake(token_delay=0.05)
async def test_disconnect_mid_stream_sends_abort(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 100, "stream": True}
    response = await server.http.post(server.url + "/v1/completions", json=body)
    await response.content.readuntil(b"\n\n")  # the first token arrived
    response.close()
    await asyncio.wait_for(server.fake.aborted.wait(), 5)
    assert server.fake.aborts == [server.fake.adds[0].request_id]


async def test_logprobs_formats(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 2}
    completion = await (await server.post("/v1/completions", body)).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-0.5] * 3
    assert "".join(logprobs["tokens"]) == completion["choices"][0]["text"]
    assert logprobs["text_offset"][0] == 0 and len(logprobs["top_logprobs"][0]) == 2
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True}
    chat = await (await server.post("/v1/chat/completions", {**chat, "top_logprobs": 1})).json()
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(entry["bytes"]).decode() == entry["token"]
    assert len(entry["top_logprobs"]) == 1


@pytest.mark.fake(worker_ready=False)
async def test_health_503_until_worker_ready(server: Server) -> None:
    response = await server.http.get(server.url + "/health")
    assert response.status == 503
    assert "reason" in await response.json()
    refused = await server.post("/v1/completions", {"prompt": "Hi"})
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"


async def test_health_and_metrics(server: Server) -> None:
    assert (await server.http.get(server.url + "/health")).status == 200
    await server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5})
    text = await (await server.http.get(server.url + "/metrics")).text()
    for name in (
        "nanoserve:num_requests_running",
        "nanoserve:num_requests_waiting",
        "nanoserve:kv_cache_usage_perc",
        "nanoserve:num_preemptions_total",
        "nanoserve:prompt_tokens_total",
        "nanoserve:generation_tokens_total 5.0",
        "nanoserve:bad_messages_total",
        'nanoserve:request_success_total{finished_reason="length"} 1.0',
        "nanoserve:time_to_first_token_seconds_bucket",
        "nanoserve:inter_token_latency_seconds_bucket",
        "nanoserve:e2e_request_latency_seconds_count 1.0",
    ):
        assert name in text, name


async def test_garbage_from_scheduler_is_counted_and_dropped(server: Server) -> None:
    await server.fake.send_raw([b"\xff\x00garbage"])
    await server.fake.send_raw([b"one", b"two"])
    response = await server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5})
    assert response.status == 200
    assert server.client.metrics.bad_messages._value.get() == 2


@pytest.mark.frontend(api_key="secret")
async def test_api_key(server: Server) -> None:
    refused = await server.post("/v1/completions", {"prompt": "Hi"})
    assert refused.status == 401
    assert (await refused.json())["error"]["type"] == "authentication_error"
    headers = {"Authorization": "Bearer secret"}
    ok = await server.http.post(
        server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers
    )
    assert ok.status == 200
    assert (await server.http.get(server.url + "/health")).status == 200


async def test_usage_reports_the_cached_prompt_tokens(server: Server) -> None:
    server.fake.cached_tokens = 16
    whole = await (await server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})).json()
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == 16


async def test_cache_salt_reaches_the_scheduler(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    assert (await server.post("/v1/completions", {**body, "cache_salt": "abc"})).status == 200
    assert (await server.post("/v1/completions", body)).status == 200
    assert [add.cache_salt for add in server.fake.adds] == ["abc", None]
    refused = await server.post("/v1/completions", {**body, "cache_salt": ""})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "cache_salt"


@pytest.mark.frontend(api_key="key-one,key-two")
async def test_each_api_key_is_a_tenant_of_its_own(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    salts = []
    for key, salt in (("key-one", None), ("key-two", None), ("key-one", None), ("key-one", "x")):
        headers = {"Authorization": f"Bearer {key}"}
        extra = {} if salt is None else {"cache_salt": salt}
        response = await server.http.post(
            server.url + "/v1/completions", json={**body, **extra}, headers=headers
        )
        assert response.status == 200
        salts.append(server.fake.adds[-1].cache_salt)
    one, two, one_again, one_salted = salts
    assert one == one_again != two and one_salted == f"{one}:x"
    assert all("key" not in salt for salt in salts)  # the tenant id does not carry the key
    bad = {"Authorization": "Bearer key-three"}
    refused = await server.http.post(server.url + "/v1/completions", json=body, headers=bad)
    assert refused.status == 401
