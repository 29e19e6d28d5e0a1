"""``nanoserve sweep-watermark``: one workload through several watermark reserves (no model)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the command."""
    p = subparsers.add_parser("sweep-watermark", help="measure what the admission reserve moves")
    p.add_argument("--reserves", default="0,1,2,3", help="comma-separated reserve sizes (blocks)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--num-slots", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=8)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--token-budget", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the sweep table (tab-separated)."""
    from nanoserve.bench.watermark import TABLE_HEADER, sweep_watermarks

    try:
        reserves = [int(x) for x in args.reserves.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--reserves must be comma-separated integers, got {args.reserves!r}"
        ) from None
    points = sweep_watermarks(
        reserves,
        num_requests=args.requests,
        num_slots=args.num_slots,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        token_budget=args.token_budget,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    print(
        f"{args.requests} requests, {args.num_slots} slots, {args.num_blocks} blocks of "
        f"{args.block_size}, budget {args.token_budget}"
    )
    print(TABLE_HEADER)
    for point in points:
        print(point.row())
    return 0
