"""``nanoserve soak``: many requests through a small pool on the real worker, audited every
iteration. ``--inject-leak N`` drops one block id on the N-th release to prove the audit."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the command."""
    from nanoserve.commands.generate import add_worker_flags

    p = subparsers.add_parser("soak", help="audited stress run through a small KV pool")
    add_worker_flags(p, num_blocks=10, block_size=4, num_slots=3, token_budget=16)
    p.add_argument("--watermark-blocks", type=int, default=0)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=9)
    p.add_argument(
        "--shared-prefix-blocks",
        type=int,
        default=0,
        metavar="N",
        help="every prompt opens with the same N blocks of tokens (before --prompt-len more)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share cached full blocks between requests (default: on)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: up to K n-gram draft tokens per request and step (0: off)",
    )
    p.add_argument(
        "--inject-leak",
        type=int,
        default=None,
        metavar="N",
        help="drop one block id on the N-th release (the audit must catch it)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the soak; print the report, or the InvariantViolation as one line and exit 1."""
    from nanoserve.commands.generate import make_worker
    from protocol.messages import SamplingParams
    from scheduler.audit import InvariantViolation
    from scheduler.config import SchedulerConfig
    from scheduler.soak import LeakyAllocator, make_prompts, soak

    if args.requests < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        raise ValueError("--requests, --prompt-len and --max-tokens must be >= 1")
    if args.shared_prefix_blocks < 0:
        raise ValueError("--shared-prefix-blocks must be >= 0")
    config = SchedulerConfig(
        token_budget=args.token_budget,
        watermark_blocks=args.watermark_blocks,
        audit=True,
        enable_prefix_caching=args.enable_prefix_caching,
        speculative="ngram" if args.num_speculative_tokens else "off",
        num_speculative_tokens=args.num_speculative_tokens,
    )
    worker = make_worker(args)
    ready = worker.ready()
    allocator = None
    if args.inject_leak is not None:
        allocator = LeakyAllocator(ready.num_blocks, ready.block_size, args.inject_leak)
    shared = args.shared_prefix_blocks * ready.block_size
    prompts = make_prompts(args.requests, args.prompt_len, ready.vocab_size, args.seed, shared)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        report = soak(worker, config, prompts, params, allocator=allocator)
    except InvariantViolation as exc:
        print(f"InvariantViolation {exc}", file=sys.stderr)
        return 1
    finally:
        worker.close()
    print(
        f"{args.requests} requests, {args.num_slots} slots, {ready.num_blocks} blocks of "
        f"{ready.block_size}, budget {args.token_budget}, reserve {args.watermark_blocks}, "
        f"shared prefix {args.shared_prefix_blocks} blocks, prefix caching "
        f"{'on' if args.enable_prefix_caching else 'off'}, draft tokens "
        f"{args.num_speculative_tokens}"
    )
    print(report.format())
    return 0
