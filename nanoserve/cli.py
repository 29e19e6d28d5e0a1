"""The ``nanoserve`` console command: one subcommand per module in ``nanoserve.commands``.

Each command module defines ``add_parser(subparsers)`` and registers ``func(args) -> int`` with
``set_defaults``. Modules import torch and transformers inside ``func`` only, so ``--help`` and
the torch-free commands stay fast. Errors a user can fix are one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Top-level commands, then the ``bench`` family. Order is the order of ``--help``.
COMMANDS = [
    "serve",
    "frontend",
    "scheduler",
    "worker",
    "kv_holder",
    "supervise",
    "generate",
    "soak",
    "sweep_watermark",
    "options_table",
]
BENCH_COMMANDS = [
    "bench_forward",
    "bench_scheduler",
    "bench_serve",
    "bench_structured_clients",
    "bench_tp",
    "bench_fleet",
]


class UserError(Exception):
    """A problem the user can fix: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every command module registered."""
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        _register(name, sub)
    bench = sub.add_parser(
        "bench", help="benchmarks: forward, scheduler, serve, structured-clients, tp"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name in BENCH_COMMANDS:
        _register(name, bench_sub)
    return parser


def _register(name: str, sub: argparse._SubParsersAction) -> None:
    try:
        module = importlib.import_module(f"nanoserve.commands.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"nanoserve.commands.{name}":
            raise
        return  # a command whose module has not landed yet is simply absent
    module.add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nanoserve`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (UserError, ValueError, FileNotFoundError) as exc:
        # One line, no traceback: every problem a user can fix is raised as one of these.
        print(f"nanoserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
