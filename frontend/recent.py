"""Recent: the latest observations with their times, for percentiles over the last seconds (the
web page's plots of TTFT and inter-token latency)."""

from __future__ import annotations

import time
from collections import deque


class Recent:
    """The latest observations with their times, for percentiles over the last seconds (the
    web page's plots); at most ``limit`` are kept."""

    def __init__(self, limit: int = 20_000) -> None:
        self._values: deque[tuple[float, float]] = deque(maxlen=limit)

    def add(self, value: float, count: int = 1) -> None:
        """Observe ``value`` ``count`` times, now."""
        now = time.monotonic()
        self._values.extend([(now, value)] * count)

    def percentiles(self, window_s: float, qs: tuple[float, ...]) -> list[float] | None:
        """The ``qs`` quantiles of the last ``window_s`` seconds' values (None: no values)."""
        since = time.monotonic() - window_s
        values = sorted(v for t, v in self._values if t >= since)
        if not values:
            return None
        return [values[min(len(values) - 1, int(q * len(values)))] for q in qs]
