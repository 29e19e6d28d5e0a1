"""Metrics: the frontend's Prometheus series, in a registry of its own (one per app).

Names follow vLLM's (``vllm:num_requests_running`` becomes ``nanoserve:num_requests_running``).
Gauges mirror the scheduler's EngineStats; counters and histograms are measured here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol.messages import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    """Every series /metrics serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.running = Gauge("nanoserve:num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("nanoserve:num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge(
            "nanoserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use", registry=r
        )
        self.kv_blocks_used = Gauge(
            "nanoserve:kv_cache_blocks_used", "KV cache blocks in use", registry=r
        )
        self.worker_ready = Gauge(
            "nanoserve:worker_ready", "1 while the scheduler reports a ready worker", registry=r
        )
        self.in_flight = Gauge(
            "nanoserve:frontend_requests_in_flight", "HTTP generation requests open", registry=r
        )
        self.preemptions = Counter(
            "nanoserve:num_preemptions", "Preemptions reported by the scheduler", registry=r
        )
        self._last_preemptions = 0
        self.steps = Gauge("nanoserve:num_steps", "Steps since the scheduler started", registry=r)
        # Running totals kept by the scheduler, mirrored here as gauges (they reset with it).
        self.steps_in_flight = Gauge(
            "nanoserve:steps_in_flight",
            "Steps sent to the worker and not answered yet (2 while overlap runs ahead)",
            registry=r,
        )
        self.worker_resident = Gauge(
            "nanoserve:worker_resident_memory_bytes",
            "The worker process's resident memory after its last step",
            registry=r,
        )
        self.messages_during_step = Gauge(
            "nanoserve:scheduler_messages_during_step_total",
            "Adds and aborts the scheduler took in while a step was in flight",
            registry=r,
        )
        self.worker_busy = Gauge(
            "nanoserve:worker_busy_seconds_total", "Seconds the worker spent in steps", registry=r
        )
        self.scheduler_busy = Gauge(
            "nanoserve:scheduler_busy_seconds_total",
            "Seconds the scheduler spent planning and applying steps",
            registry=r,
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

    def observe_stats(self, stats: EngineStats) -> None:
        """Copy the scheduler's gauges."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        total = stats.kv_blocks_total
        self.kv_usage.set(stats.kv_blocks_used / total if total else 0.0)
        # The scheduler reports a running total; a restarted scheduler starts again from 0.
        total_preempted = stats.num_preemptions_total
        if total_preempted < self._last_preemptions:
            self._last_preemptions = 0
        self.preemptions.inc(total_preempted - self._last_preemptions)
        self._last_preemptions = total_preempted
        self.steps.set(stats.num_steps_total)
        self.worker_ready.set(1 if stats.worker_ready else 0)
        self.steps_in_flight.set(stats.steps_in_flight)
        self.worker_resident.set(stats.worker_resident_bytes)
        self.messages_during_step.set(stats.messages_during_step_total)
        self.worker_busy.set(stats.worker_busy_s_total)
        self.scheduler_busy.set(stats.scheduler_busy_s_total)

    def render(self) -> bytes:
        """Prometheus text exposition of every series."""
        return generate_latest(self.registry)
