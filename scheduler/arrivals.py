"""Arrivals: the scheduler's requests coming and going (added, aborted, finished) and its pool
replaced under them; a mixin of ``scheduler.scheduler.Scheduler``, which owns the ledgers."""

from __future__ import annotations

from protocol.messages import SamplingParams
from scheduler.block_allocator import BlockAllocator
from scheduler.errors import RequestRejected
from scheduler.prefix_cache import PrefixCache
from scheduler.request import Request, RequestStatus


class Arrivals:
    """Scheduler's methods for requests arriving and leaving."""

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
        request = Request(
            request_id, list(prompt_token_ids), params, self._next_arrival, cache_salt=cache_salt
        )
        # Passing this door is a promise to run the request: alone in an empty pool it fits.
        need = request.most_blocks(self.allocator.block_size, self.max_model_len)
        if need > self.allocator.num_blocks:
            raise RequestRejected(
                f"request {request_id!r} may need {need} blocks, the whole pool has "
                f"{self.allocator.num_blocks}"
            )
        self._next_arrival += 1
        self._requests[request_id] = request
        self.waiting.append(request)
        return request

    def replace_pool(self, allocator: BlockAllocator, watermark_blocks: int) -> None:
        """Move to another pool (a new worker brought one of another size) while nothing runs;
        every waiting request must fit it (abort those that do not first)."""
        if self.running or any(
            r.most_blocks(allocator.block_size, self.max_model_len) > allocator.num_blocks
            for r in self.waiting
        ):
            raise RuntimeError("a pool is replaced only while nothing runs, and all waiting fit")
        self.allocator, self.watermark_blocks = allocator, watermark_blocks
        events = self.cache.events
        self.cache = PrefixCache(allocator, self.cache.enabled)
        self.cache.record(events)

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
        self._forget(request, "abort")
        return request

    def finish(self, request: Request, reason: str) -> None:
        """A running request is done: free its blocks and slot."""
        self.running.remove(request)
        self._give_back(request)
        self._forget(request, reason)
