"""soak: many more requests than slots through a pool far too small, audited every iteration.

Returns a SoakReport with what the pressure cost (evictions, recomputed K/V, thrash). The
checks hold between iterations; an InvariantViolation is re-raised naming the iteration.
LeakyAllocator is the fault to prove it: a free_all that drops one block id, once.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace

from protocol.messages import SamplingParams
from scheduler.audit import InvariantViolation
from scheduler.block_allocator import BlockAllocator
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine, WorkerLike
from scheduler.errors import LivelockError


class LeakyAllocator(BlockAllocator):
    """A BlockAllocator whose ``leak_on``-th free_all silently drops its first block id."""

    def __init__(self, num_blocks: int, block_size: int, leak_on: int) -> None:
        if leak_on < 1:
            raise ValueError(f"leak_on counts releases from 1, got {leak_on}")
        super().__init__(num_blocks, block_size)
        self.leak_on = leak_on
        self.releases = 0
        self.leaked: int | None = None

    def free_all(self, block_ids: list[int]) -> None:
        """Release as usual, except on the ``leak_on``-th call with any blocks in it."""
        if block_ids:
            self.releases += 1
            if self.releases == self.leak_on:
                self.leaked, block_ids = block_ids[0], block_ids[1:]
        super().free_all(block_ids)


@dataclass(frozen=True)
class SoakReport:
    """What one soak cost. ``recompute_share`` is the part of all computed K/V that had been
    computed before (bought a second time after a preemption); ``thrashed_admissions`` counts
    evictions of a request that had not outgrown the blocks its admission bought."""

    iterations: int
    evictions: int
    evictions_per_request: dict[str, int]
    max_preemptions: int
    recompute_share: float
    thrashed_admissions: int
    outputs: list[list[int]]
    prefix_queries: int = 0  # tokens of every admission
    prefix_hits: int = 0  # of those, found in the prefix cache
    drafts: int = 0  # verifications of draft tokens (speculative decoding)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    kills: int = 0  # worker deaths injected (``soak(kills=...)``)
    reattaches: int = 0  # of those, taken over by the next worker without recompute
    kill_recomputed: int = 0  # tokens computed again because of the kills
    kill_in_flight: int = 0  # tokens of the steps in flight at the kills: the bound on that

    @property
    def text_digest(self) -> str:
        """A short hash of every output token, to compare runs."""
        return hashlib.sha256(repr(self.outputs).encode()).hexdigest()[:12]

    def format(self) -> str:
        """The report as aligned lines for a terminal."""
        worst = max(self.evictions_per_request.values(), default=0)
        evicted = sum(1 for n in self.evictions_per_request.values() if n)
        return "\n".join(
            [
                f"iterations          {self.iterations}",
                f"evictions           {self.evictions} "
                f"({evicted} of {len(self.outputs)} requests evicted)",
                f"max_preemptions     {self.max_preemptions} (worst request evicted {worst}x)",
                f"recompute share     {self.recompute_share:.1%}",
                f"thrashed admissions {self.thrashed_admissions}",
                f"prefix cache hits   {self.prefix_hits} of {self.prefix_queries} tokens admitted",
                f"draft tokens        {self.accepted_tokens} of {self.draft_tokens} accepted "
                f"in {self.drafts} verifications",
                f"worker kills        {self.kills} ({self.reattaches} re-attached): "
                f"{self.kill_recomputed} tokens recomputed, {self.kill_in_flight} in flight",
                f"text digest         {self.text_digest}",
                "every block back, every slot back, every row empty",
            ]
        )


def make_prompts(
    num_requests: int, prompt_len: int, vocab_size: int, seed: int = 0, shared_prefix: int = 0
) -> list[list[int]]:
    """Seeded random prompts (token ids below ``vocab_size``), each opening with the same
    ``shared_prefix`` tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
    return [
        head + [rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)
    ]


