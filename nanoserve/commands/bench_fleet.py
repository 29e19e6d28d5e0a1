"""``nanoserve bench fleet``: predict a fleet before owning it. A multi-turn trace through a real
router (sglang-router) in front of N simulated replicas (the real scheduler on the model-free
SimWorker, each step taking a modelled time): hit rate and TTFT, round-robin against
cache-aware routing, at 2, 4 and 8 replicas. The work is ``nanoserve.bench.fleet``'s."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``fleet`` under the ``bench`` subcommands."""
    p = subparsers.add_parser("fleet", help="simulate N replicas behind a real router")
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--router", choices=("sglang-router", "vllm-router"), default="sglang-router")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=300, help="words of the system prompt")
    p.add_argument("--turn-len", type=int, default=40, help="words of each user message")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-fixed-ms", type=float, default=4.0, help="modelled cost of a step")
    p.add_argument("--token-us", type=float, default=50.0, help="modelled cost of a token")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON too")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Simulate each configuration in turn and print the table."""
    import asyncio

    from nanoserve.bench.fleet import FleetTrace, StepCost, format_rows, simulate

    if min(args.replicas) < 1 or args.conversations < 1 or args.turns < 1:
        raise ValueError("replicas, conversations and turns must be >= 1")
    trace = FleetTrace(
        args.conversations, args.turns, args.system_len, args.turn_len, args.output_len, args.seed
    )
    cost = StepCost(args.step_fixed_ms / 1000, args.token_us / 1e6)
    rows = []
    for count in args.replicas:
        for policy in args.policies:
            rows.append(asyncio.run(simulate(count, policy, trace, cost, args.router)))
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0 if all(row["failed"] == 0 for row in rows) else 1
