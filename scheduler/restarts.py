"""What a worker's death costs, and whether its successor may take over its K/V.

With ``--shared-kv-pool`` the worker's pool belongs to the pool holder (``holder/``), so it
outlives the worker. When the worker dies, the engine keeps the running requests' blocks,
rolled back to what the steps it answered computed (``Scheduler.keep_for_reattach``), and waits
for the next worker. That one may take them over (``can_reattach``) only if it mapped the same
pool (its id), right after the lost worker (generation + 1: no worker wrote it in between), with
the same block count; a tensor-parallel group only if every rank did so with its rank's pool
(``WorkerReady.pool_ranks``). Anything else falls back to recompute, counted by reason.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.messages import RequestOutput, WorkerReady
from scheduler.batch import Batch
from scheduler.request import Request
from scheduler.scheduler import Scheduler


def can_reattach(lost: WorkerReady, new: WorkerReady) -> str:
    """Why ``new`` may not take over the pool ``lost`` wrote ("" when it may)."""
    if new.pool_fallback:
        return new.pool_fallback  # the new worker's pool is private
    if not new.pool_id or new.pool_id != lost.pool_id:
        return "new_pool"  # the holder was restarted, or the pool replaced
    if new.pool_generation != lost.pool_generation + 1:
        return "generation"  # another worker attached in between
    if new.num_blocks != lost.num_blocks:
        return "blocks"
    return rank_mismatch(lost, new)[0]


def rank_mismatch(lost: WorkerReady, new: WorkerReady) -> tuple[str, str]:
    """Of a tensor-parallel group: (kind, which rank and why) when a rank of ``new`` did not
    attach the pool its predecessor in ``lost`` held, at the generation after it; ("", "")
    when every rank did."""
    if len(new.pool_ranks) != len(lost.pool_ranks):
        return "ranks", f"{len(lost.pool_ranks)} ranks' pools, now {len(new.pool_ranks)}"
    pairs = zip(lost.pool_ranks, new.pool_ranks, strict=True)
    for rank, ((lost_id, lost_generation), (pool_id, generation)) in enumerate(pairs):
        if pool_id != lost_id:
            return "new_pool", f"rank {rank} attached pool {pool_id}, not {lost_id}"
        if generation != lost_generation + 1:
            why = f"rank {rank} attached pool {pool_id} at generation {generation}"
            return "generation", f"{why}, not {lost_generation + 1}"
    return "", ""


def written_blocks(batch: Batch, scheduler: Scheduler) -> list[int]:
    """The blocks a step's chunks write K/V into (their tokens' positions), as planned."""
    size = scheduler.allocator.block_size
    blocks: list[int] = []
    for chunk in batch.chunks:
        first, end = chunk.start // size, -(-(chunk.start + chunk.num_tokens) // size)
        blocks += chunk.request.block_ids[first:end]
    return blocks


@dataclass
class RestartLog:
    """Worker restarts as /metrics counts them: re-attaches, fallbacks by reason, and the
    tokens of K/V computed again because of a restart."""

    kept: bool = False  # True while a lost worker's requests keep their blocks
    kept_tokens: int = 0  # tokens the kept requests compute again if the re-attach happens
    reattaches: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    tokens_recomputed: int = 0
    tokens_recomputed_last: int = 0  # the latest restart's
    last_reason: str = ""  # the latest fallback's

    def kept_for(self, tokens: int) -> None:
        """A worker died; its requests keep their blocks, ``tokens`` of theirs lost."""
        self.kept, self.kept_tokens = True, tokens

    def reattached(self) -> None:
        """The next worker took the pool over: only the kept tokens are computed again."""
        self.reattaches += 1
        self._recomputed(self.kept_tokens)

    def fell_back(self, why: str, computed: int) -> None:
        """Rows lost without a re-attach (``why``: its kind, "" where no shared pool was
        asked for): the running requests' ``computed`` tokens are computed again."""
        if why:
            self.fallbacks[why] += 1
            self.last_reason = why
        self._recomputed(self.kept_tokens + computed)

    def _recomputed(self, tokens: int) -> None:
        self.tokens_recomputed += tokens
        self.tokens_recomputed_last = tokens
        self.kept, self.kept_tokens = False, 0


@dataclass
class Stalls:
    """Seconds from a worker's death to the next token of each request running then."""

    waiting: dict[str, float] = field(default_factory=dict)  # request id -> time of the death
    total_s: float = 0.0
    count: int = 0
    last_max_s: float = 0.0

    def lost(self, running: Iterable[Request]) -> None:
        """A worker died now with these requests running (a later death restarts the clock)."""
        now = time.monotonic()
        self.waiting = {request.request_id: now for request in running}
        self.last_max_s = 0.0

    def tokens(self, outputs: list[RequestOutput]) -> None:
        """Outputs of an applied step: each stalled request's first token ends its stall."""
        now = time.monotonic()
        for output in outputs:
            since = self.waiting.pop(output.request_id, None)
            if since is not None and output.new_token_ids:
                self.total_s += now - since
                self.count += 1
                self.last_max_s = max(self.last_max_s, now - since)
