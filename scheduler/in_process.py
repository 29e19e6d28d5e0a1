"""InProcessRuns: the engine driven with its worker in this process (``step``, ``drain``,
``generate``), as the tests, the soak, the sweeps and ``nanoserve generate`` run it. The
scheduler process runs the same ``plan``/``apply`` loop with its worker across a socket.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from protocol.messages import RequestOutput, SamplingParams
from scheduler.batch import merge_outputs
from scheduler.errors import LivelockError

if TYPE_CHECKING:
    from scheduler.engine import Engine

_RUNS = itertools.count()  # tells apart the request ids of successive generate() calls


class InProcessRuns:
    """Engine's methods that run steps on ``self.worker``, a worker in this process."""

    def step(self: Engine) -> list[RequestOutput]:
        """Plan up to ``depth`` steps ahead, run the oldest on the in-process worker, apply it,
        then audit when auditing is on. With overlap this is the process loop's order exactly:
        step N+1 is planned before step N's samples are known."""
        if self.worker is None:
            raise RuntimeError("this engine has no in-process worker: use plan() and apply()")
        while self.can_plan() and self.plan() is not None:
            pass
        if not self.num_in_flight:
            if self.has_unfinished():
                raise LivelockError(self.describe_stall())
            return []
        result = self.worker.execute(self.in_flight[0])
        outputs = self.apply(result)
        if self.config.audit:
            self.audit(result.rows if result.rows is not None else self.worker.rows())
        return outputs

    def drain(self: Engine) -> list[RequestOutput]:
        """Run and apply every step still in flight on the in-process worker, planning nothing
        new; their samples are surplus unless a request is still running."""
        outputs = []
        while self.num_in_flight:
            outputs += self.apply(self.worker.execute(self.in_flight[0]))
        return outputs

    def describe_stall(self: Engine) -> str:
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

    def generate(
        self: Engine,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; one RequestOutput per prompt, in order, holding every
        generated token."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine")
        per = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per)} SamplingParams")
        run = next(_RUNS)
        ids = [f"gen-{run}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per, strict=True):
            self.add_request(request_id, prompt, p)
        collected: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        while self.has_unfinished() or self.num_in_flight:  # surplus steps drain too
            for out in self.step():
                collected[out.request_id].append(out)
        return [merge_outputs(rid, collected[rid]) for rid in ids]
