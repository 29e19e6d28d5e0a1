"""EngineStats: the scheduler's gauges and counters, as the frontends receive them (on its
Heartbeat, and with the Outputs that end a request) and mirror them on /metrics."""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """Gauges and counters for /metrics, sent on the scheduler's heartbeat to each frontend
    (and with the outputs that end a request).

    A ``_total`` restarts from 0 with the scheduler process; the ledgers' own
    (``num_preemptions_total``, the prefix cache's) also when a new worker's pool replaces them.

    - ``num_running``, ``num_waiting``: requests holding a slot, and requests queued for one.
    - ``kv_blocks_used``, ``kv_blocks_total``: KV blocks held by requests; the pool's size.
    - ``num_preemptions_total``: requests preempted by recompute (short of blocks, worker lost).
    - ``num_steps_total``: steps whose results came back and were applied to the requests.
    - ``worker_ready``: a worker has announced itself and not been lost since.
    - ``worker_busy_s_total``: the worker's own time in the steps counted by ``num_steps_total``.
    - ``messages_during_step_total``: frontend messages taken in while a step was in flight.
    - ``scheduler_busy_s_total``: CPU time the scheduler's loop spent planning steps and
      applying their results.
    - ``scheduler_cpu_s_total``: CPU time of the whole scheduler process, every thread (its
      loop, ZeroMQ's I/O thread): with the frontend's own, what serving costs outside the
      worker.
    - ``bad_messages_total``: frames dropped (garbage, wrong type or version, a misfit worker).
    - ``workers_lost_total``, ``frontends_lost_total``: peers given up on (closed, or silent).
    - ``steps_in_flight``: steps sent and not yet answered (2 while overlap runs ahead).
    - ``worker_resident_bytes``: the worker process's resident memory after its last step.
    - ``grammar_tokens_total``: tokens sampled under a grammar; ``grammar_fill_s_total``: the
      worker's time filling their masks (beside the forward); ``grammar_apply_s_total``: its
      time waiting for and applying them (in the step's path).
    - ``num_waiting_for_grammar``: requests held until the worker has compiled their grammar
      (``scheduler.grammar_gate``; counted in ``num_waiting`` too); ``grammar_holds_total``:
      requests held so; ``grammar_compile_s_total``: the worker's seconds compiling their
      grammars, off the step path; ``grammar_step_compiles_total``: grammars compiled in a
      step's path instead (a row resumed on a new worker).
    - ``worker_decode_path``: what the worker's decode steps run on, as its last step said:
      "eager", "graphs" (CUDA graphs), "compiling" (eagerly meanwhile), "compiled", "failed"
      ("" before any step).
    - ``worker_threads``: the worker's intra-op threads after its last step (0 before any);
      ``worker_thread_switches_total``: how often it changed them (``worker.cpu.threads``).
    - ``spec_drafts_total``: items verified with draft tokens (speculative decoding);
      ``spec_draft_tokens_total``: draft tokens they carried; ``spec_accepted_tokens_total``:
      of those, accepted. Each verification also yields one token of its own, so the mean
      acceptance length is ``(accepted + drafts) / drafts``.
    - Worker restarts (docs/kv_pool.md): ``kv_pool_reattaches_total``, new workers that took
      over the lost one's shared pool; ``kv_pool_fallbacks``, restarts that recomputed instead,
      by reason; ``worker_restart_tokens_recomputed_total``, tokens of K/V computed again
      because a worker died (``_last``: the latest restart's); ``worker_death_to_token_s_*``,
      seconds from a worker's death to the next token of each request running then (sum and
      count over every restart; ``_last_max``: the latest restart's slowest request).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    worker_ready: bool = False
    worker_busy_s_total: float = 0.0
    messages_during_step_total: int = 0
    scheduler_busy_s_total: float = 0.0
    bad_messages_total: int = 0
    workers_lost_total: int = 0
    frontends_lost_total: int = 0
    steps_in_flight: int = 0
    worker_resident_bytes: int = 0
    prefix_cache_queries: int = 0  # tokens of admitted requests (every admission counted)
    prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache
    grammar_tokens_total: int = 0
    grammar_fill_s_total: float = 0.0
    grammar_apply_s_total: float = 0.0
    worker_decode_path: str = ""
    worker_threads: int = 0
    worker_thread_switches_total: int = 0
    scheduler_cpu_s_total: float = 0.0
    num_waiting_for_grammar: int = 0
    grammar_holds_total: int = 0
    grammar_compile_s_total: float = 0.0
    grammar_step_compiles_total: int = 0
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    kv_pool_reattaches_total: int = 0
    kv_pool_fallbacks: dict[str, int] = {}
    worker_restart_tokens_recomputed_total: int = 0
    worker_restart_tokens_recomputed_last: int = 0
    worker_death_to_token_s_sum: float = 0.0
    worker_death_to_token_s_count: int = 0
    worker_death_to_token_s_last_max: float = 0.0