def soak(
    worker: WorkerLike,
    config: SchedulerConfig,
    prompts: list[list[int]],
    params: SamplingParams,
    allocator: BlockAllocator | None = None,
    kills: int = 0,
    seed: int = 0,
) -> SoakReport:
    """Drain ``prompts`` through the worker with the audit on between every iteration.

    ``kills``: the worker dies that many times, at iterations drawn with ``seed``, each time
    after running, half the times, the oldest step in flight without answering it (K/V written
    that no result acknowledged); its ``successor()`` on the same pool takes over
    (``SimWorker``)."""
    engine = Engine.for_worker(worker, replace(config, audit=True), allocator=allocator)
    rng = random.Random(seed)
    kill_at = set(rng.sample(range(1, 4 * len(prompts) + 1), kills)) if kills else set()
    in_flight = 0
    ids = [f"soak-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    requests = {rid: engine.scheduler.get(rid) for rid in ids}
    sched = engine.scheduler
    iteration = 0
    while engine.has_unfinished():
        iteration += 1
        if iteration in kill_at:
            in_flight += _kill(engine, rng)
            sched = engine.scheduler
        before = (sched.num_preemptions_total, sched.tokens_scheduled, engine.checks)
        try:
            outputs = engine.step()
        except InvariantViolation as exc:
            raise InvariantViolation(f"at iteration {iteration}: {exc}") from exc
        stalled = before == (sched.num_preemptions_total, sched.tokens_scheduled, engine.checks)
        if not outputs and stalled and not engine.num_in_flight:
            if engine.has_unfinished():
                raise LivelockError(f"at iteration {iteration}: {engine.describe_stall()}")
    _check_everything_back(engine, engine.worker, iteration)
    per_request = {rid: r.num_preemptions for rid, r in requests.items()}
    return SoakReport(
        iterations=iteration,
        evictions=sched.num_preemptions_total,
        evictions_per_request=per_request,
        max_preemptions=max(per_request.values(), default=0),
        recompute_share=sched.tokens_recomputed / max(1, sched.tokens_scheduled),
        thrashed_admissions=sched.thrashed_admissions,
        outputs=[list(r.output_token_ids) for r in requests.values()],
        prefix_queries=sched.cache.queries,
        prefix_hits=sched.cache.hits,
        drafts=sched.speculation.drafts_total,
        draft_tokens=sched.speculation.draft_tokens_total,
        accepted_tokens=sched.speculation.accepted_total,
        kills=len(kill_at & set(range(1, iteration + 1))),
        reattaches=engine.restarts.reattaches,
        kill_recomputed=engine.restarts.tokens_recomputed,
        kill_in_flight=in_flight,
    )


def _kill(engine: Engine, rng: random.Random) -> int:
    """Kill the engine's worker mid-run and start its successor on the same pool; returns the
    tokens of the steps that were in flight."""
    worker = engine.worker
    while engine.can_plan() and engine.plan() is not None:
        pass  # it dies with as many steps in flight as it may have
    in_flight = sum(len(item.token_ids) for step in engine.in_flight for item in step.items)
    if engine.in_flight and rng.random() < 0.5:
        worker.execute(engine.in_flight[0])  # it wrote this step's K/V, then died unanswered
    engine.worker_lost(keep=True)
    engine.worker = worker.successor()
    ended = engine.fit(engine.worker.ready())
    if ended:
        raise InvariantViolation(f"a re-attach ended {len(ended)} requests")
    return in_flight


def _check_everything_back(engine: Engine, worker: WorkerLike, iteration: int) -> None:
    # Surplus steps (overlap) run, then one last (empty) step delivers the releases decided by
    # the final apply.
    engine.drain()
    step = engine.plan()
    if step is not None:
        engine.apply(worker.execute(step))
    rows = worker.rows()
    try:
        engine.audit(rows)
    except InvariantViolation as exc:
        raise InvariantViolation(f"at the end (iteration {iteration}): {exc}") from exc
    sched = engine.scheduler
    if sched.allocator.num_free != sched.allocator.num_blocks:
        raise InvariantViolation(
            f"at the end: {sched.allocator.num_free} blocks free of {sched.allocator.num_blocks}"
        )
    busy = [r.slot for r in rows if r.request_id is not None or r.block_ids or r.num_cached]
    if busy or len(sched.slots.free) != sched.num_slots:
        raise InvariantViolation(f"at the end: slot {busy[:1] or sched.slots.free} is not empty")
