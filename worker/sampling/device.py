"""``DeviceSampler``: one step's sampling as batched tensor operations, where the logits are.

It computes what ``worker.sampling.sampler.Sampler`` (the reference) computes, row for row, without
a Python loop over rows and without asking the device anything: the per-row parameters come in
the step's pack (``worker.sampling.inputs``), penalties read per-slot state kept on the device
(``worker.sampling.penalties``), and what the host needs back (the sampled ids, and the logprobs
asked for) leaves in one copy that does not block (``worker.step.pack.download``).

Order per row, as the reference: repetition, presence and frequency penalties, logit_bias and
min_tokens on the raw logits, then the grammar's mask; greedy rows take the argmax, the others
divide by temperature, keep top_k, top_p and min_p, and draw once with their seeded uniform.
Logprobs come from the RAW logits.

The sampled ids also stay on the device: ``last_ids`` (num_slots,) holds each slot's latest
sample, which the next step feeds to a row whose input is ``PENDING_TOKEN``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.sampling.inputs import SamplingPlan
from worker.sampling.penalties import SlotPenalties
from worker.sampling.sampler import ARGMAX, draw_tokens
from worker.step.pack import Packed


@dataclass(frozen=True)
class Sampled:
    """One step's samples on the device."""

    tokens: torch.Tensor  # (S,) int64
    logprob: torch.Tensor | None  # (L,) float32: each logprob row's sampled token's
    top_logprobs: torch.Tensor | None  # (L, top) float32, best first
    top_ids: torch.Tensor | None  # (L, top) int64

    def outputs(self) -> list[torch.Tensor]:
        """What goes back to the host, in this order (None left out)."""
        parts = (self.tokens, self.logprob, self.top_logprobs, self.top_ids)
        return [part for part in parts if part is not None]


class DeviceSampler:
    """Samples the rows of a step from their logits, on the logits' device."""

    def __init__(self, *, num_slots: int, vocab: int, device: str, argmax: str = "torch") -> None:
        self.argmax = argmax
        self._argmax = ARGMAX[argmax]
        self.vocab = vocab
        self.last_ids = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.penalties = SlotPenalties(num_slots, vocab, device)
        self._bit = torch.arange(vocab, device=device)  # (vocab,) for unpacking grammar masks

    def fed(self, ids: torch.Tensor, feed: torch.Tensor | None) -> torch.Tensor:
        """The step's input ids (T,) with each pending token fed from ``last_ids``: ``feed``
        (T,) names the slot whose latest sample goes there, or -1 (None: nothing pending)."""
        if feed is None:
            return ids
        return torch.where(feed >= 0, self.last_ids[feed.clamp(min=0)], ids)

    def sample(
        self,
        logits: torch.Tensor,
        packed: Packed,
        plan: SamplingPlan,
        allowed: torch.Tensor | None = None,
    ) -> Sampled:
        """logits (S, vocab) of the sampled rows -> their samples. ``allowed`` (G, vocab) bool:
        the tokens each constrained row (``plan.grammar``) may take."""
        logits = logits.float()
        slots = packed["s.slot"]  # (S,)
        scores = logits.clone() if plan.adjusts else logits  # plain rows need no copy
        self.penalties.apply(scores, slots, packed, plan)
        if plan.bias:
            where = (packed["s.bias_row"], packed["s.bias_token"])
            scores[where] = scores[where] + packed["s.bias"]
        if plan.bans:
            scores[packed["s.ban_row"], packed["s.ban_token"]] = float("-inf")
        if plan.grammar:
            self._mask(scores, logits, packed, allowed)
        tokens = self._argmax(scores)  # (S,) every row's greedy choice
        if plan.drawing:
            rows = packed["s.draw"]
            chosen = draw_tokens(
                scores[rows],
                temperature=packed["s.temperature"],
                top_k=packed["s.top_k"],
                top_p=packed["s.top_p"],
                min_p=packed["s.min_p"],
                uniforms=packed["s.uniform"],
            )
            tokens = tokens.index_copy(0, rows, chosen.to(tokens.dtype))
        self.last_ids.index_copy_(0, slots, tokens)
        return self._with_logprobs(logits, tokens, packed, plan)

    def unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """Grammar bitmasks (G, words) int32, bit ``t % 32`` of word ``t // 32`` for token t ->
        (G, vocab) bool, on the device."""
        words = bitmask[:, self._bit // 32]  # (G, vocab)
        return ((words >> (self._bit % 32).to(words.dtype)) & 1).bool()

    def _mask(self, scores, logits, packed: Packed, allowed: torch.Tensor) -> None:
        """Forbid what each constrained row's grammar forbids. Where min_tokens banned all the
        grammar allows (EOS, once it is complete), the grammar wins: those tokens come back with
        their raw logits, so no row is left with nothing."""
        rows = packed["s.grammar"]  # (G,)
        masked = scores[rows].masked_fill_(allowed.logical_not(), float("-inf"))
        dead = packed["s.fallback"] & ~torch.isfinite(masked).any(dim=-1)  # (G,)
        raw = torch.where(allowed, logits[rows], float("-inf"))
        scores[rows] = torch.where(dead[:, None], raw, masked)

    def _with_logprobs(self, logits, tokens, packed: Packed, plan: SamplingPlan) -> Sampled:
        if "s.logprobs" not in packed:
            return Sampled(tokens, None, None, None)
        rows = packed["s.logprobs"]  # (L,)
        logprobs = torch.log_softmax(logits[rows], dim=-1)  # (L, vocab) from the raw logits
        chosen = logprobs.gather(1, tokens[rows][:, None]).squeeze(1)
        if not plan.top:
            return Sampled(tokens, chosen, None, None)
        values, ids = logprobs.topk(plan.top, dim=-1)
        return Sampled(tokens, chosen, values, ids)
