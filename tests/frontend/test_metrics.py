"""Metrics mirrors every EngineStats field from one table, and derives the rest."""

from __future__ import annotations

from frontend.metric_series import COUNTED, MIRRORED
from frontend.metrics import Metrics
from nanoserve.bench.metrics import samples
from protocol.messages import EngineStats

# cache usage; counters; the decode path's Enum
DERIVED = {"kv_blocks_total", "worker_decode_path", "kv_pool_fallbacks"} | {
    field for _, _, field in COUNTED
}


def test_every_engine_stat_is_mirrored_or_derived_once() -> None:
    mirrored = [field for _, _, field in MIRRORED]
    assert len(set(mirrored)) == len(mirrored)
    assert set(mirrored) | DERIVED == set(EngineStats.__struct_fields__)
    assert not set(mirrored) & DERIVED


def test_observe_stats_sets_each_series_from_its_field() -> None:
    fields = [
        f for f in EngineStats.__struct_fields__ if f not in ("worker_ready", "kv_pool_fallbacks")
    ]
    fallbacks = {"new_pool": 2, "geometry": 1}
    stats = EngineStats(
        **{f: 10 + i for i, f in enumerate(fields)}, worker_ready=True, kv_pool_fallbacks=fallbacks
    )
    metrics = Metrics()
    metrics.observe_stats(stats)
    metrics.observe_stats(stats)  # a running total is not counted twice
    rendered = samples(metrics.render().decode())
    for name, _, field in MIRRORED:
        assert rendered[name] == float(getattr(stats, field)), name
    used, total = stats.kv_blocks_used, stats.kv_blocks_total
    assert rendered["nanoserve:kv_cache_usage_perc"] == used / total
    for name, _, field in COUNTED:
        assert rendered[f"{name}_total"] == float(getattr(stats, field)), name
    for reason, count in fallbacks.items():
        assert rendered[f'nanoserve:kv_pool_fallbacks_total{{reason="{reason}"}}'] == count


def test_counters_never_fall_when_the_scheduler_restarts() -> None:
    metrics = Metrics()
    metrics.observe_stats(EngineStats(prefix_cache_queries=100, prefix_cache_hits=60))
    metrics.observe_stats(EngineStats(prefix_cache_queries=30, prefix_cache_hits=10))  # restarted
    text = metrics.render().decode()
    assert "nanoserve:prefix_cache_queries_total 130.0" in text
    assert "nanoserve:prefix_cache_hits_total 70.0" in text


def test_no_count_is_lost_when_the_scheduler_restarts_between_reads() -> None:
    """The series take the stats only when read; a scheduler that restarts between two reads
    still has all its totals counted, and so does its successor."""
    metrics = Metrics()
    metrics.observe_stats(EngineStats(prefix_cache_queries=100))
    assert "nanoserve:prefix_cache_queries_total 100.0" in metrics.render().decode()
    metrics.observe_stats(EngineStats(prefix_cache_queries=150))  # unread
    metrics.observe_stats(EngineStats(prefix_cache_queries=20))  # restarted
    metrics.observe_stats(EngineStats(prefix_cache_queries=120))  # past the last read's 100
    assert "nanoserve:prefix_cache_queries_total 270.0" in metrics.render().decode()


def test_the_decode_path_is_one_state_of_an_enum() -> None:
    metrics = Metrics()
    metrics.observe_stats(EngineStats())
    assert 'nanoserve:worker_decode_path{nanoserve_worker_decode_path="unknown"} 1.0' in (
        metrics.render().decode()
    )
    metrics.observe_stats(EngineStats(worker_decode_path="compiling"))
    metrics.observe_stats(EngineStats(worker_decode_path="compiled"))
    text = metrics.render().decode()
    assert 'nanoserve:worker_decode_path{nanoserve_worker_decode_path="compiled"} 1.0' in text
    assert 'nanoserve:worker_decode_path{nanoserve_worker_decode_path="compiling"} 0.0' in text


def test_the_workers_plan_is_one_info_series_with_valid_labels() -> None:
    metrics = Metrics()
    metrics.observe_plan({"device": "cpu", "kv dtype": "bfloat16", "__name__": "x", "1st": "y"})
    text = metrics.render().decode()
    (line,) = [line for line in text.splitlines() if line.startswith("nanoserve:worker_plan_info")]
    assert line == (
        'nanoserve:worker_plan_info{device="cpu",key_1st="y",kv_dtype="bfloat16",name__="x"} 1.0'
    )
    metrics.observe_plan({})  # no worker is ready: no plan
    assert "nanoserve:worker_plan_info 1.0" in metrics.render().decode()


def test_speculative_decoding_series() -> None:
    """Drafts, draft tokens and accepted tokens as counters, and the mean acceptance length:
    10 verifications of 40 drafts that accepted 25 gave 35 tokens, 3.5 each."""
    metrics = Metrics()
    stats = EngineStats(
        spec_drafts_total=10, spec_draft_tokens_total=40, spec_accepted_tokens_total=25
    )
    metrics.observe_stats(stats)
    text = metrics.render().decode()
    assert "nanoserve:spec_decode_num_drafts_total 10.0" in text
    assert "nanoserve:spec_decode_num_draft_tokens_total 40.0" in text
    assert "nanoserve:spec_decode_num_accepted_tokens_total 25.0" in text
    assert "nanoserve:spec_decode_mean_acceptance_length 3.5" in text
