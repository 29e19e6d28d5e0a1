"""``SlotPenalties``: what repetition, presence and frequency penalties need, kept on the device
per slot and updated there.

Per slot: which tokens the row has been fed (prompt included) and how often it generated each,
(num_slots, vocab) each. A row with penalties folds in every token fed to it, in the step that
feeds it (``fold``), from the step's token ids ON THE DEVICE: with overlap, a decode's input is
the token the previous step sampled, which the host has not seen yet. A fresh row's slot is
cleared first, and its prefix-cache hits (tokens that are never fed) come from the host. The
state is rebuilt from the scheduler's tokens whenever a row is begun again, so a preemption or a
new worker costs recompute only. ``apply`` then adjusts the sampled rows' scores as
``worker.sampling.sampler`` does, one batched operation per kind.

Host side (``pack_folds``): what to fold, as packed arrays (``worker.step.pack``).
"""

from __future__ import annotations

import torch

from protocol.messages import StepItem
from worker.rows import Row
from worker.step.pack import HostPack, Packed


def has_penalties(row: Row) -> bool:
    """Whether a row's parameters ask for any penalty (fixed for the row's life)."""
    params = row.params
    return bool(
        params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    )


def penalty_folds(items: list[StepItem], applied: list[tuple[Row, list[int]]]) -> list[tuple]:
    """What each penalty row of a step folds in, for ``pack_folds``: (slot, row, fresh, its cache
    hits when fresh, the step position of its first token, its token count)."""
    folds, offset = [], 0
    for item, (row, tokens) in zip(items, applied, strict=True):
        if has_penalties(row):
            cached = list(item.cached_token_ids) if item.fresh else []
            folds.append((item.slot, row, item.fresh, cached, offset, len(tokens)))
        offset += len(tokens)
    return folds


def pack_folds(pack: HostPack, folds: list[tuple[int, Row, bool, list[int], int, int]]) -> bool:
    """Add what the step's penalty rows fold in: per row (slot, row, fresh, host tokens,
    offset, count) -- its cache hits ``host tokens`` when fresh, then its ``count`` tokens fed at
    step positions ``[offset, offset + count)``. A token counts as generated at a history index
    at or past the row's prompt. Returns whether there is anything to fold."""
    reset, slots, tokens, generated = [], [], [], []
    for slot, row, fresh, cached, offset, count in folds:
        if fresh:
            reset.append(slot)
        first = len(row.history) - count - len(cached)  # history index of the first one
        for k, token in enumerate(cached):
            slots.append(slot)
            tokens.append(token)
            generated.append(first + k >= row.prompt_len)
        first += len(cached)
        for k in range(count):
            slots.append(slot)
            tokens.append(-1 - (offset + k))  # negative: the step's fed token at that position
            generated.append(first + k >= row.prompt_len)
    if not slots and not reset:
        return False
    pack.add("p.reset", reset)
    pack.add("p.slot", slots)
    pack.add("p.token", tokens)
    pack.add("p.generated", generated, torch.float32)
    return True


class SlotPenalties:
    """Seen tokens and generated-token counts per slot, built on the first penalty row."""

    def __init__(self, num_slots: int, vocab: int, device: str) -> None:
        self.num_slots, self.vocab, self.device = num_slots, vocab, device
        self.seen: torch.Tensor | None = None  # (num_slots, vocab) bool
        self.counts: torch.Tensor | None = None  # (num_slots, vocab) float32

    def fold(self, packed: Packed, fed: torch.Tensor) -> None:
        """Fold in what ``pack_folds`` packed; ``fed`` (T,) is the step's token ids on the
        device, pending ones already fed."""
        if self.seen is None:
            shape = (self.num_slots, self.vocab)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
        reset = packed["p.reset"]
        self.seen.index_fill_(0, reset, False)
        self.counts.index_fill_(0, reset, 0.0)
        token = packed["p.token"]  # (N,)
        if fed.numel():  # (a fold of cache hits alone may come without a step's tokens)
            token = torch.where(token >= 0, token, fed[(-1 - token).clamp(min=0)])
        slot = packed["p.slot"]
        self.seen[slot, token] = True
        # Adding 0 or 1 to each (slot, token): a boolean selection would ask the device its size.
        self.counts.index_put_((slot, token), packed["p.generated"], accumulate=True)

    def apply(self, scores: torch.Tensor, slots: torch.Tensor, packed: Packed, plan) -> None:
        """Repetition, then presence and frequency penalties, in place on the sampled rows'
        scores (S, vocab); ``slots`` (S,) are their slots, ``plan`` their ``SamplingPlan``."""
        if plan.repetition:
            rows = packed["s.rep"]
            sub = scores[rows]  # (R, vocab)
            penalty = packed["s.rep_value"][:, None]
            penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
            scores[rows] = torch.where(self.seen[slots[rows]], penalized, sub)
        if plan.presence:
            rows = packed["s.pres"]
            sub = scores[rows]
            counts = self.counts[slots[rows]]  # (R, vocab)
            sub -= packed["s.freq_value"][:, None] * counts
            sub -= packed["s.pres_value"][:, None] * (counts > 0).to(sub)
            scores[rows] = sub
