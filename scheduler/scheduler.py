"""Scheduler: who waits, who runs, and what each running request computes this iteration.

One iteration (``schedule()``) runs in labelled phases, top to bottom:

1. grow: every running request, oldest first, gets the blocks its next tokens need (a decode
   token, or the next chunk of a chunked prefill). When the pool has no block left, the newest
   running request is preempted by recompute: it gives back its blocks and slot, keeps its
   tokens, and goes back to the head of the waiting queue. The oldest is never preempted.
2. admit: requests are admitted from the head of the waiting queue while a slot, the blocks
   for all their known tokens (plus the watermark reserve) and the token budget allow. A prompt
   longer than the budget left is prefilled in chunks over several iterations. A request starts
   after the longest run of its full blocks that the prefix cache holds (``PrefixCache``); only
   what those hits do not cover counts against the pool, the watermark and the budget.
3. offer: the full blocks this step fills join the prefix cache's index (after admission, so no
   hit reads K/V the step itself computes).

Running requests arrived before every waiting one, so the queue stays in arrival order even
though preemption pushes to its head (the auditor checks both claims every iteration).

Overlap: scheduling a chunk advances the request at once (``num_computed``, a pending token when
it samples), so ``schedule()`` may run again before the result is back. A request whose pending
tokens reach ``max_tokens`` or ``max_model_len`` is not grown (its finish is certain); one that
stops on EOS or a stop token runs one surplus step, whose token is dropped.

Speculative decoding (``Speculation``): a decoding request may carry draft tokens after its last
token (known, or pending from a plain decode in flight), in the same step as everyone else's work
and within the token budget, with blocks for them reserved as for any growth. Where its next
step starts depends on how many drafts are accepted, so while a verification is in flight the
request is left out of the steps planned (it gives up the overlap for that step).
``on_verified`` applies the result: accepted drafts and the token sampled after them join its
tokens, the rejected ones' blocks go back at once, and its cache row is cut back with the next
step (``Rewind``).
"""

from __future__ import annotations

from collections import deque

from protocol.messages import Rewind
from scheduler.arrivals import Arrivals
from scheduler.batch import Batch, ScheduledChunk
from scheduler.block_allocator import BlockAllocator
from scheduler.loss import WorkerLoss
from scheduler.prefix_cache import PrefixCache
from scheduler.request import Request, RequestStatus
from scheduler.results import Results
from scheduler.slots import Slots
from scheduler.speculation import Speculation


