"""``nanoserve bench tp``: decode step time and all-reduce cost at tensor-parallel sizes."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``tp`` under ``nanoserve bench``."""
    parser = subparsers.add_parser(
        "tp", help="decode step time and all-reduce cost of a worker split across ranks"
    )
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sizes", default="1,3", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--batch", type=int, default=8, help="rows decoded per step")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps to time")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a Markdown table."""
    from nanoserve.bench.tp import bench_tp, format_table

    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        raise ValueError(f"--sizes must be integers, got {args.sizes!r}") from None
    if min(sizes) < 1 or min(args.batch, args.context, args.decode_steps) < 1:
        raise ValueError("--sizes, --batch, --context and --decode-steps must be positive")
    if max(sizes) > 1:
        from worker.config import WorkerConfig
        from worker.parallel.ranks import check_fits

        for size in sizes:
            check_fits(WorkerConfig(model=args.model), size)
    rows = bench_tp(
        model=args.model,
        dtype=args.dtype,
        sizes=sizes,
        batch=args.batch,
        context=args.context,
        steps=args.decode_steps,
    )
    print(format_table(rows, args.batch))
    return 0
