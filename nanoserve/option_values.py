"""How an option's text becomes its value, and how a value reads back as text.

Each parser takes the text of a flag or of a NANOSERVE_* variable and returns the value, or
raises ValueError with a few words on what the text should be; ``nanoserve.options`` puts the
flag or the variable in front of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def show(value: Any) -> str:
    """A default value as a person reads it: on/off, 30 rather than 30.0."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def as_text(value: Any) -> str:
    """``value`` as an environment variable spells it: switches 1 or 0, ranks ``0,1``."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("not an integer") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _switch(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a switch (1/0, true/false, yes/no, on/off)")


def parse_bytes(text: str) -> int:
    """``2GiB``, ``512MiB``, ``4KiB`` (or kB, MB, GB) or a plain count -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    number, scale = lowered, 1
    for suffix, size in units.items():
        if lowered.endswith(suffix):
            number, scale = lowered[: -len(suffix)], size
            break
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError("not a size (e.g. 2GiB, 512MiB, or bytes)") from None


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"0,2"`` or ``"2-3"`` -> the ranks; ``""`` -> () (all)."""
    ranks: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            ranks.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError("not tensor parallel ranks (want e.g. 0, 2-3 or 0,1)") from None
    return tuple(ranks)


# By an option's kind, or by the name its declaration gives as ``parse``.
PARSERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": _integer,
    "float": _number,
    "bool": _switch,
    "bytes": parse_bytes,
    "ranks": parse_ranks,
}
