"""The series /metrics mirrors from the scheduler's EngineStats: each as (series, help,
EngineStats field). ``frontend.metrics.Metrics`` makes them; a test checks every EngineStats
field has one."""

from __future__ import annotations

# The gauges that mirror the scheduler's EngineStats, as (series, help, EngineStats field). The
# scheduler's totals are mirrored as gauges, not counters: they restart from 0 with it.
MIRRORED = (
    ("nanoserve:num_requests_running", "Requests running", "num_running"),
    ("nanoserve:num_requests_waiting", "Requests waiting", "num_waiting"),
    ("nanoserve:kv_cache_blocks_used", "KV cache blocks in use", "kv_blocks_used"),
    ("nanoserve:worker_ready", "1 while the scheduler reports a ready worker", "worker_ready"),
    ("nanoserve:num_steps", "Steps applied since the scheduler started", "num_steps_total"),
    (
        "nanoserve:steps_in_flight",
        "Steps sent to the worker and not answered yet (2 while overlap runs ahead)",
        "steps_in_flight",
    ),
    (
        "nanoserve:worker_resident_memory_bytes",
        "The worker process's resident memory after its last step",
        "worker_resident_bytes",
    ),
    (
        "nanoserve:worker_threads",
        "The worker's intra-op threads (1 while another process holds a core)",
        "worker_threads",
    ),
    (
        "nanoserve:scheduler_messages_during_step_total",
        "Adds and aborts the scheduler took in while a step was in flight",
        "messages_during_step_total",
    ),
    (
        "nanoserve:grammar_masked_tokens_total",
        "Tokens the worker sampled under a grammar (structured outputs, tool calls)",
        "grammar_tokens_total",
    ),
    (
        "nanoserve:num_requests_waiting_for_grammar",
        "Requests held until the worker has compiled their grammar (also in num_requests_waiting)",
        "num_waiting_for_grammar",
    ),
    (
        "nanoserve:grammar_holds_total",
        "Requests held until the worker had compiled their grammar",
        "grammar_holds_total",
    ),
    (
        "nanoserve:grammar_compile_seconds_total",
        "Seconds the worker spent compiling grammars asked ahead of their requests",
        "grammar_compile_s_total",
    ),
    (
        "nanoserve:grammar_step_compiles_total",
        "Grammars the worker compiled in a step's path (a row resumed on a new worker)",
        "grammar_step_compiles_total",
    ),
    (
        "nanoserve:grammar_mask_fill_seconds_total",
        "Seconds the worker's mask thread spent on grammar masks, beside the forward",
        "grammar_fill_s_total",
    ),
    (
        "nanoserve:grammar_mask_apply_seconds_total",
        "Seconds the worker's sampler spent waiting for and applying grammar masks",
        "grammar_apply_s_total",
    ),
    (
        "nanoserve:worker_busy_seconds_total",
        "Seconds the worker spent in steps",
        "worker_busy_s_total",
    ),
    (
        "nanoserve:scheduler_cpu_seconds_total",
        "CPU seconds of the scheduler process, every thread (ZeroMQ's I/O thread included)",
        "scheduler_cpu_s_total",
    ),
    (
        "nanoserve:scheduler_busy_seconds_total",
        "Seconds the scheduler spent planning and applying steps",
        "scheduler_busy_s_total",
    ),
    (
        "nanoserve:scheduler_bad_messages_total",
        "Frames the scheduler dropped (garbage, wrong type or version)",
        "bad_messages_total",
    ),
    (
        "nanoserve:scheduler_workers_lost_total",
        "Workers the scheduler lost (their requests were recomputed)",
        "workers_lost_total",
    ),
    (
        "nanoserve:scheduler_frontends_lost_total",
        "Frontends the scheduler lost (their requests were aborted)",
        "frontends_lost_total",
    ),
    (
        "nanoserve:kv_pool_reattaches_total",
        "New workers that took over a dead worker's shared KV pool (no recompute)",
        "kv_pool_reattaches_total",
    ),
    (
        "nanoserve:worker_restart_tokens_recomputed_total",
        "Tokens of K/V computed again because a worker died",
        "worker_restart_tokens_recomputed_total",
    ),
    (
        "nanoserve:worker_restart_tokens_recomputed_last",
        "Tokens of K/V computed again because of the latest worker death",
        "worker_restart_tokens_recomputed_last",
    ),
    (
        "nanoserve:worker_death_to_token_seconds_sum",
        "Seconds from a worker's death to the next token of each request running then, summed",
        "worker_death_to_token_s_sum",
    ),
    (
        "nanoserve:worker_death_to_token_seconds_count",
        "Requests whose next token after a worker's death was timed",
        "worker_death_to_token_s_count",
    ),
    (
        "nanoserve:worker_death_to_token_seconds_last_max",
        "The latest worker death: seconds to the next token of its slowest running request",
        "worker_death_to_token_s_last_max",
    ),
)


# The scheduler's running totals served as counters, as (series, help, EngineStats field).
COUNTED = (
    ("nanoserve:num_preemptions", "Preemptions reported by the scheduler", "num_preemptions_total"),
    (
        "nanoserve:prefix_cache_queries",
        "Prompt tokens of admitted requests, looked up in the prefix cache (every admission)",
        "prefix_cache_queries",
    ),
    (
        "nanoserve:prefix_cache_hits",
        "Of the prefix cache's queried tokens, those found cached",
        "prefix_cache_hits",
    ),
    (
        "nanoserve:worker_thread_switches",
        "Changes of the worker's thread count (a neighbour took a core, or gave it back)",
        "worker_thread_switches_total",
    ),
    (
        "nanoserve:spec_decode_num_drafts",
        "Verifications of draft tokens (speculative decoding), one per request and step",
        "spec_drafts_total",
    ),
    (
        "nanoserve:spec_decode_num_draft_tokens",
        "Draft tokens verified",
        "spec_draft_tokens_total",
    ),
    (
        "nanoserve:spec_decode_num_accepted_tokens",
        "Draft tokens accepted",
        "spec_accepted_tokens_total",
    ),
)


# The worker's decode paths (EngineStats.worker_decode_path; "unknown" before its first step).
DECODE_PATHS = ("unknown", "eager", "graphs", "compiling", "compiled", "failed")
