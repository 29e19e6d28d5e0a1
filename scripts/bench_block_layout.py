"""Where the KV blocks land over a server's life, and what it costs: ``BlockAllocator``'s placement
against an older revision's.

Runs the real scheduler on the model-free SimWorker with the README's pool (11,650 blocks of 16,
128 slots), seeded:

- **life**: 32 requests in flight at all times, random prompts of 20-600 tokens and 10-400
  output tokens, for ``--steps`` steps (long enough that every free block ends up cached, as
  in a long-running server); then the share of adjacent block pairs among the running
  requests, and (``--attention``) the worker's decode attention over their block tables for
  30 layers, in bfloat16, against the same lengths on adjacent blocks;
- **chat**: ``--conversations`` multi-turn conversations, 32 at a time, each turn the whole
  history plus 10-100 new tokens, 20-200 tokens out, ``--turns`` turns each; the share of
  prompt tokens the prefix cache served (placement must not cost cache hits).

``--against REV`` adds the allocator of git revision REV; the one before adjacent placement,
first-in first-out and then least recently freed, is named by its successor's message:

    python scripts/bench_block_layout.py --attention --against 'HEAD^{/keeps a request.s blocks}~1'
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol.messages import SamplingParams  # noqa: E402
from scheduler.block_allocator import BlockAllocator  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.sim_worker import SimWorker  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, SLOTS, VOCAB = 11_650, 16, 128, 49_152


def allocator_at(revision: str) -> type:
    """``BlockAllocator`` as ``revision`` wrote it, ignoring the current one's hints."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:scheduler/block_allocator.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_block_allocator.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_block_allocator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Old(module.BlockAllocator):
        def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
            return super().allocate(n)

    return Old


def engine(allocator: type) -> Engine:
    worker = SimWorker(NUM_BLOCKS, BLOCK_SIZE, SLOTS, max_model_len=8192, vocab_size=VOCAB)
    config = SchedulerConfig(token_budget=2048, watermark_blocks=0, audit=False)
    return Engine.for_worker(worker, config, allocator=allocator(NUM_BLOCKS, BLOCK_SIZE))


def life(allocator: type, steps: int, seed: int = 0) -> list[list[int]]:
    """The running requests' block tables after ``steps`` steps of churn."""
    rng, eng, n = random.Random(seed), engine(allocator), 0
    for _ in range(steps):
        while len(eng.scheduler.running) + len(eng.scheduler.waiting) < 32:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(20, 600))]
            params = SamplingParams(
                max_tokens=rng.randint(10, 400), temperature=0.0, ignore_eos=True
            )
            eng.add_request(f"r{n}", prompt, params)
            n += 1
        eng.step()
    return [list(r.block_ids) for r in eng.scheduler.running]


def adjacent_share(tables: list[list[int]]) -> float:
    pairs = sum(len(t) - 1 for t in tables)
    return sum(b == a + 1 for t in tables for a, b in zip(t, t[1:], strict=False)) / max(pairs, 1)


def chat(allocator: type, conversations: int, turns: int, seed: int = 0) -> float:
    """The share of prompt tokens the prefix cache served."""
    rng, eng, n = random.Random(seed), engine(allocator), 0
    history = {
        c: [rng.randrange(VOCAB) for _ in range(rng.randint(50, 400))] for c in range(conversations)
    }
    done = dict.fromkeys(range(conversations), 0)
    active: dict[str, tuple[int, list[int], list[int]]] = {}
    prompt_tokens = cached = 0
    while True:
        busy = {c for c, _, _ in active.values()}
        ready = [c for c in range(conversations) if c not in busy and done[c] < turns]
        while len(active) < 32 and ready:
            c = ready.pop(rng.randrange(len(ready)))
            prompt = history[c] + [rng.randrange(VOCAB) for _ in range(rng.randint(10, 100))]
            if len(prompt) > 6000:
                done[c] = turns
                continue
            params = SamplingParams(
                max_tokens=rng.randint(20, 200), temperature=0.0, ignore_eos=True
            )
            eng.add_request(f"r{n}", prompt, params)
            active[f"r{n}"] = (c, prompt, [])
            n += 1
        if not active:
            return cached / prompt_tokens
        for out in eng.step():
            active[out.request_id][2].extend(out.new_token_ids)
            if out.finish_reason:
                c, prompt, generated = active.pop(out.request_id)
                prompt_tokens += len(prompt)
                cached += out.num_cached_tokens
                history[c] = prompt + generated
                done[c] += 1


def attention_ms(tables: list[list[int]]) -> float:
    """The worker's decode attention over ``tables`` (one row each, every block full but the
    last token), 30 layers of SmolLM2's shape in bfloat16: median ms of 15."""
    import torch

    from worker.cpu import kernels

    if not kernels.available():
        raise SystemExit("--attention needs the worker's CPU kernels (AVX512-BF16)")
    torch.manual_seed(0)
    layers, kv_heads, head_dim, q_heads = 30, 3, 64, 9
    pool = torch.empty((layers, 2, kv_heads, NUM_BLOCKS + 1, BLOCK_SIZE, head_dim))
    pool = pool.bfloat16().normal_()
    views = [pool[i].view(2, kv_heads, -1, head_dim) for i in range(layers)]
    blocks = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.long)
    for i, table in enumerate(tables):
        blocks[i, : len(table)] = torch.tensor(table)
    cached = torch.tensor([len(t) * BLOCK_SIZE - 1 for t in tables])
    q = torch.randn(len(tables), q_heads, head_dim).bfloat16()
    kv = torch.randn(len(tables), 2, kv_heads, head_dim).bfloat16()
    times = []
    for _ in range(16):
        began = time.perf_counter()
        for view in views:
            torch.ops.nanoserve.decode_attention(q, kv, view, blocks, cached, BLOCK_SIZE)
        times.append(time.perf_counter() - began)
    return sorted(times[1:])[7] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a git revision whose BlockAllocator to compare")
    parser.add_argument("--steps", type=int, default=30_000, help="life: scheduler steps")
    parser.add_argument("--conversations", type=int, default=150)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--attention", action="store_true", help="also time decode attention")
    args = parser.parse_args()
    runs = [("HEAD", BlockAllocator)]
    if args.against:
        runs.insert(0, (args.against, allocator_at(args.against)))
    for name, allocator in runs:
        tables = life(allocator, args.steps)
        line = f"{name}: life: {adjacent_share(tables):.1%} of block pairs adjacent"
        if args.attention:
            start, packed = 0, []
            for table in tables:
                packed.append(list(range(start, start + len(table))))
                start += len(table)
            line += (
                f", attention {attention_ms(tables):.2f} ms a step"
                f" ({attention_ms(packed):.2f} on adjacent blocks)"
            )
        share = chat(allocator, args.conversations, args.turns)
        print(f"{line}; chat: the prefix cache served {share:.1%} of prompt tokens", flush=True)


if __name__ == "__main__":
    main()
