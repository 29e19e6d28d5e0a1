"""Metrics mirrors every EngineStats field from one table, and derives the rest."""

from __future__ import annotations

from frontend.metrics import MIRRORED, Metrics
from protocol.messages import EngineStats

DERIVED = {"kv_blocks_total", "num_preemptions_total"}  # cache usage; the preemption counter


def test_every_engine_stat_is_mirrored_or_derived_once() -> None:
    mirrored = [field for _, _, field in MIRRORED]
    assert len(set(mirrored)) == len(mirrored)
    assert set(mirrored) | DERIVED == set(EngineStats.__struct_fields__)
    assert not set(mirrored) & DERIVED


def test_observe_stats_sets_each_series_from_its_field() -> None:
    fields = [f for f in EngineStats.__struct_fields__ if f != "worker_ready"]
    stats = EngineStats(**{f: 10 + i for i, f in enumerate(fields)}, worker_ready=True)
    metrics = Metrics()
    metrics.observe_stats(stats)
    metrics.observe_stats(stats)  # a running total is not counted twice
    samples = {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in metrics.render().decode().splitlines()
        if line and not line.startswith("#")
    }
    for name, _, field in MIRRORED:
        assert samples[name] == float(getattr(stats, field)), name
    used, total = stats.kv_blocks_used, stats.kv_blocks_total
    assert samples["nanoserve:kv_cache_usage_perc"] == used / total
    assert samples["nanoserve:num_preemptions_total"] == stats.num_preemptions_total
