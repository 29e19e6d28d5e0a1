"""A test-side stand-in for the scheduler: assigns slots and blocks and builds StepInputs.

Each request keeps its known tokens (prompt + sampled). Every step, each unfinished request sends
the tokens it has not cached yet (at most ``chunk`` of them), sampling only when that reaches the
end. ``recompute_after`` throws a request's row away once it has that many outputs and restarts
it from position 0 with everything it knows, as the scheduler does after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import SamplingParams, StepInput, StepItem

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


@dataclass
class Request:
    """One request as the driver tracks it."""

    request_id: str
    prompt: list[int]
    max_new: int
    params: SamplingParams = GREEDY
    output: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)  # (vocab,) per sampled token
    samples: list = field(default_factory=list)
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    recomputed: bool = False
    done: bool = False
    forced: list[int] | None = None  # feed these tokens instead of the sampled ones

    @property
    def known(self) -> list[int]:
        return self.prompt + self.output


class Driver:
    """Runs requests to completion on a worker, one StepInput at a time."""

    def __init__(self, worker, *, eos: list[int] | None = None, audit: bool = True) -> None:
        ready = worker.ready()
        self.worker = worker
        self.block_size = ready.block_size
        self.free_blocks = list(range(ready.num_blocks))
        self.free_slots = list(range(ready.num_slots))
        self.eos = set(ready.eos_token_ids if eos is None else eos)
        self.audit = audit
        self.step_id = 0
        self.pending_release: list[int] = []

    def run(self, requests: list[Request], chunk: int | None = None, recompute_after=None):
        """Step until every request is done; returns the requests."""
        while not all(r.done for r in requests):
            self.step([r for r in requests if not r.done], chunk, recompute_after)
        self.step([], None, None)  # flush releases so the audit sees empty rows
        return requests

    def step(self, active: list[Request], chunk, recompute_after) -> None:
        items = []
        for req in active:
            if recompute_after is not None and not req.recomputed:
                if len(req.output) >= recompute_after:
                    self._release(req)
                    req.recomputed = True
            items.append(self._item(req, chunk))
        step = StepInput(
            step_id=self.step_id, items=items, released_slots=self.pending_release, audit=self.audit
        )
        self.pending_release = []
        self.step_id += 1
        result, logits = self.worker.execute_with_logits(step)
        by_id = {r.request_id: r for r in active}
        for sample, row_logits in zip(result.samples, logits, strict=True):
            req = by_id[sample.request_id]
            token = sample.token_id if req.forced is None else req.forced[len(req.output)]
            req.output.append(token)
            req.logits.append(row_logits)
            req.samples.append(sample)
            if len(req.output) >= req.max_new or token in self.eos:
                req.done = True
                self._release(req)
        if result.rows is not None:
            self._check_audit(result.rows, active)

    def _item(self, req: Request, chunk) -> StepItem:
        if req.slot is None:
            req.slot = self.free_slots.pop(0)
        known = req.known
        end = len(known) if chunk is None else min(len(known), req.num_cached + chunk)
        need = -(-end // self.block_size) - len(req.blocks)
        new_blocks = [self.free_blocks.pop(0) for _ in range(max(0, need))]
        req.blocks += new_blocks
        start = req.num_cached
        req.num_cached = end
        return StepItem(
            request_id=req.request_id,
            slot=req.slot,
            new_blocks=new_blocks,
            token_ids=known[start:end],
            start=start,
            sample=end == len(known),
            params=req.params if start == 0 else None,
            prompt_len=len(req.prompt) if start == 0 else 0,
            fresh=start == 0,
        )

    def _release(self, req: Request) -> None:
        self.free_blocks += req.blocks
        self.free_slots.append(req.slot)
        self.pending_release.append(req.slot)
        req.slot, req.blocks, req.num_cached = None, [], 0

    def _check_audit(self, rows, active: list[Request]) -> None:
        for req in active:
            if req.slot is None:
                continue
            row = rows[req.slot]
            if (row.request_id, row.block_ids, row.num_cached) != (
                req.request_id,
                req.blocks,
                req.num_cached,
            ):
                raise AssertionError(f"audit mismatch for {req.request_id}: {row}")


def greedy_requests(prompts: list[list[int]], max_new: int) -> list[Request]:
    """One greedy Request per prompt, ids r0, r1, ..."""
    return [Request(f"r{i}", list(p), max_new) for i, p in enumerate(prompts)]
