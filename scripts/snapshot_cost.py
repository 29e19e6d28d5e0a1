"""What one web-page snapshot costs the scheduler, and the frontend's share, on the model-free
SimWorker: a 5,825-block pool of 16-token blocks (the default model's pool on this machine) at
concurrency 32 (128-token prompts, 64 to 128 tokens out), after enough steps that requests have
come and gone and the pool is fragmented.

    python scripts/snapshot_cost.py [--steps 600] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import timeit
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from frontend.pool_runs import pool_runs  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402 - after the path setup above
from protocol.monitor import PoolSnapshot  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.sim_worker import SimWorker  # noqa: E402
from scheduler.snapshot import pool_states, request_rows  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=5825)
    args = parser.parse_args()
    rng = random.Random(0)
    worker = SimWorker(args.num_blocks, 16, args.concurrency, vocab_size=32000)
    engine = Engine.for_worker(worker, SchedulerConfig(token_budget=2048))
    added = 0
    for _ in range(args.steps):
        s = engine.scheduler
        for _ in range(args.concurrency - len(s.running) - len(s.waiting)):
            prompt = [rng.randrange(32000) for _ in range(128)]
            params = SamplingParams(max_tokens=rng.randint(64, 128), ignore_eos=True)
            engine.add_request(f"r{added}", prompt, params)
            added += 1
        engine.step()
    s = engine.scheduler
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(PoolSnapshot)
    now = time.monotonic()

    def scheduler_side() -> bytes:
        pool = pool_states(s.allocator, s.watermark_blocks)
        rows = request_rows(s.running, s.waiting, now)
        return encoder.encode(PoolSnapshot(pool=pool, requests=rows))

    def frontend_side() -> None:
        snapshot = decoder.decode(payload)
        pool_runs(snapshot.pool, snapshot.requests)

    payload = scheduler_side()
    held = s.allocator.num_blocks - s.allocator.num_free
    print(
        f"{len(s.running)} running, {held} held and {len(s.allocator.eviction_queue)} "
        f"cached-free blocks of {s.allocator.num_blocks}; a snapshot is {len(payload)} bytes"
    )
    for name, job in (
        ("scheduler: build and encode", scheduler_side),
        ("frontend: runs", frontend_side),
    ):
        seconds = min(timeit.repeat(job, number=200, repeat=5)) / 200
        print(f"{name:28s} {seconds * 1e6:7.1f} us per snapshot (best of 5 x 200)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
