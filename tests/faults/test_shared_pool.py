"""A worker SIGKILLed over the pool holder's shared KV pool costs only its steps in flight:
the restarted worker maps the same pool, the scheduler hands the running requests their blocks
back, every stream ends with the undisturbed text, and the next turn's prefix-cache hits are
those of an undisturbed run. A killed holder (alone, or with the worker) costs recompute, never
text. Real processes, the default model in float32, the audit on."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import aiohttp
import pytest

from tests.faults.conftest import (
    MODEL,
    _report_timings,
    assert_pool_empty,
    record,
    start_streams,
    wait_metrics,
)
from tests.servers import ROLES, server_fixture

pytestmark = pytest.mark.slow

SUPERVISED = ("kv-holder", "scheduler", "worker")
# 8 streams of about 1,500-token contexts: a pool of 1,024 blocks of 16 holds them with room.
pool_server = server_fixture(
    after_stop=_report_timings,
    roles=("kv-holder", *ROLES),
    supervised=SUPERVISED,
    audit=1,
    dtype="float32",
    shared_kv_pool=1,
    num_blocks=1024,
    num_slots=16,
    threads=2,
)

_WORDS = (
    "river stone lantern orchard harbor meadow signal copper winter garden valley ember thread "
    "compass island bridge forest letter window candle market silver morning paper canyon"
).split()


def long_prompt(index: int, words: int = 1400) -> str:
    """A seeded prompt of about 1,500 tokens, different for each index."""
    rng = random.Random(index)
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Notes {index}: {text}\nSummary:"


def body(prompt: str, salt: str, max_tokens: int = 40) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": salt,
    }


async def next_turn_hits(session, server, prompts, texts, salt) -> list[int]:
    """Each conversation's next turn (its history and a question), not streamed: the prompt
    tokens the prefix cache served for it."""

    async def one(prompt: str, text: str) -> int:
        request = {**body(prompt + text + "\nAnd then?", salt, 4), "model": MODEL}
        async with session.post(server.url + "/v1/completions", json=request) as response:
            reply = await response.json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    return await asyncio.gather(*(one(p, t) for p, t in zip(prompts, texts, strict=True)))


async def kill_mid_stream(session, server, bodies, roles: tuple[str, ...], after: int = 3):
    """Stream ``bodies``; once every stream has ``after`` tokens, SIGKILL the children of
    ``roles``. Returns the streams and the seconds from the kill to each stream's next token."""
    streams, tasks = start_streams(session, server, bodies)
    deadline = time.monotonic() + 300.0
    while not all(len(s.times) >= after for s in streams):
        if time.monotonic() > deadline or any(t.done() for t in tasks):
            raise AssertionError(f"streams did not start\n{server.logs()}")
        await asyncio.sleep(0.01)
    pids = [server.child_pid(role) for role in roles]
    killed = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    counts = [len(s.times) for s in streams]
    await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
    gaps = [s.times[c] - killed for s, c in zip(streams, counts, strict=True) if len(s.times) > c]
    return streams, gaps


# The kill inside a step (worker.faults): a token budget of 64 prefills a long prompt in chunks
# of 60 beside four decoding streams, [960, 1020) among them, which ends inside block 63; the
# worker SIGKILLs itself after layer 14 (of 30) of that step wrote its K/V. Function scope: the
# injector arms only in the pool's first worker, and this server stops before pool_server starts.
FAULT_POSITION, FAULT_LAYER, FAULT_BUDGET = 1000, 14, 64
fault_server = server_fixture(
    scope="function",
    roles=("kv-holder", *ROLES),
    supervised=SUPERVISED,
    audit=1,
    dtype="float32",
    shared_kv_pool=1,
    num_blocks=256,
    num_slots=16,
    threads=2,
    token_budget=FAULT_BUDGET,
    fault_kill_at=f"{FAULT_POSITION}:{FAULT_LAYER}",
)


def fault_items(log: str) -> tuple[int, list[tuple[int, int, bool]]]:
    """The injector's line in a worker log: the step it killed and its items as (start,
    tokens, sampled)."""
    found = re.search(r"fault injector: SIGKILL in step (\d+) after layer (\d+).*: (.*)", log)
    assert found is not None, log[-3000:]
    assert int(found[2]) == FAULT_LAYER
    items = re.findall(r"\d+:(\d+)\+(\d+)(s?)", found[3])
    return int(found[1]), [(int(a), int(n), bool(s)) for a, n, s in items]


