"""``nanoserve bench structured-clients``: the structured-outputs client suite, in full, against a
running server, with a table per client mode.

Every Pydantic model of ``nanoserve.bench.structured_cases`` through every client mode of
``nanoserve.bench.structured_clients``, at each temperature and each whitespace setting (vLLM's
``disable_any_whitespace``, per request); each reply is checked against its model's schema. The
tests run a subset of the same suite (tests/e2e/test_structured_clients.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

_WHITESPACE = {"compact": [True], "flexible": [False], "both": [True, False]}
_OBJECTS = {"closed": [True], "open": [False], "both": [True, False]}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``structured-clients`` under the ``bench`` subcommands."""
    from nanoserve.bench.structured_clients import MODES

    p = subparsers.add_parser(
        "structured-clients",
        help="structured outputs through openai, instructor and plain HTTP, checked",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--cases", nargs="+", help="model names (default: all)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument(
        "--whitespace", choices=sorted(_WHITESPACE), default="both", help="disable_any_whitespace"
    )
    p.add_argument(
        "--objects",
        choices=sorted(_OBJECTS),
        default="closed",
        help="disable_additional_properties (open: what JSON Schema allows, unless strict)",
    )
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--json", metavar="PATH", help="write every outcome as JSON ('-': stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the suite and print the table; exit 1 when a gated mode failed a promise."""
    from nanoserve.cli import UserError

    try:
        from nanoserve.bench.structured_cases import CASES
        from nanoserve.bench.structured_clients import Ask, run_suite
    except ImportError as exc:
        raise UserError(f"needs the test extra (pip install -e '.[test]'): {exc}") from None
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    unknown = set(args.cases or []) - {c.name for c in cases}
    if unknown:
        raise UserError(f"no such case: {', '.join(sorted(unknown))}")
    asks = [
        Ask(case, mode, temperature, compact, index, args.max_tokens, closed)
        for closed in _OBJECTS[args.objects]
        for compact in _WHITESPACE[args.whitespace]
        for temperature in args.temperatures
        for mode in args.modes
        for index, case in enumerate(cases)
    ]
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"structured-clients: {len(asks)} requests to {args.base_url}", file=out)
    outcomes = _run(run_suite(args.base_url, asks, args.concurrency))
    print(format_report(outcomes), file=out)
    if args.json:
        text = json.dumps([o.row() for o in outcomes], indent=1) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            with open(args.json, "w") as handle:
                handle.write(text)
    return 0 if all(_kept(o) for o in outcomes) else 1


def _kept(outcome: Any) -> bool:
    """Whether an outcome keeps the suite's promises: valid, nothing extra, not cut where its
    case is bounded (ungated modes always pass)."""
    from nanoserve.bench.structured_clients import GATED

    if outcome.ask.mode not in GATED:
        return True
    cut = outcome.cut and outcome.ask.case.bounded
    return outcome.valid and not outcome.extra and not cut


def _run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


def format_report(outcomes: list[Any]) -> str:
    """One row per mode, whitespace and temperature; then every failure, one line each."""
    groups: dict[tuple, list] = defaultdict(list)
    for o in outcomes:
        groups[(o.ask.mode, o.ask.closed, o.ask.compact, o.ask.temperature)].append(o)
    header = (
        f"{'mode':<27} {'objects':<7} {'whitespace':<10} {'temp':>4} {'replies':>7} "
        f"{'valid':>5} {'extra':>5} {'cut':>4} {'cut*':>4} {'tokens':>6}"
    )
    lines = [header, "-" * len(header)]
    for (mode, closed, compact, temperature), group in groups.items():
        tokens = sum(o.completion_tokens for o in group) / len(group)
        lines.append(
            f"{mode:<27} {'closed' if closed else 'open':<7} "
            f"{'compact' if compact else 'flexible':<10} {temperature:>4g} "
            f"{len(group):>7} {sum(o.valid for o in group):>5} "
            f"{sum(bool(o.extra) for o in group):>5} {sum(o.cut for o in group):>4} "
            f"{sum(o.cut and o.ask.case.bounded for o in group):>4} {tokens:>6.1f}"
        )
    lines.append("valid: the client took it and every JSON value follows the schema; extra: a")
    lines.append("property the schema does not name; cut: by max_tokens (cut*: of a bounded case)")
    failures = [o for o in outcomes if not (o.valid and not o.extra and not o.cut)]
    if failures:
        lines.append(" Failures ".center(len(header), "-"))
    for o in failures:
        ask = o.ask
        why = (
            o.client_error or o.schema_error or (f"extra {o.extra}" if o.extra else o.finish_reason)
        )
        objects = "closed" if ask.closed else "open"
        lines.append(
            f"{ask.mode} {objects} {'compact' if ask.compact else 'flexible'} "
            f"t={ask.temperature:g} {ask.case.name}: {why}"
        )
    return "\n".join(lines)
