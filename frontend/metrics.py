"""Metrics: the frontend's Prometheus series, in a registry of its own (one per app).

Names follow vLLM's (``vllm:num_requests_running`` becomes ``nanoserve:num_requests_running``);
the few that routers read are served under vLLM's own names too (``frontend.vllm_metrics``).
Gauges mirror the scheduler's EngineStats; counters and histograms are measured here; the ready
worker's plan is an info metric, ``nanoserve:worker_plan_info{device="cpu",...} 1``.
"""

from __future__ import annotations

import re
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from frontend.metric_series import COUNTED, DECODE_PATHS, MIRRORED
from frontend.recent import Recent
from frontend.vllm_metrics import VllmSeries
from protocol.messages import EngineStats, SchedulerInfo

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    """Every series /metrics serves, and the recent latencies the web page plots."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.mirrored = [(Gauge(name, text, registry=r), field) for name, text, field in MIRRORED]
        self.kv_usage = Gauge(
            "nanoserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use", registry=r
        )
        self.acceptance_length = Gauge(
            "nanoserve:spec_decode_mean_acceptance_length",
            "Tokens a verification of drafts yields on average: accepted drafts plus its own",
            registry=r,
        )
        self.vllm = VllmSeries(r)  # the routers' gauges, under vLLM's names
        # The scheduler's running totals that are counters here (vLLM's names): each grows by
        # what the total grew, so a restarted scheduler (totals from 0) never makes them fall.
        self.counted = [(Counter(name, text, registry=r), field) for name, text, field in COUNTED]
        self._last_totals = [0] * len(COUNTED)
        self._stats: EngineStats | None = None  # the latest, not yet in the series
        self.decode_path = Enum(
            "nanoserve:worker_decode_path",
            "What the worker's decode steps run on (compiling: eagerly while the graphs build)",
            states=list(DECODE_PATHS),
            registry=r,
        )
        self.worker_plan = Info(
            "nanoserve:worker_plan",
            "How the ready worker runs its steps, chosen at its start (device, dtypes, kernels)",
            registry=r,
        )
        # With --api-servers N a scrape reads the one frontend its connection reached: this
        # names it, and its own series (tokens, latencies, CPU) are that process's alone.
        self.frontend = Info(
            "nanoserve:frontend",
            "This frontend process: its index among --api-servers, their count, its pid",
            registry=r,
        )
        # Read when /metrics renders: every thread of this process, ZeroMQ's I/O thread included.
        self.cpu = Gauge(
            "nanoserve:frontend_cpu_seconds_total",
            "CPU seconds of this frontend process, every thread",
            registry=r,
        )
        self.cpu.set_function(time.process_time)
        self.in_flight = Gauge(
            "nanoserve:frontend_requests_in_flight", "HTTP generation requests open", registry=r
        )
        self.prompt_tokens = Counter(
            "nanoserve:prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "nanoserve:generation_tokens", "Generated tokens received", registry=r
        )
        self.bad_messages = Counter(
            "nanoserve:bad_messages", "Frames from the scheduler that failed to decode", registry=r
        )
        self.finished = Counter(
            "nanoserve:request_success",
            "Finished requests by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "nanoserve:request_rejected", "Requests refused by status", ["status"], registry=r
        )
        self.ttft = Histogram(
            "nanoserve:time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "nanoserve:inter_token_latency_seconds",
            "Time between tokens of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "nanoserve:e2e_request_latency_seconds",
            "Time from arrival to the last token",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.page_streams = Gauge(
            "nanoserve:web_page_streams", "Web pages open on the live data stream", registry=r
        )
        self.page_frames_dropped = Counter(
            "nanoserve:web_page_frames_dropped",
            "Frames a slow web page missed (its queue keeps the newest only)",
            registry=r,
        )
        self.pool_fallbacks = Gauge(
            "nanoserve:kv_pool_fallbacks_total",
            "Worker restarts that recomputed instead of re-attaching the shared KV pool, by reason",
            ["reason"],
            registry=r,
        )
        self.recent_ttft = Recent()
        self.recent_itl = Recent()

    def observe_ttft(self, seconds: float) -> None:
        """One request's time to its first token."""
        self.ttft.observe(seconds)
        self.recent_ttft.add(seconds)

    def observe_itl(self, seconds: float, count: int = 1) -> None:
        """``count`` inter-token gaps of ``seconds`` each."""
        for _ in range(count):
            self.itl.observe(seconds)
        self.recent_itl.add(seconds, count)

    def observe_info(self, info: SchedulerInfo) -> None:
        """The scheduler's news of its worker: the plan and the cache's geometry."""
        self.observe_plan(info.worker_plan)
        self.vllm.observe_info(info)

    def observe_plan(self, plan: dict[str, str]) -> None:
        """The ready worker's plan (SchedulerInfo.worker_plan; {} while none is ready)."""
        self.worker_plan.info({_label(key): str(value) for key, value in plan.items()})

    def observe_stats(self, stats: EngineStats) -> None:
        """Take the scheduler's latest stats (its heartbeat carries them, and so does the
        message that ends a request). The series take them when read (``sync``): some 30
        series updates on every message cost the frontend a fifth of its CPU a token at
        concurrency 1, when every step's message carried them (docs/performance.md)."""
        pending = self._stats
        if pending is not None and any(
            getattr(stats, field) < getattr(pending, field) for _, _, field in COUNTED
        ):
            self.sync()  # a restarted scheduler counts from 0: count the old one's totals first
        self._stats = stats

    def sync(self) -> None:
        """Bring the series up to the latest stats taken."""
        stats, self._stats = self._stats, None
        if stats is not None:
            self._apply(stats)

    def _apply(self, stats: EngineStats) -> None:
        """Copy the scheduler's gauges, derive the cache usage, and advance its counters."""
        path = stats.worker_decode_path
        self.decode_path.state(path if path in DECODE_PATHS else "unknown")
        for gauge, field in self.mirrored:
            gauge.set(getattr(stats, field))
        for reason, count in stats.kv_pool_fallbacks.items():
            self.pool_fallbacks.labels(reason=reason).set(count)
        total = stats.kv_blocks_total
        self.kv_usage.set(stats.kv_blocks_used / total if total else 0.0)
        drafts = stats.spec_drafts_total
        length = (stats.spec_accepted_tokens_total + drafts) / drafts if drafts else 0.0
        self.acceptance_length.set(length)
        self.vllm.apply(stats)
        # The scheduler reports a running total; a restarted scheduler starts again from 0.
        for i, (counter, field) in enumerate(self.counted):
            total = getattr(stats, field)
            last = self._last_totals[i] if total >= self._last_totals[i] else 0
            counter.inc(total - last)
            self._last_totals[i] = total

    def render(self) -> bytes:
        """Prometheus text exposition of every series."""
        self.sync()
        return generate_latest(self.registry)


def _label(key: str) -> str:
    """A valid Prometheus label name for a plan key (a worker's own keys already are)."""
    name = re.sub(r"\W", "_", key, flags=re.ASCII).lstrip("_")
    return name if name[:1].isalpha() else f"key_{name}"
