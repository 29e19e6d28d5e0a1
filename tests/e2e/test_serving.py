"""End to end: real processes, real HTTP (aiohttp and the official openai client), real model."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.e2e.conftest import generate_offline
from tests.servers import sse_events

pytestmark = pytest.mark.slow

PROMPT = "The three most useful things to pack for a long hike are"
MESSAGES = [{"role": "user", "content": "Name two rivers in Europe and say one fact about each."}]


async def _post(server, path: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + path, json=body) as response:
            return response.status, await response.read()


SUMS = [f"Question: what is {i} plus {i + 3}?\nAnswer:" for i in range(64)]


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The references of every test here from one ``nanoserve generate`` run (one model load):
    line 0 the completion, line 1 the chat, then SUMS."""
    lines = [{"prompt": PROMPT, "max_tokens": 40}, {"messages": MESSAGES, "max_tokens": 48}]
    lines += [{"prompt": prompt, "max_tokens": 16} for prompt in SUMS]
    return generate_offline(tmp_path_factory.mktemp("offline"), lines, "--temperature", "0")


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def test_completion_stream_equals_nonstream_equals_generate(server, offline):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    status, raw = await _post(server, "/v1/completions", body)
    assert status == 200, raw
    import json

    whole = json.loads(raw)["choices"][0]["text"]

    status, raw = await _post(server, "/v1/completions", {**body, "stream": True})
    assert status == 200
    streamed = "".join(event["choices"][0]["text"] for event in sse_events(raw))

    async with _client(server) as client:
        stream = await client.completions.create(**body, stream=True)
        by_openai = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    assert whole, "the model said nothing"
    assert whole == streamed == by_openai == offline[0]["text"]


async def test_chat_stream_equals_nonstream_equals_generate(server, offline):
    async with _client(server) as client:
        whole = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=48, temperature=0
        )
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert whole.choices[0].message.content == streamed == offline[1]["text"]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.completion_tokens == len(offline[1]["token_ids"])


async def test_64_concurrent_streams_each_get_their_own_tokens(server, offline):
    prompts, reference = SUMS, offline[2:]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async with _client(server) as client:
        texts = await asyncio.wait_for(
            asyncio.gather(*(one(client, p) for p in prompts)), timeout=240
        )
    assert len({r["text"] for r in reference}) > 32, "prompts too alike to tell streams apart"
    assert texts == [r["text"] for r in reference]
    server.check_alive()
