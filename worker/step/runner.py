"""``StepRunner``: queues one applied step on the device, and waits for none of it.

For each step the worker has checked and applied to its rows, ``queue``:

1. packs everything the step needs (``worker.step.inputs``, the block tables' changes, the
   penalty rows' tokens, the sampled rows' parameters) and sends it in one copy
   (``worker.step.pack``);
2. feeds each pending token from the device's own copy of its row's last sample, and folds the
   step's tokens into the penalty rows' state, on the device (``worker.sampling.device``);
3. runs the forward: a captured decode graph where one fits (``worker.step.graphs``), the compiled
   CPU step where it accepts the step (``worker.compiled``), else the eager model;
4. samples on the device, and starts the samples' copy back (``Launched``).

Nothing in it waits for the device. A step with a constrained row waits for the previous
steps' sampled ids (its matcher advances on the host) once its forward is queued, and its masks
go in by a copy of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from protocol.messages import StepInput
from worker.grammar import PendingMasks
from worker.sampling.device import DeviceSampler
from worker.sampling.inputs import pack_sampling
from worker.sampling.penalties import pack_folds, penalty_folds
from worker.step.fences import DoneFence
from worker.step.graphs import DecodeGraphs
from worker.step.in_flight import Launched
from worker.step.inputs import StepInputs
from worker.step.pack import Packed, Staging, download


class StepRunner:
    """The device side of a worker's steps: its sampler, staging buffers and decode graphs."""

    def __init__(
        self,
        *,
        model,
        cache,
        attention,
        ops,
        plan,
        group,
        vocab: int,
        eos_token_ids: list[int],
        num_slots: int,
        max_model_len: int,
        compiled: Callable[[], object | None],
    ) -> None:
        self.model, self.cache, self.attention, self.ops = model, cache, attention, ops
        self.plan, self.group, self.vocab = plan, group, vocab
        self.eos_token_ids = list(eos_token_ids)
        self.compiled = compiled  # the compiled CPU decode step, once ready (or None)
        self.sampler = DeviceSampler(
            num_slots=num_slots, vocab=vocab, device=plan.device, argmax=plan.argmax
        )
        self.staging = Staging(plan.device, plan.pin_memory)
        self.graphs: DecodeGraphs | None = None
        if plan.compile == "cuda-graphs":
            self.graphs = DecodeGraphs(
                model=model,
                cache=cache,
                attention=attention,
                ops=ops,
                plan=plan,
                num_slots=num_slots,
                max_model_len=max_model_len,
            )
            self.graphs.capture()

    def queue(
        self,
        step: StepInput,
        applied,
        sampled,
        start_masks: Callable[[], PendingMasks | None],
        early: bool,
        audit,
    ) -> Launched:
        """Queue an applied step: ``applied`` is each item's (row, tokens) from
        ``RowTable.apply``, ``sampled`` the (item, row) this rank samples, ``start_masks``
        starts their grammar masks (before the forward is queued when ``early``, else after),
        ``audit`` the rows to report. Run under inference mode."""
        # One entry per sampled position: a draft item samples before each draft token too,
        # ``back`` the item's tokens after that position; its tokens go to the scheduler only.
        entries = [(i, r, back) for i, r in sampled for back in range(i.num_draft, -1, -1)]
        tracked = [(i, r, None if i.num_draft else len(r.history)) for i, r, _ in entries]
        masks = start_masks() if early else None
        if not step.items:
            return Launched(step, [], None, [], DoneFence(), masks, audit)
        pack = self.staging.pack()
        inputs = StepInputs.pack(
            pack,
            step.items,
            applied,
            attention=self.attention,
            trash_block=self.cache.trash_block,
            graphs=self.graphs,
        )
        if self.graphs is not None:
            self.graphs.tables.pack_updates(pack, step.items, [row for row, _ in applied])
        folds = self.group.leader and pack_folds(pack, penalty_folds(step.items, applied))
        rows, slots = [row for _, row, _ in entries], [item.slot for item, _, _ in entries]
        eos, vocab, backs = self.eos_token_ids, self.vocab, [back for _, _, back in entries]
        plan = pack_sampling(pack, rows, slots, eos, vocab, backs) if rows else None
        packed = pack.upload()
        ids = self.sampler.fed(packed["x.ids"], packed.get("x.feed"))  # (T,)
        if folds:
            self.sampler.penalties.fold(packed, ids)
        logits = self._forward(inputs, packed, ids)
        if not early:
            masks = start_masks()
        if not rows:
            return Launched(step, [], None, [], DoneFence(), masks, audit)
        allowed = None
        if masks is not None:  # a copy of its own: the masks are filled while the forward runs
            bits = torch.from_numpy(masks.filled()).to(self.plan.device, non_blocking=True)
            allowed = self.sampler.unpack(bits)
        out = self.sampler.sample(logits, packed, plan, allowed)
        host, fence = download(out.outputs(), self.plan.pin_memory)
        return Launched(step, tracked, plan, host, fence, masks, audit, logits)

    def _forward(self, inputs: StepInputs, packed: Packed, ids: torch.Tensor):
        """One flattened forward over the step's fed ``ids`` -> logits (S, vocab) float32 of
        the sampled items, on the device (on the leader; None on the other ranks)."""
        positions = packed["x.positions"]
        if self.graphs is not None:
            self.graphs.tables.apply(packed)
        if inputs.key is not None:
            hidden = self.graphs.run(packed, ids, positions, inputs.key)  # (B, hidden)
        else:
            meta = inputs.metadata(packed)
            compiled = self.compiled()
            if compiled is not None and compiled.accepts(meta):
                hidden = compiled(ids, positions, meta)  # (T, hidden)
            else:
                hidden = self.model(ids, positions, meta, self.cache, self.attention, self.ops)
        if not inputs.sampled:  # every rank knows it: the step is the same everywhere
            return torch.zeros(0, self.vocab) if self.group.leader else None
        scores = self.model.logits(hidden[packed["x.sampled"]])  # (S', vocab range)
        logits = self.group.gather_vocab(scores, self.vocab)
        return None if logits is None else logits[: len(inputs.sampled)]  # (S, vocab)
