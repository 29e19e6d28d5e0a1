"""``nanoserve bench forward``: the worker's prefill tokens/s and decode step time."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``forward`` under ``nanoserve bench``."""
    parser = subparsers.add_parser(
        "forward", help="prefill tokens/s and decode step time of the model forward"
    )
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    parser.add_argument("--batch-sizes", default="1,8,32,64", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--decode-steps", type=int, default=4, help="decode steps to average")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--q4-max-tokens",
        type=int,
        default=8,
        help="steps of at most this many tokens run on the GGUF's 4-bit weights (bfloat16, CPU)",
    )
    parser.add_argument(
        "--w4a8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bigger steps on the same 4-bit weights times 8-bit activations, as `nanoserve "
        "worker --w4a8` (default on)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run small decode steps compiled, as `nanoserve worker --compile` (CPU)",
    )
    parser.add_argument(
        "--generic-path",
        action="store_true",
        help="run the code CUDA runs, as `nanoserve worker --generic-path`",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also print where each decode step's time goes"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a Markdown table."""
    from nanoserve.bench.forward import bench_forward, format_breakdown, format_table

    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes must be integers, got {args.batch_sizes!r}") from None
    if args.context < 1 or args.decode_steps < 1 or min(batch_sizes) < 1:
        raise ValueError("--context, --decode-steps and --batch-sizes must be positive")
    if args.q4_max_tokens < 0:
        raise ValueError("--q4-max-tokens must be >= 0")
    rows = bench_forward(
        model=args.model,
        dtypes=[d.strip() for d in args.dtypes.split(",")],
        batch_sizes=batch_sizes,
        context=args.context,
        decode_steps=args.decode_steps,
        num_threads=args.threads,
        q4_max_tokens=args.q4_max_tokens,
        w4a8=args.w4a8,
        compile=args.compile,
        generic_path=args.generic_path,
        profile=args.profile,
    )
    print(format_table(rows, args.context))
    if args.profile:
        print()
        print(format_breakdown(rows))
    return 0
