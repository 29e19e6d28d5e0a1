"""Time the Triton attention backend against the torch one, one layer's call, on a CUDA GPU.

A GPU check, not a CI one: on a machine without a GPU (or without triton) it exits 2 with a
one-line error. Shapes are Llama-3.2-1B's heads (32 query heads, 8 KV heads, head_dim 64) over
a pool of blocks of 16, each row's blocks shuffled through the pool:

- decode: batches of 1, 32 and 256 rows, each with ``--context`` cached positions;
- mixed: 32 decodes beside 4 chunked prefills of 256 tokens after a 512-token cached prefix.

Each case is one ``AttentionBackend.forward`` (the K/V write and the attention), timed by
``triton.testing.do_bench`` (median of its repetitions, CUDA events), and the largest
difference between the two backends' outputs:

    python scripts/bench_attention.py [--dtype bfloat16] [--context 1024]

A whole step's effect is ``nanoserve bench forward`` on a CUDA worker, whose plan runs Triton's
attention, against the same with ``--generic-path`` (torch's).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from worker.config import WorkerConfig  # noqa: E402
from worker.plan import resolve_device, triton_runs  # noqa: E402

N_HEADS, N_KV, HEAD_DIM, BLOCK = 32, 8, 64, 16


def case_items(decodes: int, context: int, spans: int, num_blocks: int, seed: int):
    """``(block_table, start, new)`` per item: ``decodes`` rows on ``context`` cached positions,
    then ``spans`` chunks of 256 after 512 cached, on shuffled blocks of the pool."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shapes = [(context, 1)] * decodes + [(512, 256)] * spans
    items = []
    for start, new in shapes:
        used = -(-(start + new) // BLOCK)
        items.append(([free.pop() for _ in range(used)], start, new))
    return items


def run_case(name: str, items, dtype: torch.dtype, backends: dict, cache) -> None:
    """Time each backend's forward over ``items`` and print one line."""
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    triton_backend = backends["triton"]
    meta = triton_backend.metadata(items, trash_block=cache.trash_block)
    tokens = meta.num_tokens
    qkv = torch.randn(tokens, N_HEADS + 2 * N_KV, HEAD_DIM, generator=gen, device="cuda")
    qkv = qkv.to(dtype)
    q, kv = qkv[:, :N_HEADS], qkv[:, N_HEADS:].view(tokens, 2, N_KV, HEAD_DIM)
    layer = cache.layer(0)
    real = sum(new for _, _, new in items)
    outs, times = {}, {}
    for label, backend in backends.items():
        outs[label] = backend.forward(q, kv, layer, meta, cache.scratch)[:real].float()
        times[label] = do_bench(lambda b=backend: b.forward(q, kv, layer, meta, cache.scratch))
    worst = (outs["triton"] - outs["torch"]).abs().max().item()
    speedup = times["torch"] / times["triton"]
    print(
        f"{name:<28} torch {times['torch'] * 1e3:9.1f} us   triton {times['triton'] * 1e3:9.1f} us"
        f"   x{speedup:5.2f}   max |diff| {worst:.2e}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--context", type=int, default=1024, help="decode rows' cached positions")
    args = parser.parse_args()
    if resolve_device(WorkerConfig(device="auto")) != "cuda" or not triton_runs("cuda"):
        print("bench_attention: needs a CUDA GPU and triton; this machine has not", file=sys.stderr)
        return 2
    from worker.attention import TorchBackend
    from worker.attention.triton_backend import TritonBackend
    from worker.kv.cache import KVCache

    dtype = getattr(torch, args.dtype)
    geometry = dict(
        n_heads=N_HEADS,
        n_kv_heads=N_KV,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        dtype=dtype,
        device="cuda",
    )
    backends = {"torch": TorchBackend(**geometry), "triton": TritonBackend(**geometry)}
    per_row = -(-(args.context + 1) // BLOCK)
    num_blocks = 256 * per_row + 4 * (768 // BLOCK) + 64
    cache = KVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=BLOCK,
        n_kv_heads=N_KV,
        head_dim=HEAD_DIM,
        dtype=dtype,
        device="cuda",
        pool="device",
    )
    cache.pool.normal_()
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, heads {N_HEADS}/{N_KV}x{HEAD_DIM}")
    for batch in (1, 32, 256):
        items = case_items(batch, args.context, 0, num_blocks, seed=batch)
        run_case(f"decode B={batch} ctx={args.context}", items, dtype, backends, cache)
    items = case_items(32, args.context, 4, num_blocks, seed=7)
    run_case("mixed 32 decodes + 4x256", items, dtype, backends, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
