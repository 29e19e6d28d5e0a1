"""``Sampler``: the reference sampler, one row at a time in plain torch, and the numerics the
worker's own sampler shares with it.

The worker samples with ``worker.sampling.device.DeviceSampler``, the same computation as batched
operations on the device; tests/worker/test_device_sampler.py holds it to this one's tokens. Both
draw with ``draw_tokens``, greedy rows take the plan's ``ARGMAX``, and uniforms come from
``seeded_uniform``.

Order per row: penalties, logit_bias and min_tokens on the raw logits, then the grammar's mask
(``worker.grammar``); then greedy rows take the argmax, and the others divide by temperature and
keep top_k, then top_p, then min_p (as transformers' warpers do) before one seeded draw.
Logprobs come from the RAW logits, as vLLM's do by default.

A seeded row draws from a generator seeded with (seed, output index), so its token depends on
neither the rest of the batch nor on whether its cache was recomputed after a preemption.

Penalties read running per-row tensors (tokens seen, generated-token counts) that fold in only
the tokens new since the row's last step: no step costs time in proportion to the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.grammar import PendingMasks
from worker.rows import Row

_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: spreads (seed, index) over 64 bits
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Draw:
    """One row's outcome: the token and, when asked, its logprob and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class _PenaltyState:
    """What penalties need of a row's history, kept up to date one step at a time."""

    seen: torch.Tensor  # (vocab,) bool: every token fed into the row, prompt included
    counts: torch.Tensor  # (vocab,) float32: how often each token was generated
    folded: int = 0  # how many tokens of row.history are counted in


def _penalty_state(row: Row, vocab: int, device: torch.device) -> _PenaltyState:
    state = row.penalty_state
    if state is None:
        state = _PenaltyState(
            torch.zeros(vocab, dtype=torch.bool, device=device),
            torch.zeros(vocab, dtype=torch.float32, device=device),
        )
        row.penalty_state = state
    new = row.history[state.folded :]
    if new:
        state.seen[torch.tensor(new, device=device)] = True
        generated = row.history[max(state.folded, row.prompt_len) :]
        if generated:
            ids = torch.tensor(generated, device=device)
            state.counts += torch.bincount(ids, minlength=vocab).to(state.counts)
        state.folded = len(row.history)
    return state


def _torch_argmax(scores: torch.Tensor) -> torch.Tensor:
    return scores.argmax(dim=-1)


def _kernel_argmax(scores: torch.Tensor) -> torch.Tensor:
    if scores.stride(-1) != 1:  # the kernel reads rows in place
        return scores.argmax(dim=-1)
    return torch.ops.nanoserve.argmax(scores)


# The plan's greedy choices (``Plan.argmax``): "kernel" is ``torch.ops.nanoserve.argmax``
# (``worker.cpu.kernels``, CPU), torch.argmax's answer in a vectorized pass, where torch's own CPU
# argmax does not vectorize.
ARGMAX = {"torch": _torch_argmax, "kernel": _kernel_argmax}


