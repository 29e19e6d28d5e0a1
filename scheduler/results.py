"""Results: a step's samples folded into the scheduler's requests (plain, or verifying draft
tokens); a mixin of ``scheduler.scheduler.Scheduler``."""

from __future__ import annotations

from protocol.messages import Rewind
from scheduler.batch import ScheduledChunk
from scheduler.request import Request


class Results:
    """Scheduler's methods that apply a step's samples."""

    def is_current(self, chunk: ScheduledChunk) -> bool:
        """Whether ``chunk``'s request runs as when it was scheduled (its sample counts)."""
        request = chunk.request
        return self._requests.get(request.request_id) is request and request.epoch == chunk.epoch

    def on_sampled(self, request: Request, token_id: int) -> str | None:
        """The oldest pending token of a running request is ``token_id``: why it ends, or None."""
        request.sampled(token_id)
        self.cache.offer(request)
        return request.stop_reason(token_id, self.eos_token_ids, self.max_model_len)

    def on_verified(
        self, request: Request, drafts: tuple[int, ...], sampled: list[int]
    ) -> tuple[list[int], str | None]:
        """A step verified ``request``'s ``drafts`` with the tokens ``sampled`` at each
        position: the tokens it gains (the accepted drafts, then the token sampled after them),
        and why it ends, or None. The rejected drafts' blocks go back now, and its cache row is
        cut back with the next step."""
        accepted = self.speculation.verify(request, drafts, sampled)
        request.verified(accepted)
        gained, reason = [], None
        for token in (*drafts[:accepted], sampled[accepted]):
            reason = self.on_sampled(request, token)
            gained.append(token)
            if reason is not None:
                return gained, reason  # the request ends here: finish() frees the rest
        if accepted < len(drafts):
            keep = self.allocator.blocks_for_length(request.num_computed)
            self.allocator.free_all(request.cut_blocks(keep)[::-1])
            slot, computed = request.slot, request.num_computed
            self._rewinds[slot] = Rewind(slot=slot, num_blocks=keep, num_cached=computed)
        return gained, None
