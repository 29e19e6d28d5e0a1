"""Engine: the scheduling loop around a worker, without sockets.

``plan()`` turns one ``schedule()`` into a StepInput and ``apply()`` folds the StepResult back
in, so the scheduler process can run the loop with the worker across a socket; ``step()``
(``InProcessRuns``) is plan, execute, apply (and the audit) for a worker in this process.

Overlap (``SchedulerConfig.overlap``): up to two steps are in flight. Step N+1 is planned and
sent while the worker computes step N; its decode items name their input token
``PENDING_TOKEN`` and the worker feeds back the token it sampled itself. The worker runs steps
in order, which is what makes it safe to free blocks while a step is in flight: an aborted or
finished request's blocks return at once, and a block handed out again is written only by a
later step. Results are applied oldest first; a sample whose request has finished, been aborted
or been preempted since its step was planned is surplus and dropped.

With ``gate_grammars`` (the scheduler process's engine) a constrained request waits outside the
queues until the worker has compiled its grammar (``scheduler.grammar_gate``): ``add_request``
holds it, ``grammar_compiled`` queues it.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from protocol.messages import (
    RequestOutput,
    RowSummary,
    StepInput,
    StepResult,
    WorkerReady,
)
from scheduler.audit import audit_all, project_rows
from scheduler.batch import Batch, request_output, step_item
from scheduler.block_allocator import BlockAllocator
from scheduler.config import SchedulerConfig
from scheduler.engine_requests import EngineRequests
from scheduler.grammar_gate import GrammarGate
from scheduler.in_process import InProcessRuns
from scheduler.kv_events import KvEventLog
from scheduler.pool_sums import Check, PoolSums
from scheduler.restarts import RestartLog, can_reattach, written_blocks
from scheduler.scheduler import Scheduler
from scheduler.sizing import build_scheduler, geometry, move_to_pool


class WorkerLike(Protocol):
    """What the engine needs from a worker in this process."""

    def ready(self) -> WorkerReady: ...
    def execute(self, step: StepInput) -> StepResult: ...
    def rows(self) -> list[RowSummary]: ...


class Engine(EngineRequests, InProcessRuns):
    """Drives a Scheduler with ``plan`` and ``apply``, or an in-process worker one iteration
    per ``step`` (``InProcessRuns``); requests come and go, and the gauges are read, through
    ``EngineRequests``.

    ``ready`` is the worker's announcement, which sizes the ledgers; an engine built with None
    (the scheduler process's, before any worker) has none until ``fit`` and refuses requests.
    """

    def __init__(
        self,
        ready: WorkerReady | None,
        config: SchedulerConfig,
        worker: WorkerLike | None = None,
        allocator: BlockAllocator | None = None,
        gate_grammars: bool = False,
    ) -> None:
        self.config = config
        self.grammars = GrammarGate() if gate_grammars else None
        self.worker = worker
        self.ready_info: WorkerReady | None = None
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # until fit(): see fitted
        # The prefix cache's changes as vLLM's KV events, for the process to publish.
        self.kv_events = KvEventLog() if config.kv_events_endpoint else None
        if ready is not None:
            self.scheduler, self.ready_info = build_scheduler(ready, config, allocator), ready
            self.scheduler.cache.record(self.kv_events)
        self.depth = 2 if config.overlap else 1  # steps in flight at most
        # Oldest first; with each step the blocks its chunks write (for a re-attach).
        self._in_flight: deque[tuple[Batch, StepInput, list[int]]] = deque()
        self.restarts = RestartLog()
        self.sums = PoolSums()
        self._verify: Check | None = None  # kept K/V to check before the next step
        self._verifying: int | None = None  # the step id that checks them, while in flight
        self.checks = 0  # such checks applied
        self._next_step_id = 0
        self._steps_applied = 0
        self._busy_s = 0.0
        self._grammar = (0, 0.0, 0.0)  # tokens, fill seconds, apply seconds (EngineStats)
        self._grammar_step_compiles = 0  # grammars compiled in a step's path (EngineStats)

    @classmethod
    def for_worker(
        cls, worker: WorkerLike, config: SchedulerConfig, allocator: BlockAllocator | None = None
    ) -> Engine:
        """An engine sized from ``worker.ready()`` that runs its steps on that worker."""
        return cls(worker.ready(), config, worker=worker, allocator=allocator)

    def fit(self, ready: WorkerReady) -> list[RequestOutput]:
        """A worker announced itself: fit the ledgers to it and return the requests that end
        for it. ValueError, with nothing changed, if the config asks for more than it has.

        The first worker sizes the ledgers. One of the same geometry (``sizing.geometry``)
        takes the requests over: after ``worker_lost(keep=True)``, running requests keep their
        blocks when it re-attached to the lost worker's shared pool (``can_reattach``); else
        they wait to be recomputed, and with another pool size they move to its pool, where
        those it cannot hold end with an error. One of another geometry starts afresh: every
        request ends with an error.
        """
        old = self.ready_info
        if old is not None and self.restarts.kept:
            why = can_reattach(old, ready) or ("" if geometry(old) == geometry(ready) else "model")
            if not why:
                self.restarts.reattached()
                self.ready_info = ready
                self._verify = self.sums.to_verify(self.scheduler, self.config.audit)
                return []
            self.restarts.fell_back(why, self._computed())
        self.sums = PoolSums()  # whatever pool comes, the sums recorded are not of it
        if old is not None and geometry(old) == geometry(ready):
            self._in_flight.clear()
            self._verify = self._verifying = None
            self.scheduler.preempt_all()
            ended = []
            if ready.num_blocks != old.num_blocks:
                ended = move_to_pool(self.scheduler, ready, self.config)
            self.ready_info = ready
            return ended
        scheduler = build_scheduler(ready, self.config)
        why = "the worker was replaced by one with a different model or cache"
        ended = [
            RequestOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=why)
            for rid in (self.scheduler.known_ids if old is not None else ())
        ]
        self._in_flight.clear()
        self._verify = self._verifying = None
        if old is not None:
            self.scheduler.cache.clear()  # the old pool and its index are gone
        self.scheduler, self.ready_info = scheduler, ready
        scheduler.cache.record(self.kv_events)
        if self.grammars is not None:
            self.grammars.worker_changed()
            ended += [
                RequestOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=why)
                for rid in self.grammars.drop_all()
            ]
        return ended

    def worker_lost(self, keep: bool = False) -> None:
        """Forget the steps in flight and every cache row: running requests recompute later.
        ``keep``: the worker died, and its pool may outlive it (it was the holder's): running
        requests keep their blocks, rolled back to what acknowledged steps computed, until the
        next worker announces itself (``fit``)."""
        lost = list(self._in_flight)
        self._in_flight.clear()
        if self.grammars is not None:
            self.grammars.worker_changed()
        self._verify = self._verifying = None
        ready = self.ready_info
        if ready is None or self.restarts.kept:
            return  # nothing to keep, or kept already (the next worker has not come)
        # Draft tokens in flight or rows to cut back after rejected drafts: the lost steps'
        # rows are not what acknowledged tokens say, so those requests recompute.
        drafting = bool(self.scheduler.pending_rewinds) or any(
            request.num_draft for request in self.scheduler.running
        )
        if keep and ready.pool_id and not drafting:
            chunks = [chunk for batch, _, _ in lost for chunk in batch.chunks]
            written = {block for _, _, blocks in lost for block in blocks}
            self.restarts.kept_for(self.scheduler.keep_for_reattach(chunks, written))
            return
        why = ready.pool_fallback or ("refused_step" if ready.pool_id else "")
        if keep and ready.pool_id and drafting:
            why = "speculative"
        self.restarts.fell_back(why, self._computed())
        self.scheduler.preempt_all()

    def _computed(self) -> int:
        """Tokens of K/V the running requests hold: what a recompute computes again."""
        return sum(request.num_computed for request in self.scheduler.running)

    # -- one iteration --------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Steps planned whose results have not been applied yet."""
        return len(self._in_flight)

    @property
    def in_flight(self) -> list[StepInput]:
        """The steps in flight, oldest (the next result to apply) first."""
        return [step for _, step, _ in self._in_flight]

    def can_plan(self) -> bool:
        """True if another step may be sent now (fewer than ``depth`` in flight, and no check
        of the kept K/V in flight: nothing is planned on it before it is answered)."""
        return len(self._in_flight) < self.depth and self._verifying is None

    def plan(self) -> StepInput | None:
        """Schedule one iteration; None when there is nothing to send."""
        if not self.fitted:
            return None
        if not self.can_plan():
            raise RuntimeError(f"{len(self._in_flight)} steps are already in flight")
        if self._verify:
            return self._send(Batch([], []), verify=self._verify)
        batch = self.scheduler.schedule()
        if not batch.chunks and not batch.released_slots and not batch.rewinds:
            return None
        return self._send(batch)

    def _send(self, batch: Batch, verify: Check | None = None) -> StepInput:
        """The StepInput of ``batch`` (or of a check of ``verify``'s sums), now in flight."""
        step = StepInput(
            step_id=self._next_step_id,
            items=[step_item(chunk) for chunk in batch.chunks],
            released_slots=batch.released_slots,
            audit=self.config.audit,
            rewinds=batch.rewinds,
            verify_blocks=verify.blocks if verify else [],
            verify_ranges=verify.ranges if verify else [],
        )
        if verify:
            self._verify, self._verifying = None, step.step_id
        self._in_flight.append((batch, step, written_blocks(batch, self.scheduler)))
        self._next_step_id += 1
        return step

    def apply(self, result: StepResult) -> list[RequestOutput]:
        """Fold the oldest step's samples into the requests; finish and free the ones that
        stopped."""
        if not self._in_flight or result.step_id != self._in_flight[0][1].step_id:
            raise RuntimeError(f"result for step {result.step_id} is not the oldest in flight")
        batch, _, _ = self._in_flight.popleft()
        self._steps_applied += 1
        if result.step_id == self._verifying:
            self._verifying = None
            self.checks += 1
            self.sums.check(result.block_sums, result.range_sums, self.scheduler)
            return []
        if self.ready_info is not None and self.ready_info.pool_id:
            self.sums.record(batch, result.block_sums, self.scheduler, result.range_sums)
        self._busy_s += result.forward_s
        tokens, fill, apply = self._grammar
        self._grammar = (
            tokens + result.grammar_rows,
            fill + result.grammar_fill_s,
            apply + result.grammar_apply_s,
        )
        self._grammar_step_compiles += result.grammar_compiles
        samples = {s.request_id: s for s in result.samples}
        outputs = []
        scheduler = self.scheduler
        chunks = batch.chunks
        if chunks and all(c.sample and c.num_tokens == 1 for c in chunks):
            drafted = any(c.drafts for c in chunks)  # decodes only: what a verification costs
            scheduler.speculation.observe(result.forward_s, drafted)
        is_current, on_sampled = scheduler.is_current, scheduler.on_sampled  # once, not per row
        for chunk in batch.chunks:
            if not chunk.sample or not is_current(chunk):
                continue  # a prefill chunk, or surplus: its request ended or was preempted
            request = chunk.request
            sample = samples.get(request.request_id)
            if sample is None:
                raise RuntimeError(f"step {result.step_id} has no sample for {request.request_id}")
            gained = None
            if chunk.drafts:
                sampled = [sample.token_id, *sample.draft_samples]
                gained, reason = scheduler.on_verified(request, chunk.drafts, sampled)
            else:
                reason = on_sampled(request, sample.token_id)
            if reason is not None:
                scheduler.finish(request, reason)
            outputs.append(request_output(request, sample, reason, gained))
        return outputs

    def audit(self, rows: list[RowSummary] | None = None) -> None:
        """Check every invariant (InvariantViolation), between iterations. ``rows`` are the
        worker's rows after the last applied step; with a step still in flight they are audited
        as they will be once it has run (``project_rows``), the state the ledgers already show."""
        if rows is not None:
            steps = [step for _, step, _ in self._in_flight]
            rewinds = self.scheduler.pending_rewinds  # the next step's, planned already
            if rewinds:
                steps.append(StepInput(step_id=-1, items=[], rewinds=list(rewinds)))
            if steps:
                rows = project_rows(rows, steps)
        audit_all(self.scheduler, rows)
