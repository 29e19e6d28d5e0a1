"""EngineRequests: the engine's request side (a request added, held for its grammar, released,
aborted) and its gauges (``stats``), as the frontends' side of the scheduler process and the
in-process runs call them. ``scheduler.engine.Engine`` is the loop around the worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from protocol.messages import (
    AddRequest,
    CompileGrammar,
    EngineStats,
    RequestOutput,
    SamplingParams,
)
from scheduler.errors import RequestRejected

if TYPE_CHECKING:
    from scheduler.engine import Engine


class EngineRequests:
    """Engine's methods for requests and gauges."""

    @property
    def fitted(self: Engine) -> bool:
        """True once a worker's announcement has sized the ledgers."""
        return self.ready_info is not None

    def has_unfinished(self: Engine) -> bool:
        """True while any request waits or runs."""
        return self.fitted and self.scheduler.has_unfinished()

    def add_request(
        self: Engine,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; RequestRejected (a ValueError) if it could never run. Requests share
        cached prefix blocks only with requests of the same ``cache_salt``."""
        if not self.fitted:
            raise RequestRejected("no worker has announced itself yet")
        params = params or SamplingParams()
        if self.grammars is not None and params.grammar is not None:
            add = AddRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                params=params,
                cache_salt=cache_salt,
            )
            if self.grammars.hold(add):
                return  # queued once the worker has compiled its grammar
        self.scheduler.add_request(request_id, prompt_token_ids, params, cache_salt)

    def abort(self: Engine, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is (None if it is unknown or already finished)."""
        held = self.grammars.drop(request_id) if self.grammars is not None else None
        request = self.scheduler.abort(request_id) if self.fitted and held is None else None
        if held is None and request is None:
            return None
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            finish_reason="abort",
            num_prompt_tokens=len(held.prompt_token_ids) if held else request.num_prompt_tokens,
        )

    def grammar_asks(self: Engine) -> list[CompileGrammar]:
        """The grammars to ask the worker to compile now (none without ``gate_grammars``)."""
        return self.grammars.to_ask() if self.grammars is not None else []

    def grammar_compiled(self: Engine, key: str, seconds: float = 0.0) -> list[RequestOutput]:
        """The worker compiled ``key``'s grammar: its requests join the waiting queue. Returns
        the ends of those the scheduler refuses (their checks ran only now)."""
        if self.grammars is None:
            return []
        ended = []
        for add in self.grammars.compiled(key, seconds):
            try:
                self.scheduler.add_request(
                    add.request_id, list(add.prompt_token_ids), add.params, add.cache_salt
                )
            except ValueError as exc:
                ended.append(
                    RequestOutput(
                        request_id=add.request_id,
                        new_token_ids=[],
                        finish_reason="error",
                        error=str(exc),
                    )
                )
        return ended

    def stats(self: Engine) -> EngineStats:
        """The gauges and counters this engine keeps (see EngineStats for each meaning); the
        scheduler process fills in the ones about its sockets and peers."""
        stats = EngineStats(
            num_steps_total=self._steps_applied,
            worker_ready=self.fitted,
            worker_busy_s_total=self._busy_s,
            steps_in_flight=len(self._in_flight),
            grammar_tokens_total=self._grammar[0],
            grammar_fill_s_total=self._grammar[1],
            grammar_apply_s_total=self._grammar[2],
            grammar_step_compiles_total=self._grammar_step_compiles,
        )
        gate = self.grammars
        if gate is not None:
            stats = msgspec.structs.replace(
                stats,
                num_waiting_for_grammar=gate.num_held,
                grammar_holds_total=gate.holds_total,
                grammar_compile_s_total=gate.compile_s_total,
            )
        if not self.fitted:
            return stats
        s = self.scheduler
        return msgspec.structs.replace(
            stats,
            num_running=len(s.running),
            num_waiting=len(s.waiting) + stats.num_waiting_for_grammar,
            kv_blocks_used=s.allocator.num_blocks - s.allocator.num_free,
            kv_blocks_total=s.allocator.num_blocks,
            num_preemptions_total=s.num_preemptions_total,
            prefix_cache_queries=s.cache.queries,
            prefix_cache_hits=s.cache.hits,
            spec_drafts_total=s.speculation.drafts_total,
            spec_draft_tokens_total=s.speculation.draft_tokens_total,
            spec_accepted_tokens_total=s.speculation.accepted_total,
            kv_pool_reattaches_total=self.restarts.reattaches,
            kv_pool_fallbacks=dict(self.restarts.fallbacks),
            worker_restart_tokens_recomputed_total=self.restarts.tokens_recomputed,
            worker_restart_tokens_recomputed_last=self.restarts.tokens_recomputed_last,
        )
