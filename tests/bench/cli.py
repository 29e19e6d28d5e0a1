"""``nanoserve bench serve`` run in the test's process, its arguments parsed as the CLI parses
them."""

from __future__ import annotations

import argparse

from nanoserve.commands import bench_serve as command


def bench_serve(argv: list[str]) -> int:
    """``nanoserve bench serve *argv``'s exit status."""
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *argv])
    return args.func(args)
