"""Scheduler: who waits, who runs, and what each running request computes this iteration.

One iteration (``schedule()``) runs in labelled phases, top to bottom:

1. grow: every running request, oldest first, gets the blocks its next tokens need (a decode
   token, or the next chunk of a chunked prefill). When the pool has no block left, the newest
   running request is preempted by recompute: it gives back its blocks and slot, keeps its
   tokens, and goes back to the head of the waiting queue. The oldest is never preempted.
2. admit: requests are admitted from the head of the waiting queue while a slot, the blocks
   for all their known tokens (plus the watermark reserve) and the token budget allow. A prompt
   longer than the budget left is prefilled in chunks over several iterations.

Prefix caching: a request is admitted with the longest run of its full blocks that the index
holds (a hit takes a reference on each), and starts computing after them; at least one token
is always computed, for the logits. Only the blocks a hit does not cover (plus the cached-free
ones it takes out of the free pool) count against the pool and the watermark, and only the
tokens after them against the budget. A full block is offered to the index once its K/V is
planned by an earlier step (the worker runs steps in order, so a later one reads it) and all
its tokens are known (with overlap, a block's last token may still be pending). When the
worker's rows are lost, the index goes with them: no request may hit K/V that the next worker
never computed.

Running requests arrived before every waiting one, so the queue stays in arrival order even
though preemption pushes to its head (the auditor checks both claims every iteration).

Overlap: scheduling a chunk advances the request at once (``num_computed``, and a pending token
when it samples), so the next ``schedule()`` may run before the step's result is back. A request
whose pending tokens already reach ``max_tokens`` or ``max_model_len`` is not grown: its finish
is certain. One that stops on EOS or a stop token is known only when its sample arrives; it has
meanwhile run one surplus step, whose token is dropped (``on_sampled`` is never called for it).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from protocol.messages import SamplingParams
from scheduler.block_allocator import BlockAllocator
from scheduler.errors import RequestRejected
from scheduler.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """One request's work in one iteration: ``num_tokens`` tokens from position ``start``."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    new_blocks: list[int]  # appended to the worker's row (the whole table when fresh)
    epoch: int = 0  # the request's epoch when scheduled: a preemption since makes it stale
    fresh: bool = False  # begins the request's row; positions below start are cache hits


@dataclass
class Batch:
    """What ``schedule()`` decided: the chunks to compute and the slots to empty first."""

    chunks: list[ScheduledChunk]
    released_slots: list[int]


