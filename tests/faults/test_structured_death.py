"""A worker SIGKILLed in the middle of constrained streams: the restarted worker rebuilds each
request's matcher from the tokens the scheduler kept, so every stream finishes valid and the
greedy ones equal an undisturbed run."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import aiohttp
import jsonschema
import pytest

from tests.faults.conftest import (
    Stream,
    assert_pool_empty,
    record,
    start_streams,
    stream_completion,
    wait_until,
)

pytestmark = pytest.mark.slow

# Three steps of at least 12 characters each: long enough to be killed in the middle of.
STEPS = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 4, "maxLength": 24},
        "steps": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 1, "maximum": 3},
                    "text": {"type": "string", "minLength": 12, "maxLength": 32},
                },
                "required": ["n", "text"],
            },
        },
    },
    "required": ["title", "steps"],
}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "steps", "schema": STEPS, "strict": True}}
DATES = r"([0-9]{4}-[0-9]{2}-[0-9]{2}, ){7}[0-9]{4}-[0-9]{2}-[0-9]{2}"
# (prompt, extra body): greedy JSON twice, a greedy regex, a seeded JSON at temperature 1.
REQUESTS = [
    ("How to make tea, step by step:", {"response_format": SCHEMA, "temperature": 0}),
    ("How to plant a tree, step by step:", {"response_format": SCHEMA, "temperature": 0}),
    ("Eight dates in history:", {"structured_outputs": {"regex": DATES}, "temperature": 0}),
    ("How to fix a bike, step by step:", {"response_format": SCHEMA, "temperature": 1, "seed": 5}),
]


def _valid(text: str, extra: dict) -> bool:
    if "regex" in extra.get("structured_outputs", {}):
        return re.fullmatch(DATES, text) is not None
    jsonschema.validate(json.loads(text), STEPS)
    return True


async def test_constrained_streams_survive_a_worker_sigkill(server):
    bodies = [{"prompt": prompt, "max_tokens": 400, **extra} for prompt, extra in REQUESTS]
    async with aiohttp.ClientSession() as session:
        undisturbed = await asyncio.gather(
            *[stream_completion(session, server, body, Stream()) for body in bodies]
        )
        assert all(s.done and not s.errors and s.finish_reason == "stop" for s in undisturbed)
        assert min(len(s.times) for s in undisturbed) > 20, "too short to be killed midway"

        streams, tasks = start_streams(session, server, bodies)
        await wait_until(lambda: all(len(s.times) >= 3 for s in streams), what="first tokens")
        pid = server.child_pid("worker")
        mark = server.log_size("scheduler")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker ready", mark, 120.0)
        record("constrained_worker_kill_to_worker_ready", time.monotonic() - killed)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180.0)

    for (_, extra), before, after in zip(REQUESTS, undisturbed, results, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.finish_reason == "stop" and _valid(after.text, extra), after.text
        assert after.times[-1] > killed, "the stream ended before the kill"
        if extra["temperature"] == 0:
            assert after.text == before.text
    await assert_pool_empty(server)
