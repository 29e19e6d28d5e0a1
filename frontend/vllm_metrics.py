"""VllmSeries: the gauges the routers scrape, under the names vLLM gives them.

The Gateway API Inference Extension's model-server protocol (its proposal 003, which llm-d's
endpoint picker, AIBrix and the reference picker follow) asks each replica for three gauges and
names vLLM's series for them; vLLM-aware routers read exactly these names:

- ``vllm:num_requests_waiting``: requests queued for a slot (TotalQueuedRequests);
- ``vllm:num_requests_running``: requests holding a slot (TotalRunningRequests);
- ``vllm:kv_cache_usage_perc``: the share of KV blocks in use, a fraction from 0 to 1 as
  vLLM's is (KVCacheUtilization), and the same value under its older name
  ``vllm:gpu_cache_usage_perc``;
- ``vllm:cache_config_info{block_size, num_gpu_blocks} 1``, optional: the prefix-cache scorer's
  block size and pool size, from the ready worker's geometry.

Each carries vLLM's ``model_name`` and ``engine`` labels. The values are the scheduler's own,
the same ``EngineStats`` the ``nanoserve:`` series show. The series exist from the start (at 0),
so a picker that scrapes a replica still loading finds every name it needs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from protocol.messages import EngineStats, SchedulerInfo

LABELS = ("model_name", "engine")
ENGINE = "0"  # one engine per replica, vLLM's first

# (series, help, EngineStats field or None for the KV usage fraction)
GAUGES = (
    ("vllm:num_requests_waiting", "Requests waiting for a slot", "num_waiting"),
    ("vllm:num_requests_running", "Requests holding a slot", "num_running"),
    ("vllm:kv_cache_usage_perc", "KV cache usage, a fraction: 1 is every block in use", None),
    ("vllm:gpu_cache_usage_perc", "KV cache usage (vLLM's older name), a fraction", None),
)


class VllmSeries:
    """The protocol's gauges in ``registry``, labelled with the served model's name."""

    def __init__(self, registry: CollectorRegistry, model_name: str = "") -> None:
        self._gauges = [
            (Gauge(name, text, LABELS, registry=registry), field) for name, text, field in GAUGES
        ]
        self._cache_config = Gauge(
            "vllm:cache_config_info",
            "The KV cache's geometry, as labels (value 1)",
            [*LABELS, "block_size", "num_gpu_blocks"],
            registry=registry,
        )
        self.model_name = ""
        self.name(model_name)

    def name(self, model_name: str) -> None:
        """Label the series with the served model's name (the app knows it once it starts)."""
        self._cache_config.clear()
        for gauge, _ in self._gauges:
            gauge.clear()
            gauge.labels(model_name, ENGINE).set(0)
        self.model_name = model_name

    def apply(self, stats: EngineStats) -> None:
        """Copy the scheduler's latest stats."""
        total = stats.kv_blocks_total
        usage = stats.kv_blocks_used / total if total else 0.0
        for gauge, field in self._gauges:
            value = usage if field is None else getattr(stats, field)
            gauge.labels(self.model_name, ENGINE).set(value)

    def observe_info(self, info: SchedulerInfo) -> None:
        """The ready worker's geometry (none while no worker is ready)."""
        self._cache_config.clear()
        if info.worker_ready and info.block_size:
            labels = (self.model_name, ENGINE, str(info.block_size), str(info.num_blocks))
            self._cache_config.labels(*labels).set(1)
