"""Draft tokens from a request's own context (prompt lookup), and when to stop asking for them.

``NgramIndex`` proposes drafts: the longest suffix of the request's known tokens (``MAX_N`` down
to ``MIN_N`` tokens) that occurred earlier in them names the tokens that followed its latest
earlier occurrence. The index maps each n-gram to where its latest occurrence ends and grows by
one entry per n for each new token, so a lookup costs O(MAX_N), never O(context). It holds only
known tokens, which never change (a preemption keeps them), so it is never rolled back.

``DraftState`` adapts. A verification in flight keeps its request out of the next step (where
that one starts depends on how many drafts are accepted), so in a busy batch a verification
costs the request two steps, alone one; and a step with drafts costs more than a decode (on a
CPU each draft is a row of 4-bit arithmetic; the scheduler measures the ratio from the worker's
step times). So it keeps a moving average of the tokens each verification gained per decode
step's worth of time it cost the request,
and a request whose average falls under ``MIN_GAIN`` stops drafting for a pause that doubles up
to ``MAX_PAUSE`` steps, then probes again. A lookup that finds nothing costs only the lookup
(the request decodes plainly, with overlap).

Torch-free, like every scheduler file; the verification (which drafts are accepted) is the
scheduler's (``Scheduler.on_verified``), from the tokens the worker sampled at each position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MIN_N = 2  # a 1-token match proposes too often and is accepted too rarely
MAX_N = 4
# Tokens per decode step's worth of time a request's verifications must average (a decode
# gains 1): a little over 1, so that a verification must pay for itself.
MIN_GAIN = 1.1
GAIN_WEIGHT = 0.3  # of the latest verification in the moving average
FIRST_PAUSE = 8  # steps
MAX_PAUSE = 256  # steps: the probe rate of a request whose drafts never land


Slice = Callable[[int, int], list[int]]  # tokens [start, stop) of a request


class NgramIndex:
    """n-gram (MIN_N..MAX_N tokens) -> the position after its latest occurrence, over a
    request's known tokens except the last (a suffix never matches itself)."""

    def __init__(self) -> None:
        self._tables: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(MAX_N, MIN_N - 1, -1)
        }
        self._indexed = 0  # n-grams ending before this position are in the tables

    def propose(self, tokens: Slice, length: int, k: int) -> list[int]:
        """At most ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of the first ``length`` tokens (``tokens(start, stop)`` reads them); [] if none
        occurred."""
        self._update(tokens, length)
        for n, table in self._tables.items():
            if length <= n:
                continue
            at = table.get(tuple(tokens(length - n, length)))
            if at is not None:
                return tokens(at, min(at + k, length))
        return []

    def _update(self, tokens: Slice, length: int) -> None:
        end = length - 1  # the last token's n-grams wait: they are the suffix looked up
        first = self._indexed
        if end <= first:
            return
        lo = max(0, first - MAX_N + 1)
        window = tokens(lo, end)  # (end - lo,) the new tokens and the MAX_N - 1 before them
        for stop in range(first + 1, end + 1):  # an n-gram ending at stop - 1
            for n, table in self._tables.items():
                if stop >= n:
                    table[tuple(window[stop - n - lo : stop - lo])] = stop
        self._indexed = end


@dataclass
class DraftState:
    """One request's drafter and how its drafts have fared."""

    index: NgramIndex = field(default_factory=NgramIndex)
    gain: float = 2.0  # moving average of tokens per step its verifications gained
    skipped: int = 0  # steps planned without it while its verification is in flight
    pause: int = 0  # steps left before it drafts again
    next_pause: int = FIRST_PAUSE

    @property
    def paused(self) -> bool:
        """Whether it decodes plainly (with overlap) for now."""
        return self.pause > 0

    def tick(self) -> None:
        """One step planned while paused."""
        self.pause -= 1

    def verified(self, tokens: int, cost: float = 1.0) -> None:
        """A verification gained ``tokens`` (its accepted drafts and its own token) for the
        step it ran in, which cost ``cost`` decode steps (``Speculation.verification_cost``),
        and the steps planned without the request meanwhile."""
        steps, self.skipped = cost + self.skipped, 0
        self.gain += GAIN_WEIGHT * (tokens / steps - self.gain)
        if self.gain >= MIN_GAIN:
            self.next_pause = FIRST_PAUSE
            return
        self.pause, self.gain = self.next_pause, MIN_GAIN  # a probe after the pause starts even
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
