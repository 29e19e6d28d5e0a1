"""The README and the documents in docs/ state the present: short enough to read, and no lab
notebook in them (no commit hash, no date, no clock time). The history stays in git."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The README is for users; docs/performance.md is a design document, not a record of runs.
MAX_LINES = {"README.md": 250, "docs/performance.md": 600}
DOCS = (
    "README.md",
    "docs/architecture.md",
    "docs/benchmarks.md",
    "docs/performance.md",
    "docs/gpu.md",
    "docs/scaling.md",
)

# 7-12 hex digits with at least one digit and one letter, standing alone: an abbreviated commit
# hash. A longer hex run (a content digest in a file name) or one inside a word is not one.
HASH = re.compile(
    r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![0-9A-Za-z_])"
)
DATE = re.compile(r"(?<![0-9])[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])(?![0-9])")
# HH:MM (seconds optional): not the port of an address (127.0.0.1:8000), not a slice ([1:32]).
CLOCK = re.compile(r"(?<![0-9A-Za-z_.:\[])([01]?[0-9]|2[0-3]):[0-5][0-9](?![0-9])")
KINDS = (("commit hash", HASH), ("date", DATE), ("clock time", CLOCK))


def diary_marks(text: str) -> list[str]:
    """Every commit hash, date and clock time in ``text``, as ``line N: kind 'match'``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in KINDS:
            found += [f"line {number}: {kind} {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def too_long(text: str, limit: int) -> str | None:
    """Why ``text`` is over ``limit`` lines, or None."""
    lines = len(text.splitlines())
    return f"{lines} lines, over {limit}" if lines > limit else None


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_documents_stay_short(name: str) -> None:
    assert too_long((ROOT / name).read_text(), MAX_LINES[name]) is None


@pytest.mark.parametrize("name", DOCS)
def test_documents_carry_no_hash_date_or_clock_time(name: str) -> None:
    assert diary_marks((ROOT / name).read_text()) == [], name


@pytest.mark.parametrize(
    "line, mark",
    [
        ("The compare command at 1a2b3c4 gave 745 tok/s.", "commit hash '1a2b3c4'"),
        ("(recorded in 9e8d7c6b5, ad hoc)", "commit hash '9e8d7c6b5'"),
        ("On 2026-12-03 the host was slower.", "date '2026-12-03'"),
        ("A second run at 13:36 met the same bars.", "clock time '13:36'"),
        ("at 9:05, then", "clock time '9:05'"),
        ("the log said 17:24:20 first", "clock time '17:24'"),
    ],
)
def test_each_kind_of_mark_is_caught(line: str, mark: str) -> None:
    assert diary_marks(f"clean first line\n{line}") == [f"line 2: {mark}"]


@pytest.mark.parametrize(
    "line",
    [
        "curl -s http://127.0.0.1:8000/v1/chat/completions",
        "SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f, a 16-digit content digest",
        "decade, defaced, 1234567 tokens, 0.14-0.20 s, x[1:32], ratio 2:1",
        "vLLM's CVE-2025-46570; blocks 0x7fffdb8",
    ],
)
def test_what_only_looks_like_a_mark_passes(line: str) -> None:
    assert diary_marks(line) == []


def test_a_long_document_is_caught() -> None:
    assert too_long("a line\n" * 251, 250) == "251 lines, over 250"
    assert too_long("a line\n" * 250, 250) is None
