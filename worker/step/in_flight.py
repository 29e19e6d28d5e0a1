"""``Launched``: a step whose work is queued on the device, and its result once it is back.

``Worker.launch`` queues a step's copy in, forward and sampling, and starts the sampled ids'
copy back without waiting for any of it; the host is then free to prepare the next step while
the device runs this one. ``resolve`` waits for the ids (the one wait a step has) and writes
them where the host keeps them: a row fed its token already, by a later step that named it
``PENDING_TOKEN`` (``worker.rows``), holds a placeholder in its history there, replaced now;
a row not fed yet keeps it as ``last_sampled``. ``samples`` turns them into the StepResult's
samples, with the logprobs asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from protocol.messages import PENDING_TOKEN, RowSummary, Sample, StepInput, StepItem
from worker.grammar import PendingMasks
from worker.rows import Row
from worker.sampling.inputs import SamplingPlan
from worker.step.fences import Fence


@dataclass
class Launched:
    """One launched step. ``sampled``: each sampled position's item, its row and the history
    index its token takes when fed (None for a draft item's positions, which the row never
    feeds back); ``host``: the downloaded outputs (``Sampled.outputs``' order)."""

    step: StepInput
    sampled: list[tuple[StepItem, Row, int]]
    plan: SamplingPlan | None
    host: list[torch.Tensor]
    fence: Fence
    masks: PendingMasks | None = None
    rows: list[RowSummary] | None = None  # the rows after this step, when it asks an audit
    logits: torch.Tensor | None = None  # (S, vocab) float32 on the device
    launch_s: float = 0.0  # the host's seconds launching it
    wait_s: float = 0.0  # the host's seconds waiting for it
    filled: list[int] = field(default_factory=list)  # blocks it fills: summed once it is done
    verified: list[tuple[int, int]] = field(default_factory=list)  # its verify_blocks' sums
    # the slots it writes into blocks it leaves partial, summed once it is done, and the sums
    # of its verify_ranges
    partial: list[tuple[int, int, int]] = field(default_factory=list)
    verified_ranges: list[tuple[int, int, int, int]] = field(default_factory=list)
    sums: object | None = None  # a device pool's sums of filled and partial, on their way back
    _tokens: list[int] | None = field(default=None, repr=False)

    def done(self) -> bool:
        """Whether the sampled ids are back (never blocks)."""
        return self.fence.done()

    def resolve(self) -> list[int]:
        """Wait for the sampled ids and, the first time, write them into the rows."""
        if self._tokens is not None:
            return self._tokens
        if not self.fence.done():
            began = time.perf_counter()
            self.fence.wait()
            self.wait_s += time.perf_counter() - began
        tokens = self.host[0].tolist() if self.sampled else []
        for (_, row, index), token in zip(self.sampled, tokens, strict=True):
            if index is None:  # a draft item's: the scheduler decides what it keeps
                continue
            if len(row.history) > index:  # fed already, by a later step
                if row.history[index] == PENDING_TOKEN:
                    row.history[index] = token
            else:
                row.last_sampled = token
        self._tokens = tokens
        return tokens

    def samples(self) -> list[Sample]:
        """The step's samples, in item order, with the logprobs their rows asked for."""
        tokens = self.resolve()
        wants = self.plan.logprobs if self.plan else []
        chosen = top_values = top_ids = None
        if any(n is not None for n in wants):
            chosen = self.host[1].tolist()
            if self.plan.top:
                top_values, top_ids = self.host[2].tolist(), self.host[3].tolist()
        out, k, position = [], 0, 0
        for (item, _, _), token, n in zip(self.sampled, tokens, wants, strict=True):
            position += 1
            if item.num_draft:  # its first position's entry stands for all of its positions
                if position == 1 or self.sampled[position - 2][0] is not item:
                    more = tokens[position : position + item.num_draft]
                    sample = Sample(request_id=item.request_id, token_id=token, draft_samples=more)
                    out.append(sample)
                continue
            if n is None:
                out.append(Sample(request_id=item.request_id, token_id=token))
                continue
            top = list(zip(top_ids[k][:n], top_values[k][:n], strict=True)) if n else None
            sample = Sample(
                request_id=item.request_id, token_id=token, logprob=chosen[k], top_logprobs=top
            )
            out.append(sample)
            k += 1
        return out