async def test_a_kill_inside_a_step_that_wrote_part_of_a_block_keeps_the_text(fault_server):
    """SIGKILL inside a step, between two layers' K/V writes, while a prefill chunk writes the
    head of a block and decode rows write one slot each: the restarted worker re-attaches, the
    kept rows' half-written tails are never read, and every stream ends with the text of an
    undisturbed run; only the steps in flight are computed again, and every audit passes."""
    server = fault_server
    # Of different lengths: the decode rows write different slots of their blocks.
    shorts = [f"Write a long story about a {'very ' * i}old lighthouse keeper." for i in range(4)]
    long = long_prompt(40, words=1100)  # about 1,100 tokens: past FAULT_POSITION
    mark = server.log_size("worker")
    async with aiohttp.ClientSession() as session:

        async def run(salt: str) -> list:
            """Four streams decoding, then the long prompt beside them."""
            streams, tasks = start_streams(session, server, [body(p, salt, 64) for p in shorts])
            deadline = time.monotonic() + 120.0
            while not all(len(s.times) >= 2 for s in streams):
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), (
                    server.logs()
                )
                await asyncio.sleep(0.01)
            more, late = start_streams(session, server, [body(long, salt, 16)])
            await asyncio.wait_for(asyncio.gather(*tasks, *late), 300.0)
            return streams + more

        killed = await run("kill")  # the first worker dies in it
        calm = await run("calm")  # its successor is not armed: an undisturbed run
    step, items = fault_items((server.log_dir / "worker.log").read_text()[mark:])
    size = 16
    chunk = [(a, n) for a, n, _ in items if a <= FAULT_POSITION < a + n]
    assert chunk and chunk[0][1] > 1 and sum(chunk[0]) % size, (step, items)  # ends mid-block
    decodes = [(a, n) for a, n, sampled in items if n == 1 and sampled]
    assert len(decodes) == len(shorts), (step, items)
    for after, undisturbed in zip(killed, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text
    metrics = await assert_pool_empty(server)
    assert metrics["nanoserve:scheduler_workers_lost_total"] == 1, server.logs()
    assert metrics["nanoserve:kv_pool_reattaches_total"] == 1, server.logs()
    fallbacks = [v for k, v in metrics.items() if k.startswith("nanoserve:kv_pool_fallbacks")]
    assert sum(fallbacks) == 0, server.logs()
    # The killed step's tokens, and at most one more step's (overlap), are computed again.
    recomputed = metrics["nanoserve:worker_restart_tokens_recomputed_last"]
    assert 0 < recomputed <= sum(n for _, n, _ in items) + FAULT_BUDGET, (recomputed, items)
    log = (server.log_dir / "scheduler.log").read_text()
    assert "re-attached" in log and "fails its checksum" not in log, server.logs()
    record("kill_in_step_tokens_recomputed", recomputed)


async def test_sigkilled_worker_reattaches_recomputing_only_its_steps_in_flight(pool_server):
    server = pool_server
    prompts = [long_prompt(i) for i in range(8)]
    async with aiohttp.ClientSession() as session:
        calm, calm_tasks = start_streams(session, server, [body(p, "calm") for p in prompts])
        await asyncio.wait_for(asyncio.gather(*calm_tasks), 600.0)
        assert all(s.done and not s.errors and s.text for s in calm)
        calm_hits = await next_turn_hits(session, server, prompts, [s.text for s in calm], "calm")
        before = await asyncio.to_thread(server.metrics)
        mark = server.log_size("scheduler")
        streams, gaps = await kill_mid_stream(
            session, server, [body(p, "kill") for p in prompts], ("worker",)
        )
        hits = await next_turn_hits(session, server, prompts, [s.text for s in streams], "kill")
    for after, undisturbed in zip(streams, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text
    assert hits == calm_hits and min(hits) >= 1400, (hits, calm_hits)
    metrics = await assert_pool_empty(server)
    assert (
        metrics["nanoserve:kv_pool_reattaches_total"]
        == before["nanoserve:kv_pool_reattaches_total"] + 1
    ), server.logs()
    # Two steps in flight at most (overlap), one decode token a stream in each.
    recomputed = metrics["nanoserve:worker_restart_tokens_recomputed_last"]
    assert 0 < recomputed <= 2 * len(prompts), recomputed
    log = (server.log_dir / "scheduler.log").read_bytes()[mark:]
    assert b"refused" not in log and b"re-attached" in log, server.logs()
    record("shared_pool_kill_to_next_token_max", max(gaps))
    record("shared_pool_kill_to_next_token_min", min(gaps))
    record("shared_pool_tokens_recomputed", recomputed)


@pytest.mark.parametrize("roles", [("kv-holder",), ("kv-holder", "worker")])
async def test_a_killed_holder_costs_recompute_never_text(pool_server, roles):
    server = pool_server
    prompts = [f"Write a long story about a lighthouse keeper named Ada {i}." for i in range(4)]
    async with aiohttp.ClientSession() as session:
        calm, tasks = start_streams(session, server, [body(p, "h-calm", 64) for p in prompts])
        await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
        before = await asyncio.to_thread(server.metrics)
        salt = "h-" + "-".join(roles)
        streams, _ = await kill_mid_stream(
            session, server, [body(p, salt, 64) for p in prompts], roles
        )
        if roles == ("kv-holder",):  # the worker still maps the old pool: kill it now
            await wait_metrics(server, lambda m: m["nanoserve:num_requests_running"] == 0, 60.0)
            again, _ = await kill_mid_stream(
                session, server, [body(p, salt + "2", 64) for p in prompts], ("worker",)
            )
            streams += again
            calm = calm + calm
    for after, undisturbed in zip(streams, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text
    metrics = await assert_pool_empty(server)
    fallbacks = 'nanoserve:kv_pool_fallbacks_total{reason="new_pool"}'
    assert metrics.get(fallbacks, 0) > before.get(fallbacks, 0), server.logs()
    assert (
        metrics["nanoserve:kv_pool_reattaches_total"]
        == before["nanoserve:kv_pool_reattaches_total"]
    )


def running_blocks(run_id: str, timeout: float = 30.0) -> dict[str, list[int]]:
    """The running requests' block ids, from the scheduler's monitor feed (bounded)."""
    import msgspec
    import zmq

    from protocol.addresses import default_addresses
    from protocol.monitor import PoolSnapshot

    context = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(default_addresses(run_id).monitor)
    decoder = msgspec.msgpack.Decoder(PoolSnapshot)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if socket.poll(200):
                snapshot = decoder.decode(socket.recv())
                rows = {r.request_id: list(r.blocks) for r in snapshot.requests if r.running}
                if rows and all(rows.values()):
                    return rows
        raise AssertionError("no snapshot with running requests")
    finally:
        socket.close(0)


def flip_block(run_id: str, block: int, rank: int = 0) -> None:
    """Flip 64 bytes of ``block``'s K (layer 0, head 0) in the shared pool's file (of a
    tensor-parallel group: rank ``rank``'s pool)."""
    from holder.pool_file import pool_directory, pool_prefix
    from protocol.kv_pool import HEADER_BYTES, element_size, unpack_header

    def rank_of(path) -> int:
        with open(path, "rb") as pool:
            return unpack_header(pool.read(HEADER_BYTES))[0].rank

    [path] = [p for p in pool_directory().glob(pool_prefix(run_id) + "*") if rank_of(p) == rank]
    with open(path, "r+b") as pool:
        geometry, _, _ = unpack_header(pool.read(HEADER_BYTES))
        block_bytes = geometry.block_size * geometry.head_dim * element_size(geometry.dtype)
        offset = HEADER_BYTES + block * block_bytes  # (layer 0, K, head 0, block, ...)
        pool.seek(offset)
        data = bytes(b ^ 0xFF for b in pool.read(64))
        pool.seek(offset)
        pool.write(data)


async def test_a_corrupted_held_block_is_named_and_recomputed(pool_server):
    server = pool_server
    prompts = [long_prompt(10 + i, words=250) for i in range(4)]
    async with aiohttp.ClientSession() as session:
        calm, tasks = start_streams(session, server, [body(p, "c-calm") for p in prompts])
        await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
        before = await asyncio.to_thread(server.metrics)
        mark = server.log_size("scheduler")
        streams, tasks = start_streams(session, server, [body(p, "c-kill") for p in prompts])
        deadline = time.monotonic() + 300.0
        while not all(len(s.times) >= 3 for s in streams):
            assert time.monotonic() < deadline, server.logs()
            await asyncio.sleep(0.01)
        rows = await asyncio.to_thread(running_blocks, server.run_id)
        victim, blocks = next(iter(rows.items()))
        os.kill(server.child_pid("worker"), signal.SIGKILL)
        flip_block(server.run_id, blocks[0])  # before the new worker maps the pool
        await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
    for after, undisturbed in zip(streams, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text  # no token came from the flipped bytes
    log = (server.log_dir / "scheduler.log").read_bytes()[mark:].decode()
    assert f"KV block {blocks[0]} fails its checksum after the re-attach (held by {victim}" in (
        log
    ), server.logs()
    metrics = await assert_pool_empty(server)
    assert metrics["nanoserve:kv_pool_reattaches_total"] == (
        before["nanoserve:kv_pool_reattaches_total"] + 1
    )


def kept_rows(run_id: str, timeout: float = 30.0) -> dict[str, tuple[int, list[int]]]:
    """The running requests kept across a worker's death, as (tokens computed, block ids), from
    a snapshot the scheduler sent while it waits for the next worker (bounded)."""
    import msgspec
    import zmq

    from protocol.addresses import default_addresses
    from protocol.monitor import PoolSnapshot

    context = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(default_addresses(run_id).monitor)
    decoder = msgspec.msgpack.Decoder(PoolSnapshot)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if socket.poll(200):
                snapshot = decoder.decode(socket.recv())
                if snapshot.health is None or snapshot.health.worker != "lost":
                    continue
                rows = {r.request_id: (r.num_computed, list(r.blocks)) for r in snapshot.requests}
                return {rid: row for rid, row in rows.items() if row[1]}
        raise AssertionError("no snapshot while the worker was lost")
    finally:
        socket.close(0)


async def test_a_corrupted_slot_of_a_kept_partial_block_is_named_and_recomputed(pool_server):
    """Bytes flipped in slot 0 of a kept request's partial last block (K/V its answered steps
    wrote) are caught by the check of that block's slot ranges: the block, the request and the
    slots are named, the request is recomputed, and no token comes from the flipped bytes."""
    server = pool_server
    prompts = [long_prompt(50 + i, words=200 + 3 * i) for i in range(4)]
    async with aiohttp.ClientSession() as session:
        calm, tasks = start_streams(session, server, [body(p, "p-calm") for p in prompts])
        await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
        before = await asyncio.to_thread(server.metrics)
        mark = server.log_size("scheduler")
        streams, tasks = start_streams(session, server, [body(p, "p-kill") for p in prompts])
        deadline = time.monotonic() + 300.0
        while not all(len(s.times) >= 3 for s in streams):
            assert time.monotonic() < deadline, server.logs()
            await asyncio.sleep(0.01)
        os.kill(server.child_pid("worker"), signal.SIGKILL)
        rows = await asyncio.to_thread(kept_rows, server.run_id)  # rolled back: answered only
        size = 16
        partial = [(rid, n, blocks) for rid, (n, blocks) in rows.items() if n % size]
        assert partial, rows
        victim, computed, blocks = partial[0]
        block = blocks[computed // size]
        flip_block(server.run_id, block)  # its slot 0, before the new worker's check
        await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
    for after, undisturbed in zip(streams, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text  # no token came from the flipped bytes
    log = (server.log_dir / "scheduler.log").read_bytes()[mark:].decode()
    named = (
        rf"KV block {block} fails its checksum after the re-attach \(held by {victim}; slots 0 "
        r"to \d+ of its partial last block\): recomputing"
    )
    assert re.search(named, log), server.logs()
    metrics = await assert_pool_empty(server)
    assert metrics["nanoserve:kv_pool_reattaches_total"] == (
        before["nanoserve:kv_pool_reattaches_total"] + 1
    )


@pytest.mark.parametrize("change", [{"num_blocks": 96}, {"kv_cache_dtype": "float16"}])
def test_another_geometry_between_starts_falls_back_with_one_line(tmp_path, change):
    from tests.servers import start_server

    server = start_server(
        tmp_path, roles=("kv-holder", "worker"), shared_kv_pool=1, num_blocks=64, dtype="float32"
    )
    try:
        server.wait_log("worker", r"KV pool: shared pool \w+, generation 1", timeout=120.0)
        server.processes["worker"].send_signal(signal.SIGTERM)
        server.processes["worker"].wait(30.0)
        mark = server.log_size("worker")
        server.env.update({f"NANOSERVE_{k.upper()}": str(v) for k, v in change.items()})
        server.start("worker")
        server.wait_log("worker", r"model .* ready", mark, timeout=120.0)
        lines = [
            line
            for line in (server.log_dir / "worker.log").read_text()[mark:].splitlines()
            if "KV pool:" in line
        ]
        assert len(lines) == 1, lines
        assert "KV pool: private, not shared (geometry): the holder refused" in lines[0]
    finally:
        server.stop()


async def test_soak_with_worker_kills_at_random_steps(pool_server):
    """The worker dies three times at seeded random points of 8 streams (each kill lands in
    whatever step runs: often one that wrote part of a block); every stream ends with the
    undisturbed text, every audit passes, nothing leaks, and the tokens recomputed stay within
    the kills' steps in flight."""
    server = pool_server
    rng = random.Random(45)
    prompts = [long_prompt(20 + i, words=rng.randrange(60, 400)) for i in range(8)]
    async with aiohttp.ClientSession() as session:
        calm, tasks = start_streams(session, server, [body(p, "s-calm", 96) for p in prompts])
        await asyncio.wait_for(asyncio.gather(*tasks), 600.0)
        before = await asyncio.to_thread(server.metrics)
        streams, tasks = start_streams(session, server, [body(p, "s-kill", 96) for p in prompts])
        for _ in range(3):
            target = rng.randrange(4, 80)
            deadline = time.monotonic() + 300.0
            while max(len(s.times) for s in streams) < target:
                assert time.monotonic() < deadline, server.logs()
                await asyncio.sleep(rng.uniform(0.0, 0.05))
            if all(t.done() for t in tasks):
                break
            pid = server.child_pid("worker")
            os.kill(pid, signal.SIGKILL)
            server.child_pid("worker", other_than=pid, timeout=60.0)
            await wait_metrics(server, lambda m: m["nanoserve:worker_ready"] == 1, 120.0)
        await asyncio.wait_for(asyncio.gather(*tasks), 600.0)
    for after, undisturbed in zip(streams, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text
    metrics = await assert_pool_empty(server)
    kills = (
        metrics["nanoserve:scheduler_workers_lost_total"]
        - before["nanoserve:scheduler_workers_lost_total"]
    )
    reattached = (
        metrics["nanoserve:kv_pool_reattaches_total"] - before["nanoserve:kv_pool_reattaches_total"]
    )
    recomputed = (
        metrics["nanoserve:worker_restart_tokens_recomputed_total"]
        - before["nanoserve:worker_restart_tokens_recomputed_total"]
    )
    assert kills >= 1 and reattached == kills, server.logs()
    assert recomputed <= kills * 2 * len(prompts), recomputed
    record("shared_pool_soak_kills", kills)
    record("shared_pool_soak_tokens_recomputed", recomputed)
    record("shared_pool_soak_in_flight_bound", kills * 2 * len(prompts))


async def test_a_standby_takes_the_pool_over(tmp_path_factory):
    """--standby-workers 1: a second worker process, model loaded, waits; when the active one
    is SIGKILLed it takes the pool over and every stream's next token follows within a
    fraction of a second; the supervisor's restarted worker is the next standby."""
    from tests.servers import start_server

    server = start_server(
        tmp_path_factory.mktemp("standby"),
        roles=("kv-holder", *ROLES),
        supervised=SUPERVISED,
        audit=1,
        dtype="float32",
        shared_kv_pool=1,
        standby_workers=1,
        num_blocks=512,
        num_slots=16,
        threads=2,
    )
    try:
        server.start("worker", supervised=True, name="standby")
        server.wait_log("standby", "waiting to take the KV pool over", timeout=120.0)
        prompts = [long_prompt(30 + i, words=300) for i in range(8)]
        async with aiohttp.ClientSession() as session:
            calm, tasks = start_streams(session, server, [body(p, "calm") for p in prompts])
            await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
            streams, gaps = await kill_mid_stream(
                session, server, [body(p, "kill") for p in prompts], ("worker",)
            )
        for after, undisturbed in zip(streams, calm, strict=True):
            assert after.done and not after.errors, after.errors
            assert after.text == undisturbed.text
        server.wait_log("standby", "KV pool: shared pool \\w+, generation 2", timeout=10.0)
        server.wait_log("worker", "waiting to take the KV pool over", timeout=120.0)
        metrics = await assert_pool_empty(server)
        assert metrics["nanoserve:kv_pool_reattaches_total"] == 1, server.logs()
        # The scheduler's own view: from the death (as it learned it) to each stream's token.
        assert metrics["nanoserve:worker_death_to_token_seconds_count"] == len(prompts)
        assert 0 < metrics["nanoserve:worker_death_to_token_seconds_last_max"] <= max(gaps)
        record("standby_kill_to_next_token_max", max(gaps))
        record("standby_kill_to_next_token_min", min(gaps))
        print("\nstandby, float32: SIGKILL to next token of each stream (s):", sorted(gaps))
    finally:
        server.stop()
