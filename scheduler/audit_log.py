"""AuditLog: the last audit's result and duration, for the web page's health panel."""

from __future__ import annotations

import time
from collections.abc import Callable

from scheduler.errors import InvariantViolation


class AuditLog:
    """Runs audits and remembers the last one: passed or the violation, and its seconds."""

    def __init__(self) -> None:
        self.count = 0
        self.ok = True
        self.error = ""
        self.seconds = 0.0
        self.at: float | None = None  # monotonic time of the last audit (None: none yet)

    def run(self, audit: Callable[[], None]) -> None:
        """Run ``audit`` and record it; an InvariantViolation is recorded, then raised."""
        started = time.perf_counter()
        try:
            audit()
        except InvariantViolation as exc:
            self._record(started, str(exc))
            raise
        self._record(started, "")

    def _record(self, started: float, error: str) -> None:
        self.seconds = time.perf_counter() - started
        self.at = time.monotonic()
        self.count += 1
        self.ok = not error
        self.error = error
