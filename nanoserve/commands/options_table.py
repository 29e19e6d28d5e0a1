"""``nanoserve options-table``: the README's configuration table, made from the declarations.

Not listed in ``nanoserve --help``: it is for whoever changes an option. ``--write README.md``
replaces the table under the file's "## Configuration" heading; without it the table is printed.
tests/test_options.py checks the README's table against the parsers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoserve.options import ROLES, Option, all_options

HEADING = "## Configuration"
HEADER = "| flag | environment | default | process | meaning |\n| --- | --- | --- | --- | --- |"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``options-table`` (without a help line, so --help does not list it)."""
    parser = sub.add_parser("options-table", description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, metavar="README", help="replace the table there")
    parser.set_defaults(func=run)


def table() -> str:
    """The markdown table: one row per option, in declaration order."""
    return "\n".join([HEADER, *(_row(o) for o in all_options())])


def _row(o: Option) -> str:
    processes = (
        "all"
        if set(o.processes) == set(ROLES)
        else ", ".join(name for name in (*ROLES, "serve") if name in o.processes)
    )
    cells = [
        " / ".join(f"`{s}`" for s in o.spellings),
        f"`{o.env}`",
        o.default_text,
        processes,
        o.help,
    ]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def replace_table(text: str, new: str) -> str:
    """``text`` with the table under its configuration heading replaced by ``new``."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == HEADING)
        first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    except StopIteration:
        raise ValueError(f"no table under {HEADING!r}") from None
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "".join([*lines[:first], new + "\n", *lines[end:]])


def run(args: argparse.Namespace) -> int:
    """Print the table, or write it into the file --write names."""
    if args.write is None:
        print(table())
        return 0
    if not args.write.is_file():
        raise FileNotFoundError(f"no such file: {args.write}")
    args.write.write_text(replace_table(args.write.read_text(), table()))
    return 0