class Scheduler:
    """The block and slot ledgers plus the waiting and running queues."""

    def __init__(
        self,
        allocator: BlockAllocator,
        num_slots: int,
        token_budget: int,
        watermark_blocks: int | None = None,
        max_model_len: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        prefix_caching: bool = True,
    ) -> None:
        if num_slots < 1 or token_budget < 1:
            raise ValueError(
                f"need num_slots >= 1 and token_budget >= 1, got {num_slots}, {token_budget}"
            )
        if watermark_blocks is None:
            watermark_blocks = int(0.01 * allocator.num_blocks)
        if not 0 <= watermark_blocks <= allocator.num_blocks:
            raise ValueError(
                f"watermark_blocks {watermark_blocks} outside 0..{allocator.num_blocks}"
            )
        self.allocator = allocator
        self.num_slots = num_slots
        self.token_budget = token_budget
        self.watermark_blocks = watermark_blocks
        self.max_model_len = max_model_len or allocator.num_blocks * allocator.block_size + 1
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._free_slots: list[int] = list(range(num_slots))  # a heap: lowest slot first
        self._pending_releases: list[int] = []  # freed slots the worker has not been told of
        self._next_arrival = 0
        self.num_preemptions_total = 0
        self.thrashed_admissions = 0
        self.tokens_scheduled = 0
        self.tokens_recomputed = 0
        self.prefix_queries = 0  # tokens of admitted requests, every admission counted
        self.prefix_hits = 0  # of those, tokens found in the prefix cache

    # -- the ledgers, as the auditor reads them -----------------------------------------------
    @property
    def free_slots(self) -> list[int]:
        """The free slot ids, sorted (duplicates kept, so the auditor can see them)."""
        return sorted(self._free_slots)

    @property
    def known_ids(self) -> frozenset[str]:
        """Ids of every request waiting or running."""
        return frozenset(self._requests)

    @property
    def pending_releases(self) -> tuple[int, ...]:
        """Slots freed since the last schedule(); the worker empties them with the next step."""
        return tuple(self._pending_releases)

    @property
    def admissible_blocks(self) -> int:
        """The most blocks a request can be admitted holding while the reserve is kept."""
        return self.allocator.num_blocks - self.watermark_blocks

    def get(self, request_id: str) -> Request | None:
        """The waiting or running request with this id, if any."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._requests)

    # -- arrivals and departures ----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request, or raise RequestRejected if it could never run to its end."""
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0 or params.max_tokens < 1:
            raise RequestRejected(f"request {request_id!r} needs a prompt and max_tokens >= 1")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"request {request_id!r}: prompt of {n} tokens leaves no room in "
                f"max_model_len {self.max_model_len}"
            )
        # Passing this door is a promise to run the request: alone in an empty pool it fits.
        final_len = min(n + params.max_tokens, self.max_model_len)
        need = self.allocator.blocks_for_length(final_len - 1)  # the last token is never cached
        if need > self.allocator.num_blocks:
            raise RequestRejected(
                f"request {request_id!r} may need {need} blocks, the whole pool has "
                f"{self.allocator.num_blocks}"
            )
        request = Request(
            request_id, list(prompt_token_ids), params, self._next_arrival, cache_salt=cache_salt
        )
        self._next_arrival += 1
        self._requests[request_id] = request
        self.waiting.append(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        """Drop a waiting, running or preempted request; everything it held returns."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self._give_back(request)
        self._forget(request, RequestStatus.ABORTED, "abort")
        return request

    def finish(self, request: Request, reason: str) -> None:
        """A running request is done: free its blocks and slot."""
        self.running.remove(request)
        self._give_back(request)
        self._forget(request, RequestStatus.FINISHED, reason)

    # -- one iteration ----------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Decide this iteration's work (see the module docstring for the phases)."""
        chunks: list[ScheduledChunk] = []
        # Phase 1: grow the running requests, preempting the newest when blocks run out.
        budget = self._grow(chunks, self.token_budget)
        # Phase 2: admit from the head of the waiting queue.
        self._admit(chunks, budget)
        # Phase 3: offer the index the blocks this step fills. Not before admission: a hit must
        # never read K/V that the same step computes (a compiled step writes after its graph).
        for chunk in chunks:
            self._cache_full_blocks(chunk.request)
        released, self._pending_releases = self._pending_releases, []
        return Batch(chunks, released)

    def _grow(self, chunks: list[ScheduledChunk], budget: int) -> int:
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older request
            if self._finish_is_certain(request):
                continue  # its in-flight sample ends it by length: no surplus step
            n = min(request.num_tokens - request.num_computed, budget)
            if self._reserve_blocks(request, request.num_computed + n):
                chunks.append(self._chunk(request, n))
                budget -= n
        return budget

    def _reserve_blocks(self, request: Request, length: int) -> bool:
        """Give ``request`` blocks for ``length`` tokens; False if it was preempted instead."""
        missing = self.allocator.blocks_for_length(length) - len(request.block_ids)
        while missing > self.allocator.num_free:
            victim = self.running[-1]  # the newest gives way; the oldest never does
            if victim is self.running[0]:
                raise RuntimeError(f"request {victim.request_id} cannot grow in an empty pool")
            self._preempt(victim)
            if victim is request:
                return False
        if missing > 0:
            request.block_ids += self.allocator.allocate(missing)
        return True

    def _preempt(self, victim: Request) -> None:
        """Preempt by recompute: blocks and slot back, tokens kept, head of the queue."""
        if len(victim.block_ids) <= victim.admission_blocks:
            self.thrashed_admissions += 1  # evicted before outgrowing what admission bought
        self.running.remove(victim)
        self._give_back(victim)
        victim.status = RequestStatus.WAITING
        victim.num_pending = 0  # sampled in a step still in flight: recomputed, not awaited
        victim.epoch += 1
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(victim)

    def preempt_all(self) -> None:
        """The worker's rows are gone (it died, or refused a step): every running request goes
        back to waiting with its tokens, oldest at the head, and the prefix cache is emptied
        (the K/V it named was computed by steps that are lost, or by a worker that is gone).
        Every slot is released with the next step: a refused step may be followed by one
        already in flight that the worker accepts, so no row can be assumed empty."""
        while self.running:
            self._preempt(self.running[-1])
        self.allocator.clear_cache()
        self._pending_releases = list(range(self.num_slots))

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        while self.waiting and self._free_slots and budget > 0:
            request = self.waiting[0]
            hits = self._cache_hits(request)
            need = self.allocator.blocks_for_length(request.num_tokens)
            # The watermark may delay a request, never exclude one: a request that could never
            # fit beside the reserve is admitted without it, so an empty pool always takes it.
            reserve = self.watermark_blocks if need <= self.admissible_blocks else 0
            if self._free_blocks_taken(need, hits) + reserve > self.allocator.num_free:
                return
            self.waiting.popleft()
            self._start(request, hits, need)
            n = min(request.num_tokens - request.num_computed, budget)
            chunks.append(self._chunk(request, n))
            budget -= n

    def _cache_hits(self, request: Request) -> list[int]:
        """The cached blocks of ``request``'s longest cached prefix, leaving at least one token
        to compute."""
        if not self.prefix_caching:
            return []
        usable = (request.num_tokens - 1) // self.allocator.block_size
        hashes = request.hash_blocks(usable, self.allocator.block_size)
        return self.allocator.lookup(hashes[:usable])

    def _free_blocks_taken(self, need: int, hits: list[int]) -> int:
        """Free blocks an admission of ``need`` blocks with these hits consumes: the new ones,
        and the hits that are cached-free."""
        return need - len(hits) + sum(1 for block in hits if self.allocator.ref_count(block) == 0)

    def _start(self, request: Request, hits: list[int], need: int) -> None:
        """Admit the waiting head: a slot, its hits shared, the rest of its blocks new."""
        request.status = RequestStatus.RUNNING
        request.slot = heapq.heappop(self._free_slots)
        request.block_ids = self.allocator.take(hits) + self.allocator.allocate(need - len(hits))
        request.admission_blocks = need
        request.num_blocks_cached = len(hits)
        request.num_computed = len(hits) * self.allocator.block_size
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed
        self.prefix_queries += request.num_tokens
        self.prefix_hits += request.num_computed
        self.running.append(request)

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        """Schedule ``n`` tokens of ``request`` and account for them as computed (see Overlap)."""
        start = request.num_computed
        fresh = request.blocks_sent == 0
        new_blocks = request.block_ids[request.blocks_sent :]
        request.blocks_sent = len(request.block_ids)
        self.tokens_scheduled += n
        self.tokens_recomputed += max(0, min(start + n, request.high_water) - start)
        sample = start + n == request.num_tokens
        request.num_computed = start + n
        request.high_water = max(request.high_water, request.num_computed)
        if sample:
            request.num_pending += 1
        return ScheduledChunk(request, start, n, sample, new_blocks, request.epoch, fresh)

    def _cache_full_blocks(self, request: Request) -> None:
        """Offer the index every full block whose K/V is planned and whose tokens are known."""
        if not self.prefix_caching:
            return
        size = self.allocator.block_size
        full = min(request.num_computed, request.num_known_tokens) // size
        if full <= request.num_blocks_cached:
            return
        hashes = request.hash_blocks(full, size)
        for index in range(request.num_blocks_cached, full):
            self.allocator.cache(request.block_ids[index], hashes[index])
        request.num_blocks_cached = full

    def _finish_is_certain(self, request: Request) -> bool:
        """True when a pending token will end ``request`` by length whatever it is."""
        return request.num_pending > 0 and (
            request.num_generated >= request.params.max_tokens
            or request.num_tokens >= self.max_model_len
        )

    # -- results ----------------------------------------------------------------------------------
    def is_current(self, chunk: ScheduledChunk) -> bool:
        """True if ``chunk``'s request still runs as it was when the chunk was scheduled (not
        finished, aborted or preempted since): only then does its sample count."""
        request = chunk.request
        return self._requests.get(request.request_id) is request and request.epoch == chunk.epoch

    def on_sampled(self, request: Request, token_id: int) -> str | None:
        """Turn the oldest pending token of a running request into ``token_id``; return a
        finish reason, or None."""
        if request.num_pending < 1:
            raise RuntimeError(f"request {request.request_id} has no pending token")
        request.num_pending -= 1
        request.output_token_ids.append(token_id)
        self._cache_full_blocks(request)
        return self._stop_reason(request, token_id)

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        params = request.params
        generated = len(request.output_token_ids)
        if generated >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return "stop"
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return "stop"
        if generated >= params.max_tokens or request.num_known_tokens >= self.max_model_len:
            return "length"
        return None

    # -- helpers ----------------------------------------------------------------------------------
    def _give_back(self, request: Request) -> None:
        # Deepest first: a chain's tail is then evicted before its (more shared) head.
        self.allocator.free_all(request.block_ids[::-1])
        request.block_ids = []
        request.blocks_sent = 0
        request.num_computed = 0
        request.num_blocks_cached = 0
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
            self._pending_releases.append(request.slot)
            request.slot = None

    def _forget(self, request: Request, status: RequestStatus, reason: str) -> None:
        request.status = status
        request.finish_reason = reason
        del self._requests[request.request_id]
