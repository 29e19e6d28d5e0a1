"""``nanoserve bench forward``: prefill throughput and decode step time of the worker alone.

For each dtype and batch size B: one step prefills B requests of ``context`` tokens (tokens/s),
then ``decode_steps`` steps decode one token for each of the B rows (median seconds per step,
after one warm-up step). With ``profile``, torch.profiler records the decode steps and
``worker.bench_profile`` sums their operators into a per-step breakdown.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace

from nanoserve.bench.floor import BANDWIDTH, Floor, read_bandwidth, step_floor
from protocol.blocks import blocks_for
from protocol.messages import SamplingParams, StepInput, StepItem

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class BenchRow:
    """One line of the table."""

    dtype: str
    batch: int
    prefill_tokens_per_s: float
    decode_step_s: float
    breakdown: dict[str, float] | None = None  # category -> ms per decode step
    floor: Floor | None = None  # with the breakdown: the bytes the step must stream


def bench_forward(
    *,
    model: str | None,
    dtypes: list[str],
    batch_sizes: list[int],
    context: int,
    decode_steps: int = 4,
    num_threads: int | None = None,
    q4_max_tokens: int = 8,
    w4a8: bool = True,
    compile: bool = False,
    generic_path: bool = False,
    profile: bool = False,
) -> list[BenchRow]:
    """Run the benchmark; returns one BenchRow per (dtype, batch size)."""
    from worker.config import WorkerConfig
    from worker.worker import Worker

    bandwidth: float | None = None  # measured once, on the first worker's plan's device
    largest, block_size = max(batch_sizes), 16
    blocks_per_row = blocks_for(context + 2 * decode_steps + 2, block_size)
    rows = []
    for dtype in dtypes:
        config = WorkerConfig(
            model=model,
            dtype=dtype,
            num_blocks=largest * blocks_per_row,
            num_slots=largest,
            block_size=block_size,
            num_threads=num_threads,
            q4_max_tokens=q4_max_tokens,
            w4a8=w4a8,
            compile=compile,
            generic_path=generic_path,
            max_model_len=max(context + 2 * decode_steps + 2, block_size),
        )
        worker = Worker(config, progress=False)
        vocab = worker.spec.vocab_size
        for batch in batch_sizes:
            row = _one(worker, dtype, batch, context, decode_steps, blocks_per_row, vocab, profile)
            if profile:
                device = worker.plan.device
                if bandwidth is None:
                    bandwidth = read_bandwidth(device)
                kv_dtype = worker.plan.torch_kv_dtype
                floor = step_floor(worker.model, batch, context, kv_dtype, bandwidth)
                row = replace(row, floor=replace(floor, measured=BANDWIDTH[device][1]))
            rows.append(row)
        worker.close()
    return rows


def _one(worker, dtype, batch, context, decode_steps, blocks_per_row, vocab, profile) -> BenchRow:
    began = time.perf_counter()
    result = worker.execute(prefill_step(batch, context, blocks_per_row, vocab))
    prefill_s = time.perf_counter() - began
    decoder = DecodeLoop(worker, batch, context, result)
    decoder.step()  # warm-up: first-touch of scratch buffers
    times = [decoder.step() for _ in range(decode_steps)]
    breakdown = None
    if profile:
        breakdown = profile_steps(decoder.step, decode_steps)
    released = StepInput(step_id=decoder.step_id + 1, items=[], released_slots=list(range(batch)))
    worker.execute(released)
    return BenchRow(dtype, batch, batch * context / prefill_s, statistics.median(times), breakdown)


def prefill_step(batch: int, context: int, blocks_per_row: int, vocab: int) -> StepInput:
    """Step 0: ``batch`` fresh rows of ``context`` seeded random tokens each, in slots 0.."""
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
            fresh=True,
        )
        for i in range(batch)
    ]
    return StepInput(step_id=0, items=items)


class DecodeLoop:
    """Feeds each row its last sampled token, one decode step per call."""

    def __init__(self, worker, batch: int, context: int, result) -> None:
        self.worker, self.batch, self.position, self.step_id = worker, batch, context, 0
        self.tokens = {s.request_id: s.token_id for s in result.samples}

    def step(self) -> float:
        """Run one decode step for every row; returns its wall time in seconds."""
        items = [
            StepItem(
                request_id=f"b{i}",
                slot=i,
                new_blocks=[],
                token_ids=[self.tokens[f"b{i}"]],
                start=self.position,
            )
            for i in range(self.batch)
        ]
        self.step_id += 1
        began = time.perf_counter()
        result = self.worker.execute(StepInput(step_id=self.step_id, items=items))
        elapsed = time.perf_counter() - began
        self.tokens = {s.request_id: s.token_id for s in result.samples}
        self.position += 1
        return elapsed


# Operator name fragments -> the breakdown's categories, first match wins.
CATEGORIES = (
    (
        "linear (weights)",
        (
            "linear_pointwise",
            "int4pack",
            "q4_linear",
            "w4a8_linear",
            "q4a8_linear",
            "aten::mm",
            "aten::addmm",
        ),
    ),
    ("attention: nanoserve kernel", ("decode_attention",)),
    ("attention: gather K/V", ("index_select",)),
    ("attention: matmuls + softmax", ("bmm", "softmax", "scaled_dot_product")),
    ("cache write", ("index_copy",)),
    ("sampling (argmax)", ("argmax", "topk", "sort")),
    ("norms", ("rms_norm",)),
    ("dtype copies", ("copy_", "_to_copy")),
)


def profile_steps(step, steps: int) -> dict[str, float]:
    """Run ``step`` under torch.profiler; returns ms per step by category: operators' self CPU
    time, plus "python + dispatch" for the wall time no operator accounts for."""
    from torch.profiler import ProfilerActivity, profile

    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wall_ms = (time.perf_counter() - began) * 1000 / steps
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        name = next(
            (label for label, keys in CATEGORIES if any(k in event.key for k in keys)),
            "other operators",
        )
        totals[name] = totals.get(name, 0.0) + event.self_cpu_time_total / 1000 / steps
    totals["python + dispatch"] = max(0.0, wall_ms - sum(totals.values()))
    return totals


def format_breakdown(rows: list[BenchRow]) -> str:
    """A Markdown table: one column per profiled (dtype, batch), ms per decode step."""
    profiled = [row for row in rows if row.breakdown]
    if not profiled:
        return ""
    names = [label for label, _ in CATEGORIES] + ["other operators", "python + dispatch"]
    head = "| ms per decode step | " + " | ".join(f"{r.dtype} b{r.batch}" for r in profiled)
    lines = [head + " |", "|---|" + "---:|" * len(profiled)]
    for name in names:
        cells = " | ".join(f"{r.breakdown.get(name, 0.0):.1f}" for r in profiled)
        lines.append(f"| {name} | {cells} |")
    floors = [(r, r.floor) for r in profiled if r.floor is not None]
    if len(floors) == len(profiled):
        mb = 1 << 20
        gbs = profiled[0].floor.bandwidth / 1e9
        lines.append(
            "| MiB a step must read: linears + lm head + K/V | "
            + " | ".join(
                f"{f.linears / mb:.1f} + {f.head / mb:.1f} + {f.kv / mb:.1f}" for _, f in floors
            )
            + " |"
        )
        lines.append(
            f"| floor at {gbs:.1f} GB/s ({profiled[0].floor.measured}) | "
            + " | ".join(f"{f.seconds * 1000:.1f}" for _, f in floors)
            + " |"
        )
        lines.append(
            "| the step (unprofiled median) against its floor | "
            + " | ".join(f"{r.decode_step_s / f.seconds:.1f}x" for r, f in floors)
            + " |"
        )
    return "\n".join(lines)


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