class Sampler:
    """Samples a batch of rows; knows the model's EOS ids for ``min_tokens``. Greedy choices come
    from ``argmax``, the plan's name for it (``ARGMAX``)."""

    def __init__(self, eos_token_ids: list[int], argmax: str = "torch") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.argmax = argmax
        self._argmax = ARGMAX[argmax]

    def sample(
        self, logits: torch.Tensor, rows: list[Row], masks: PendingMasks | None = None
    ) -> list[Draw]:
        """logits: float32 (S, vocab), one line per row -> one Draw per row. ``masks``: the
        grammar masks of the constrained rows among them (``GrammarMasks.start``)."""
        logits = logits.float()
        adjusted = [i for i, row in enumerate(rows) if self._needs_adjusting(row)]
        copy = adjusted or masks is not None
        scores = logits.clone() if copy else logits  # plain greedy rows need no copy
        for i in adjusted:
            self._adjust(scores[i], rows[i])
        if masks is not None:
            masks.apply(scores, logits, rows)
        tokens = self._argmax(scores)  # (S,) the greedy choice of every row, in one call
        random_rows = [i for i, row in enumerate(rows) if row.params.temperature > 0]
        if random_rows:
            chosen = self._draw(scores[random_rows], [rows[i] for i in random_rows])
            tokens[random_rows] = chosen.to(tokens.device)
        return self._with_logprobs(logits, tokens.tolist(), rows)

    @staticmethod
    def _needs_adjusting(row: Row) -> bool:
        """Whether ``_adjust`` would change anything for this row."""
        params = row.params
        return bool(
            params.repetition_penalty != 1.0
            or params.presence_penalty
            or params.frequency_penalty
            or params.logit_bias
            or params.min_tokens > 0
        )

    def _adjust(self, scores: torch.Tensor, row: Row) -> None:
        """Penalties, logit_bias and min_tokens, in place on one row's (vocab,) scores."""
        params, outputs = row.params, row.output_tokens
        vocab = scores.shape[0]
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            state = _penalty_state(row, vocab, scores.device)
        if params.repetition_penalty != 1.0 and row.history:
            penalty = params.repetition_penalty
            penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
            scores.copy_(torch.where(state.seen, penalized, scores))
        if (params.presence_penalty or params.frequency_penalty) and outputs:
            counts = state.counts.to(scores)
            scores -= params.frequency_penalty * counts
            scores -= params.presence_penalty * (counts > 0).to(scores)
        for token, bias in (params.logit_bias or {}).items():
            if 0 <= token < vocab:
                scores[token] += bias
        if len(outputs) < params.min_tokens:
            banned = [t for t in self.eos_token_ids + params.stop_token_ids if 0 <= t < vocab]
            scores[banned] = float("-inf")

    def _draw(self, scores: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Temperature, top_k, top_p, min_p, then one inverse-CDF draw per row -> (R,)."""
        device = scores.device
        return draw_tokens(
            scores,
            temperature=torch.tensor([r.params.temperature for r in rows], device=device),
            top_k=_top_k([r.params.top_k for r in rows], scores.shape[-1], device),
            top_p=_top_p([r.params.top_p for r in rows], device),
            min_p=torch.tensor([r.params.min_p for r in rows], device=device),
            uniforms=torch.tensor([seeded_uniform(r) for r in rows], dtype=torch.float64),
        )

    def _with_logprobs(self, logits, tokens: list[int], rows: list[Row]) -> list[Draw]:
        wants = [row.params.logprobs for row in rows]
        if all(n is None for n in wants):
            return [Draw(token) for token in tokens]
        logprobs = torch.log_softmax(logits, dim=-1)  # (S, vocab) from the raw logits
        draws = []
        for i, (token, n) in enumerate(zip(tokens, wants, strict=True)):
            if n is None:
                draws.append(Draw(token))
                continue
            top = None
            if n > 0:
                values, ids = logprobs[i].topk(min(n, 20))
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            draws.append(Draw(token, float(logprobs[i, token]), top))
        return draws


def draw_tokens(
    scores: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One draw per row of scores (R, vocab): divided by its temperature (R,), filtered
    (``filtered_probs_of``), then the token where the float64 CDF first passes the row's
    uniform (R,) -> token ids (R,)."""
    probs, order = filtered_probs_of(
        scores / temperature[:, None], top_k=top_k, top_p=top_p, min_p=min_p
    )
    cdf = probs.double().cumsum(dim=-1)  # (R, vocab), sorted best first
    targets = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]  # (R, 1)
    index = torch.searchsorted(cdf, targets, right=True)  # (R, 1)
    kept = (probs > 0).sum(dim=-1, keepdim=True)
    index = torch.minimum(index, kept - 1)
    return order.gather(1, index).squeeze(1)


def filtered_probs(
    scores: torch.Tensor, *, top_k: list, top_p: list, min_p: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """``filtered_probs_of`` with each row's filters given as lists (None: no top_k)."""
    device = scores.device
    return filtered_probs_of(
        scores,
        top_k=_top_k(top_k, scores.shape[-1], device),
        top_p=_top_p(top_p, device),
        min_p=torch.tensor(min_p, device=device, dtype=torch.float32),
    )


def filtered_probs_of(
    scores: torch.Tensor, *, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after top_k, top_p and min_p, sorted best first, with the sort order.

    scores: (R, vocab) already divided by temperature; top_k (R,) int64, at most vocab; top_p
    (R,) float32, infinite where off; min_p (R,) float32. Returns probs (R, vocab), zero where
    filtered out and renormalized, and order (R, vocab) mapping sorted position -> token id.
    Every filter keeps a prefix of the sorted list, and always the best token.
    """
    vocab = scores.shape[-1]
    ordered, order = scores.sort(dim=-1, descending=True)  # (R, vocab)
    rank = torch.arange(vocab, device=scores.device)[None, :]  # (1, vocab)
    ordered = ordered.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # top_p keeps a token while the mass strictly before it is below p (transformers' rule).
    before = probs.cumsum(dim=-1) - probs
    ordered = ordered.masked_fill(before >= top_p[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    floor = min_p.to(probs.dtype)[:, None] * probs[:, :1]
    ordered = ordered.masked_fill(probs < floor, float("-inf"))
    return torch.softmax(ordered, dim=-1), order


def _top_k(values: list, vocab: int, device) -> torch.Tensor:
    return torch.tensor([vocab if v is None else min(v, vocab) for v in values], device=device)


def _top_p(values: list, device) -> torch.Tensor:
    """top_p >= 1 is "off": cumsum rounding must not trim the tail, so it becomes infinite."""
    return torch.tensor([v if v < 1 else float("inf") for v in values], device=device)


def seeded_uniform(row: Row, index: int | None = None) -> float:
    """A uniform in [0, 1) fixed by the row's seed and the index of the token being drawn
    (``index``; by default the row's next)."""
    index = len(row.output_tokens) if index is None else index
    generator = torch.Generator().manual_seed((row.seed * _MIX + index) & _MASK64)
    return float(torch.rand((), generator=generator, dtype=torch.float64))