class Scheduler(Arrivals, Results, WorkerLoss):
    """The block and slot ledgers (``BlockAllocator``, ``Slots``) plus the waiting and running
    queues. Requests come and go through ``Arrivals``, results are folded in by ``Results``,
    and a lost worker is handled by ``WorkerLoss``; one iteration is planned here."""

    def __init__(
        self,
        allocator: BlockAllocator,
        num_slots: int,
        token_budget: int,
        watermark_blocks: int | None = None,
        max_model_len: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        prefix_caching: bool = True,
        speculative_tokens: int = 0,
        speculative_max_running: int = 8,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"need token_budget >= 1, got {token_budget}")
        if watermark_blocks is None:
            watermark_blocks = int(0.01 * allocator.num_blocks)
        if not 0 <= watermark_blocks <= allocator.num_blocks:
            raise ValueError(
                f"watermark_blocks {watermark_blocks} outside 0..{allocator.num_blocks}"
            )
        self.allocator = allocator
        self.slots = Slots(num_slots)
        self.num_slots = num_slots
        self.token_budget = token_budget
        self.watermark_blocks = watermark_blocks
        self.max_model_len = max_model_len or allocator.num_blocks * allocator.block_size + 1
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache = PrefixCache(allocator, prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._next_arrival = 0
        self.num_preemptions_total = 0
        self.thrashed_admissions = 0
        self.tokens_scheduled = 0
        self.tokens_recomputed = 0
        self.speculation = Speculation(speculative_tokens, speculative_max_running)
        self._rewinds: dict[int, Rewind] = {}  # by slot: rows to cut back with the next step

    # -- the ledgers, as the auditor reads them -----------------------------------------------
    @property
    def known_ids(self) -> frozenset[str]:
        """Ids of every request waiting or running."""
        return frozenset(self._requests)

    @property
    def admissible_blocks(self) -> int:
        """The most blocks a request can be admitted holding while the reserve is kept."""
        return self.allocator.num_blocks - self.watermark_blocks

    @property
    def pending_rewinds(self) -> tuple[Rewind, ...]:
        """Rows to cut back with the next step (after rejected drafts), by slot order."""
        return tuple(self._rewinds[slot] for slot in sorted(self._rewinds))

    def get(self, request_id: str) -> Request | None:
        """The waiting or running request with this id, if any."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._requests)

    # -- one iteration ----------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Decide this iteration's work (see the module docstring for the phases)."""
        chunks: list[ScheduledChunk] = []
        # Phase 1: grow the running requests, preempting the newest when blocks run out.
        waiting_on_drafts: list[Request] = []
        budget = self._grow(chunks, self.token_budget, waiting_on_drafts)
        # Phase 2: admit from the head of the waiting queue.
        self._admit(chunks, budget)
        # Phase 3: offer the index the blocks this step fills, after admission (PrefixCache).
        self.cache.offer_all([chunk.request for chunk in chunks])
        if chunks and waiting_on_drafts:  # what drafting cost them (Speculation)
            self.speculation.left_out(waiting_on_drafts)
        rewinds, self._rewinds = self.pending_rewinds, {}
        return Batch(chunks, self.slots.take_releases(), list(rewinds))

    def _grow(
        self, chunks: list[ScheduledChunk], budget: int, waiting_on_drafts: list[Request]
    ) -> int:
        size, max_len, running = (
            self.allocator.block_size,
            self.max_model_len,
            RequestStatus.RUNNING,
        )
        speculation = self.speculation
        drafting = len(self.running) <= speculation.max_running  # else nobody drafts
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted a moment ago to make room for an older request
            if request.num_draft:
                waiting_on_drafts.append(request)  # where it goes on depends on its drafts
                continue
            if request.finish_is_certain(max_len):
                continue  # its in-flight sample ends it by length: no surplus step
            n = min(request.num_tokens - request.num_computed, budget)
            drafts: list[int] = []
            if n == 1 and drafting and speculation.may_draft(request):
                drafts = speculation.drafts(request, budget - n, max_len)
                drafts = self._fit_drafts(request, drafts)
                if not drafts:
                    speculation.paused_step(request)
            # ceil((computed + n + drafts) / size) blocks: most decode steps need no new one.
            need = request.num_computed + n + len(drafts)
            missing = -(-need // size) - len(request.block_ids)
            if missing > 0 and not self._reserve_blocks(request, missing):
                continue
            chunks.append(self._chunk(request, n, drafts))
            budget -= n + len(drafts)
        return budget

    def _fit_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """``drafts`` cut to the blocks the request may take for them: drafts never preempt
        anyone and, like an admission, leave the watermark's reserve free; what its next token
        needs anyway is not theirs to count."""
        if not drafts:
            return drafts
        size, held = self.allocator.block_size, len(request.block_ids)
        computed = request.num_computed + 1  # its last known token, computed in any case
        needed = max(0, -(-computed // size) - held)  # blocks that token needs anyway
        spare = self.allocator.num_free - needed - self.watermark_blocks
        most = (held + needed + max(0, spare)) * size - computed  # draft positions that fit
        return drafts[: max(0, most)]

    def _reserve_blocks(self, request: Request, missing: int) -> bool:
        """Give ``request`` ``missing`` more blocks; False if it was preempted instead."""
        while missing > self.allocator.num_free:
            victim = self.running[-1]  # the newest gives way; the oldest never does
            if victim is self.running[0]:
                raise RuntimeError(f"request {victim.request_id} cannot grow in an empty pool")
            self._preempt(victim)
            if victim is request:
                return False
        request.grow(self._allocate(request, request.block_ids, missing))
        return True

    def _allocate(self, request: Request, ids: list[int], n: int) -> list[int]:
        """``n`` new blocks for ``request``, which holds ``ids``: after the last of them, with
        room for all it may reach, at most an even share of the pool (BlockAllocator.allocate)."""
        share = max(1, self.allocator.num_blocks // self.num_slots)
        most = request.most_blocks(self.allocator.block_size, self.max_model_len)
        room = min(most, len(ids) + share) - len(ids)
        return self.allocator.allocate(n, after=ids[-1] if ids else None, room=room)

    def _preempt(self, victim: Request) -> None:
        """Preempt by recompute: blocks and slot back, tokens kept, head of the queue."""
        if len(victim.block_ids) <= victim.admission_blocks:
            self.thrashed_admissions += 1  # evicted before outgrowing what admission bought
        self.running.remove(victim)
        self._give_back(victim)
        victim.requeue()
        self.num_preemptions_total += 1
        self.waiting.appendleft(victim)

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        while self.waiting and self.slots.any_free() and budget > 0:
            request = self.waiting[0]
            hits = self.cache.lookup(request)
            need = self.allocator.blocks_for_length(request.num_tokens)
            # The watermark may delay a request, never exclude one: a request that could never
            # fit beside the reserve is admitted without it, so an empty pool always takes it.
            reserve = self.watermark_blocks if need <= self.admissible_blocks else 0
            if self.cache.free_blocks_taken(need, hits) + reserve > self.allocator.num_free:
                return
            self.waiting.popleft()
            self._start(request, hits, need)
            n = min(request.num_tokens - request.num_computed, budget)
            chunks.append(self._chunk(request, n))
            budget -= n

    def _start(self, request: Request, hits: list[int], need: int) -> None:
        """Admit the waiting head: a slot, its hits shared, the rest of its blocks new."""
        blocks = self.allocator.take(hits)
        blocks += self._allocate(request, blocks, need - len(hits))
        request.admit(self.slots.take(), blocks)
        self.cache.admitted(request, len(hits))
        self.running.append(request)

    def _chunk(self, request: Request, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        """Schedule ``n`` tokens of ``request``, and its ``drafts`` after them, computed from
        here on (see Overlap)."""
        start, high_water = request.num_computed, request.high_water
        fresh, attached = request.blocks_sent == 0, request.reattached
        self.tokens_scheduled += n
        if start < high_water:  # K/V it had before a preemption, bought again
            self.tokens_recomputed += min(start + n, high_water) - start
        if drafts:
            new_blocks = request.advance_draft(drafts)
            epoch = request.epoch
            return ScheduledChunk(request, start, n, True, new_blocks, epoch, drafts=tuple(drafts))
        new_blocks, sample = request.advance(n)
        return ScheduledChunk(
            request, start, n, sample, new_blocks, request.epoch, fresh, attached=attached
        )

    # -- helpers ----------------------------------------------------------------------------------
    def _give_back(self, request: Request) -> None:
        # Deepest first: a chain's tail is then evicted before its (more shared) head.
        self.allocator.free_all(request.block_ids[::-1])
        if request.slot is not None:
            self.slots.give_back(request.slot)
            self._rewinds.pop(request.slot, None)  # the row is emptied instead
        request.release()

    def _forget(self, request: Request, reason: str) -> None:
        request.finish(reason)
        del self._requests[request.request_id]
