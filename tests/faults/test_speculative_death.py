"""A worker SIGKILLed while requests verify drafts: their drafts in flight are dropped with the
worker's rows, the requests resume by recompute from the tokens the scheduler kept (drafts
never touch those), and the text equals an undisturbed run with speculation, greedy and seeded,
as well as the same requests without it."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from tests.faults.conftest import (
    Stream,
    assert_pool_empty,
    start_streams,
    stream_completion,
    wait_until,
)

pytestmark = pytest.mark.slow

# Text that repeats itself, so drafts are found and accepted.
LINE = "The quick brown fox jumps over the lazy dog. "
PROMPTS = [
    f"Copy this text exactly, then copy it again: {LINE * 3}{i}.\n\n{LINE * 2}" for i in range(3)
]
SPEC = {"speculative": {"num_tokens": 4}, "max_tokens": 80, "ignore_eos": True}
BODIES = [
    {**SPEC, "prompt": PROMPTS[0], "temperature": 0},
    {**SPEC, "prompt": PROMPTS[1], "temperature": 0},
    {**SPEC, "prompt": PROMPTS[2], "temperature": 0.7, "seed": 11},
]


async def test_sigkilled_worker_with_drafts_in_flight(server):
    async with aiohttp.ClientSession() as session:
        before = await asyncio.to_thread(server.metrics)
        undisturbed = await asyncio.gather(
            *[stream_completion(session, server, body, Stream()) for body in BODIES]
        )
        assert all(s.done and not s.errors and s.text for s in undisturbed)
        plain = await asyncio.gather(
            *[
                stream_completion(session, server, {**body, "speculative": None}, Stream())
                for body in BODIES
            ]
        )
        after = await asyncio.to_thread(server.metrics)
        accepted = "nanoserve:spec_decode_num_accepted_tokens_total"
        assert after[accepted] > before.get(accepted, 0.0), "no draft was ever accepted"

        streams, tasks = start_streams(session, server, BODIES)
        await wait_until(lambda: all(len(s.times) >= 2 for s in streams), what="first tokens")
        mark = server.log_size("scheduler")
        os.kill(server.child_pid("worker"), signal.SIGKILL)
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker lost", mark, 5.0)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180.0)

    for first, killed, without in zip(undisturbed, results, plain, strict=True):
        assert killed.done and not killed.errors, killed.errors
        assert killed.text == first.text
        assert without.text == first.text
    metrics = await assert_pool_empty(server)
    assert metrics["nanoserve:scheduler_workers_lost_total"] >= 1
