"""``nanoserve bench forward``: prefill throughput and decode step time of the worker alone.

For each dtype and batch size B: one step prefills B requests of ``context`` tokens (tokens/s),
then ``decode_steps`` steps decode one token for each of the B rows (mean seconds per step).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from protocol.messages import SamplingParams, StepInput, StepItem

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class BenchRow:
    """One line of the table."""

    dtype: str
    batch: int
    prefill_tokens_per_s: float
    decode_step_s: float


def bench_forward(
    *,
    model: str | None,
    dtypes: list[str],
    batch_sizes: list[int],
    context: int,
    decode_steps: int = 4,
    num_threads: int | None = None,
) -> list[BenchRow]:
    """Run the benchmark; returns one BenchRow per (dtype, batch size)."""
    from worker.config import WorkerConfig
    from worker.worker import Worker

    largest, block_size = max(batch_sizes), 16
    blocks_per_row = -(-(context + decode_steps + 1) // block_size)
    rows = []
    for dtype in dtypes:
        config = WorkerConfig(
            model=model,
            dtype=dtype,
            num_blocks=largest * blocks_per_row,
            num_slots=largest,
            block_size=block_size,
            num_threads=num_threads,
            max_model_len=max(context + decode_steps + 1, block_size),
        )
        worker = Worker(config, progress=False)
        vocab = worker.spec.vocab_size
        for batch in batch_sizes:
            rows.append(_one(worker, dtype, batch, context, decode_steps, blocks_per_row, vocab))
    return rows


def _one(worker, dtype, batch, context, decode_steps, blocks_per_row, vocab) -> BenchRow:
    rng = random.Random(batch)
    items = [
        StepItem(
            request_id=f"b{i}",
            slot=i,
            new_blocks=list(range(i * blocks_per_row, (i + 1) * blocks_per_row)),
            token_ids=[rng.randrange(vocab) for _ in range(context)],
            start=0,
            params=GREEDY,
            prompt_len=context,
        )
        for i in range(batch)
    ]
    began = time.perf_counter()
    result = worker.execute(StepInput(step_id=0, items=items))
    prefill_s = time.perf_counter() - began
    tokens = {s.request_id: s.token_id for s in result.samples}
    decode_s = 0.0
    for step in range(decode_steps):
        decodes = [
            StepItem(
                request_id=f"b{i}",
                slot=i,
                new_blocks=[],
                token_ids=[tokens[f"b{i}"]],
                start=context + step,
            )
            for i in range(batch)
        ]
        began = time.perf_counter()
        result = worker.execute(StepInput(step_id=step + 1, items=decodes))
        decode_s += time.perf_counter() - began
        tokens = {s.request_id: s.token_id for s in result.samples}
    worker.execute(StepInput(step_id=decode_steps + 1, items=[], released_slots=list(range(batch))))
    return BenchRow(dtype, batch, batch * context / prefill_s, decode_s / decode_steps)


def format_table(rows: list[BenchRow], context: int) -> str:
    """A Markdown table of the results."""
    lines = [
        f"| dtype | batch | prefill tokens/s ({context}-token prompts) | decode step (ms) |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.dtype} | {row.batch} | {row.prefill_tokens_per_s:,.0f} "
            f"| {row.decode_step_s * 1000:.1f} |"
        )
    return "\n".join(lines)
