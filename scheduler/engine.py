"""Engine: the scheduling loop around a worker, without sockets.

``plan()`` turns one ``schedule()`` into a StepInput and ``apply()`` folds the StepResult back
in, so the scheduler process can run the same loop with the worker across a socket; ``step()``
is plan, execute, apply (and the audit) for a worker in this process.

Overlap (``SchedulerConfig.overlap``): up to two steps are in flight. Step N+1 is planned and
sent while the worker computes step N; its decode items name their input token
``PENDING_TOKEN`` and the worker feeds back the token it sampled itself. The worker runs steps
in order, which is what makes it safe to free blocks while a step is in flight: an aborted or
finished request's blocks return at once, and a block handed out again is written only by a
later step. Results are applied oldest first; a sample whose request has finished, been aborted
or been preempted since its step was planned is surplus and dropped.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from protocol.messages import (
    EngineStats,
    RequestOutput,
    RowSummary,
    SamplingParams,
    StepInput,
    StepResult,
    WorkerReady,
)
from scheduler.audit import audit_all, project_rows
from scheduler.batch import Batch, merge_outputs, request_output, step_item
from scheduler.block_allocator import BlockAllocator
from scheduler.config import SchedulerConfig
from scheduler.errors import LivelockError
from scheduler.scheduler import Scheduler


class WorkerLike(Protocol):
    """What the engine needs from a worker in this process."""

    def ready(self) -> WorkerReady: ...
    def execute(self, step: StepInput) -> StepResult: ...
    def rows(self) -> list[RowSummary]: ...


class Engine:
    """Drives a Scheduler and (optionally) an in-process worker, one iteration per step()."""

    def __init__(
        self,
        ready: WorkerReady,
        config: SchedulerConfig,
        worker: WorkerLike | None = None,
        allocator: BlockAllocator | None = None,
    ) -> None:
        if config.num_slots is not None and config.num_slots > ready.num_slots:
            raise ValueError(f"num_slots {config.num_slots} > the worker's {ready.num_slots}")
        if config.num_blocks is not None and config.num_blocks > ready.num_blocks:
            raise ValueError(f"num_blocks {config.num_blocks} > the worker's {ready.num_blocks}")
        if allocator is None:
            allocator = BlockAllocator(config.num_blocks or ready.num_blocks, ready.block_size)
        if allocator.num_blocks > ready.num_blocks or allocator.block_size != ready.block_size:
            raise ValueError("the allocator's geometry does not fit the worker's cache")
        max_len = min(config.max_model_len or ready.max_model_len, ready.max_model_len)
        self.ready_info = ready
        self.config = config
        self.worker = worker
        self.scheduler = Scheduler(
            allocator,
            num_slots=config.num_slots or ready.num_slots,
            token_budget=config.token_budget,
            watermark_blocks=config.watermark_blocks,
            max_model_len=max_len,
            eos_token_ids=tuple(ready.eos_token_ids),
            prefix_caching=config.enable_prefix_caching,
        )
        self.depth = 2 if config.overlap else 1  # steps in flight at most
        self._in_flight: deque[tuple[Batch, StepInput]] = deque()  # oldest first
        self._next_step_id = 0
        self._steps_applied = 0
        self._busy_s = 0.0
        self._grammar = (0, 0.0, 0.0)  # tokens, fill seconds, apply seconds (EngineStats)

    @classmethod
    def for_worker(
        cls, worker: WorkerLike, config: SchedulerConfig, allocator: BlockAllocator | None = None
    ) -> Engine:
        """An engine sized from ``worker.ready()`` that runs its steps on that worker."""
        return cls(worker.ready(), config, worker=worker, allocator=allocator)

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; RequestRejected (a ValueError) if it could never run. Requests share
        cached prefix blocks only with requests of the same ``cache_salt``."""
        self.scheduler.add_request(
            request_id, prompt_token_ids, params or SamplingParams(), cache_salt
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is (None if it is unknown or already finished)."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            finish_reason="abort",
            num_prompt_tokens=request.num_prompt_tokens,
        )

    def worker_lost(self) -> None:
        """Forget the steps in flight and every cache row: running requests recompute later."""
        self._in_flight.clear()
        self.scheduler.preempt_all()

    def adopt_pool(self, ready: WorkerReady) -> list[RequestOutput]:
        """After ``worker_lost``, a new worker brought a pool of another size: waiting requests
        move to it, and those it cannot hold end with an error (returned)."""
        s, limit = self.scheduler, self.config.num_blocks
        allocator = BlockAllocator(
            min(limit or ready.num_blocks, ready.num_blocks), ready.block_size
        )
        reserve = self.config.watermark_blocks
        reserve = int(0.01 * allocator.num_blocks) if reserve is None else reserve
        failed = []
        for request in list(s.waiting):
            if request.most_blocks(allocator.block_size, s.max_model_len) > allocator.num_blocks:
                s.abort(request.request_id)
                failed.append(request.request_id)
        s.replace_pool(allocator, min(reserve, allocator.num_blocks))
        self.ready_info = ready
        why = f"the new worker's pool of {allocator.num_blocks} blocks cannot hold this request"
        return [
            RequestOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=why)
            for rid in failed
        ]

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    # -- one iteration --------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Steps planned whose results have not been applied yet."""
        return len(self._in_flight)

    @property
    def in_flight(self) -> list[StepInput]:
        """The steps in flight, oldest (the next result to apply) first."""
        return [step for _, step in self._in_flight]

    def can_plan(self) -> bool:
        """True if another step may be sent now (fewer than ``depth`` in flight)."""
        return len(self._in_flight) < self.depth

    def plan(self) -> StepInput | None:
        """Schedule one iteration; None when there is nothing to send."""
        if not self.can_plan():
            raise RuntimeError(f"{len(self._in_flight)} steps are already in flight")
        batch = self.scheduler.schedule()
        if not batch.chunks and not batch.released_slots:
            return None
        items = [step_item(chunk) for chunk in batch.chunks]
        step = StepInput(
            step_id=self._next_step_id,
            items=items,
            released_slots=batch.released_slots,
            audit=self.config.audit,
        )
        self._in_flight.append((batch, step))
        self._next_step_id += 1
        return step

    def apply(self, result: StepResult) -> list[RequestOutput]:
        """Fold the oldest step's samples into the requests; finish and free the ones that
        stopped."""
        if not self._in_flight or result.step_id != self._in_flight[0][1].step_id:
            raise RuntimeError(f"result for step {result.step_id} is not the oldest in flight")
        batch, _ = self._in_flight.popleft()
        self._steps_applied += 1
        self._busy_s += result.forward_s
        tokens, fill, apply = self._grammar
        self._grammar = (
            tokens + result.grammar_rows,
            fill + result.grammar_fill_s,
            apply + result.grammar_apply_s,
        )
        samples = {s.request_id: s for s in result.samples}
        outputs = []
        for chunk in batch.chunks:
            if not chunk.sample or not self.scheduler.is_current(chunk):
                continue  # a prefill chunk, or surplus: its request ended or was preempted
            request = chunk.request
            sample = samples.get(request.request_id)
            if sample is None:
                raise RuntimeError(f"step {result.step_id} has no sample for {request.request_id}")
            reason = self.scheduler.on_sampled(request, sample.token_id)
            if reason is not None:
                self.scheduler.finish(request, reason)
            outputs.append(request_output(request, sample, reason))
        return outputs

    def step(self) -> list[RequestOutput]:
        """Plan up to ``depth`` steps ahead, run the oldest on the in-process worker, apply it,
        then audit when auditing is on. With overlap this is the process loop's order exactly:
        step N+1 is planned before step N's samples are known."""
        if self.worker is None:
            raise RuntimeError("this engine has no in-process worker: use plan() and apply()")
        while self.can_plan() and self.plan() is not None:
            pass
        if not self._in_flight:
            if self.has_unfinished():
                raise LivelockError(self.describe_stall())
            return []
        result = self.worker.execute(self._in_flight[0][1])
        outputs = self.apply(result)
        if self.config.audit:
            self.audit(result.rows if result.rows is not None else self.worker.rows())
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Run and apply every step still in flight on the in-process worker, planning nothing
        new; their samples are surplus unless a request is still running."""
        outputs = []
        while self._in_flight:
            result = self.worker.execute(self._in_flight[0][1])
            outputs += self.apply(result)
        return outputs

    def audit(self, rows: list[RowSummary] | None = None) -> None:
        """Check every invariant (InvariantViolation), between iterations. ``rows`` are the
        worker's rows after the last applied step; with a step still in flight they are audited
        as they will be once it has run (``project_rows``), the state the ledgers already show."""
        if rows is not None and self._in_flight:
            rows = project_rows(rows, [step for _, step in self._in_flight])
        audit_all(self.scheduler, rows)

    def describe_stall(self) -> str:
        """Why nothing can be scheduled: the waiting head and the numbers that refuse it."""
        s = self.scheduler
        if not s.waiting:
            return f"{len(s.running)} running requests scheduled nothing"
        head = s.waiting[0]
        need = s.allocator.blocks_for_length(head.num_tokens)
        return (
            f"request {head.request_id} waits for {need} blocks, {s.allocator.num_free} free, "
            f"reserve {s.watermark_blocks}, {len(s.running)} running: no iteration can change this"
        )

    # -- whole runs -----------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; one RequestOutput per prompt, in order, holding every
        generated token."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine")
        per = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per)} SamplingParams")
        ids = [f"gen-{self._next_step_id}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per, strict=True):
            self.add_request(request_id, prompt, p)
        collected: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        while self.has_unfinished() or self._in_flight:  # surplus steps drain too
            for out in self.step():
                collected[out.request_id].append(out)
        return [merge_outputs(rid, collected[rid]) for rid in ids]

    def stats(self) -> EngineStats:
        """The gauges and counters this engine keeps (see EngineStats for each meaning); the
        scheduler process fills in the ones about its sockets and peers."""
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_used=s.allocator.num_blocks - s.allocator.num_free,
            kv_blocks_total=s.allocator.num_blocks,
            num_preemptions_total=s.num_preemptions_total,
            num_steps_total=self._steps_applied,
            worker_ready=True,
            worker_busy_s_total=self._busy_s,
            steps_in_flight=len(self._in_flight),
            prefix_cache_queries=s.cache.queries,
            prefix_cache_hits=s.cache.hits,
            grammar_tokens_total=self._grammar[0],
            grammar_fill_s_total=self._grammar[1],
            grammar_apply_s_total=self._grammar[2],
        )
