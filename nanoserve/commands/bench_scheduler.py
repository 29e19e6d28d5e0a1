"""``nanoserve bench scheduler``: with 256 running requests, the time of one schedule() and of
planning one step, and the scheduler loop's CPU per output token; then one full audit of a
100k-block pool with shared and cached blocks (torch-free, no model, prefix caching on as
served). ``--audit-blocks 0`` leaves the audit out."""

from __future__ import annotations

import argparse
import statistics
import time

from protocol.messages import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the command."""
    p = subparsers.add_parser("scheduler", help="time schedule() and the audit")
    p.add_argument("--running", type=int, default=256, help="running requests for schedule()")
    p.add_argument(
        "--audit-blocks", type=int, default=100_000, help="pool size for the audit (0: no audit)"
    )
    p.add_argument("--repeats", type=int, default=20, help="timings of schedule() and plan()")
    p.add_argument("--steps", type=int, default=200, help="steps of the loop's CPU measurement")
    p.set_defaults(func=run)


def _steady_scheduler(num_requests: int, num_blocks: int, block_size: int, prompt_len: int):
    """A scheduler with ``num_requests`` running and decoding (fake samples, no worker)."""
    from scheduler.block_allocator import BlockAllocator
    from scheduler.scheduler import Scheduler

    sched = Scheduler(
        BlockAllocator(num_blocks, block_size),
        num_slots=num_requests,
        token_budget=max(8192, num_requests * prompt_len),
        watermark_blocks=0,
    )
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(f"r{i}", [1 + i % 50] * (prompt_len + i % block_size), params)
    _apply(sched, sched.schedule())
    return sched


def _apply(sched, batch) -> None:
    for chunk in batch.chunks:
        if chunk.sample:
            sched.on_sampled(chunk.request, 11)


def time_schedule(num_requests: int, repeats: int) -> float:
    """Median seconds of one schedule() in steady decode with ``num_requests`` running."""
    sched = _steady_scheduler(num_requests, num_requests * 64, 16, 100)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        batch = sched.schedule()
        times.append(time.perf_counter() - began)
        _apply(sched, batch)
    if len(sched.running) != num_requests:
        raise RuntimeError("the benchmark's requests were meant to keep running")
    return statistics.median(times)


def time_audit(num_blocks: int, repeats: int) -> tuple[float, int, int, int]:
    """Median seconds of one full audit (pool, cache, slots, requests) of a ``num_blocks`` pool
    that is about three quarters held by 256 requests whose first quarter is one shared prefix,
    beside cached-free blocks of finished requests; and the held, shared and cached counts."""
    from scheduler.audit import audit_all
    from scheduler.block_allocator import BlockAllocator
    from scheduler.scheduler import Scheduler

    block_size, requests = 16, 256
    per_request = (num_blocks * 3 // 4) // requests
    sched = Scheduler(BlockAllocator(num_blocks, block_size), requests, 1 << 20, 0)
    _finish_all(sched, num_requests=64, blocks_each=num_blocks // 10 // 64, salt="finished")
    shared = [7] * (per_request // 4 * block_size)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    sched.add_request("first", shared + [1], params)
    _apply(sched, sched.schedule())  # its blocks are offered to the index: the rest hit them
    for i in range(requests - 1):
        tail = [100 + i] * ((per_request - len(shared) // block_size) * block_size - 15)
        sched.add_request(f"r{i}", shared + tail, params)
    while sched.waiting:
        _apply(sched, sched.schedule())
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        audit_all(sched)
        times.append(time.perf_counter() - began)
    alloc = sched.allocator
    num_shared = sum(1 for count in alloc.ref_counts.values() if count > 1)
    held = num_blocks - alloc.num_free
    return statistics.median(times), held, num_shared, alloc.num_cached


def _finish_all(sched, num_requests: int, blocks_each: int, salt: str) -> None:
    """Run requests to their end, so their full blocks stay cached and free."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    size = sched.allocator.block_size
    for i in range(num_requests):
        sched.add_request(f"{salt}-{i}", [3 + i] * (blocks_each * size + 1), params, salt)
    while sched.waiting:
        batch = sched.schedule()
        for chunk in batch.chunks:
            if chunk.sample:
                reason = sched.on_sampled(chunk.request, 11)
                if reason:
                    sched.finish(chunk.request, reason)


def run(args: argparse.Namespace) -> int:
    """Print the figures."""
    from nanoserve.bench.scheduler_loop import loop_cpu_per_token, time_plan

    if args.running < 1 or args.repeats < 1 or args.steps < 1:
        raise ValueError("need --running >= 1, --repeats >= 1, --steps >= 1")
    if args.audit_blocks and args.audit_blocks < 1024:
        raise ValueError("need --audit-blocks >= 1024, or 0 for no audit")
    n = args.running
    schedule_s = time_schedule(n, args.repeats)
    print(f"schedule() with {n} running requests: {schedule_s * 1e3:.3f} ms")
    plan_s = time_plan(n, args.repeats)
    print(f"plan a step (Engine.plan) with {n} running: {plan_s * 1e3:.3f} ms (aim < 1 ms)")
    cost = loop_cpu_per_token(n, args.steps)
    print(
        f"scheduler loop CPU per output token with {n} running: {cost.per_token_us:.2f} us "
        f"({cost.cpu_s / cost.steps * 1e3:.3f} ms a step over {cost.steps} steps)"
    )
    if args.audit_blocks:
        audit_s, held, shared, cached = time_audit(args.audit_blocks, max(3, args.repeats // 4))
        print(
            f"full audit of a {args.audit_blocks}-block pool ({held} held, {shared} shared, "
            f"{cached} cached): {audit_s * 1e3:.2f} ms (aim < 20 ms)"
        )
    return 0
