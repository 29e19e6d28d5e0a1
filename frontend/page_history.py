"""History: the web page's plots, one sample a second of the server's own figures.

A sample is taken whether or not a page is open (a few dozen numbers a second), so a page
opened now shows the last ten minutes. Rates are deltas of the scheduler's totals (which
restart from 0 with the scheduler: a sample across a restart has no rate) and of this
frontend's own counters; latency percentiles are over the last ``window_s`` seconds of this
frontend's own requests.
"""

from __future__ import annotations

import time
from collections import deque

from frontend.client import SchedulerClient
from frontend.metrics import Metrics
from protocol.messages import EngineStats

QUANTILES = (0.5, 0.9, 0.99)


class History:
    """The last ``keep`` samples; ``sample()`` takes the next one."""

    def __init__(
        self, client: SchedulerClient, metrics: Metrics, keep: int = 600, window_s: float = 5.0
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.window_s = window_s
        self.samples: deque[dict] = deque(maxlen=keep)
        self._last: tuple[float, EngineStats, float] | None = None

    def sample(self) -> dict:
        """Take one sample now, keep it, and return it."""
        now = time.monotonic()
        stats = self.client.stats
        tokens = self._generated()
        last, self._last = self._last, (now, stats, tokens)
        sample = {
            "t": round(time.time(), 3),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_usage": _ratio(stats.kv_blocks_used, stats.kv_blocks_total),
            "ttft_ms": _ms(self.metrics.recent_ttft.percentiles(self.window_s, QUANTILES)),
            "itl_ms": _ms(self.metrics.recent_itl.percentiles(self.window_s, QUANTILES)),
            "tok_s": None,
            "preempt_s": None,
            "busy": None,
            "hit_rate": None,
        }
        if last is not None:
            sample.update(_rates(now - last[0], last[1], stats, tokens - last[2]))
        self.samples.append(sample)
        return sample

    def _generated(self) -> float:
        value = self.metrics.registry.get_sample_value("nanoserve:generation_tokens_total")
        return value or 0.0


def _rates(dt: float, before: EngineStats, after: EngineStats, tokens: float) -> dict:
    """Per-second rates between two samples; None across a scheduler restart."""
    rates: dict = {"tok_s": round(tokens / dt, 1) if dt > 0 else None}
    if dt <= 0 or after.num_steps_total < before.num_steps_total:
        return rates
    preempted = after.num_preemptions_total - before.num_preemptions_total
    busy = after.worker_busy_s_total - before.worker_busy_s_total
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    rates["preempt_s"] = round(preempted / dt, 2) if preempted >= 0 else None
    rates["busy"] = round(min(1.0, busy / dt), 3) if busy >= 0 else None
    rates["hit_rate"] = _ratio(hits, queried) if queried > 0 and hits >= 0 else None
    return rates


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def _ms(values: list[float] | None) -> list[float] | None:
    return None if values is None else [round(v * 1000, 2) for v in values]
