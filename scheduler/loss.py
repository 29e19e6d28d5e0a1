"""WorkerLoss: what the scheduler does when its worker's rows are gone: every running request
recomputed, or, over a pool that outlived the worker (docs/kv_pool.md), kept and rolled back to
what acknowledged steps computed; a block that fails its checksum recomputes its holders. A
mixin of ``scheduler.scheduler.Scheduler``."""

from __future__ import annotations

from scheduler.batch import ScheduledChunk


class WorkerLoss:
    """Scheduler's methods for a lost worker."""

    def preempt_all(self) -> None:
        """The worker's rows are gone (it died, or refused a step): running requests wait again
        with their tokens, oldest at the head; the prefix cache empties (its K/V came from lost
        steps or a gone worker); every slot is released with the next step (a step in flight
        behind a refused one may be accepted, so no row can be assumed empty)."""
        while self.running:
            self._preempt(self.running[-1])
        self.cache.clear()
        self.slots.release_all()

    def keep_for_reattach(self, in_flight: list[ScheduledChunk], written: set[int]) -> int:
        """The worker died; its pool did not (docs/kv_pool.md). ``in_flight``: the chunks of the
        steps it never answered; ``written``: every block they would write. Requests admitted
        by those steps are preempted (their admission was never acknowledged); the others roll
        back to the tokens acknowledged steps computed, keeping their slot and blocks. No hash
        of a block the lost steps wrote stays in the index (its K/V may be half written).
        Returns the tokens the lost steps computed that the running requests compute again."""
        unacked: dict[str, int] = {}
        admitted = set()
        for chunk in in_flight:
            if not self.is_current(chunk):
                continue  # its request ended or was preempted since: nothing to roll back
            rid = chunk.request.request_id
            unacked[rid] = unacked.get(rid, 0) + chunk.num_tokens
            if chunk.fresh:
                admitted.add(rid)
        again, size = 0, self.allocator.block_size
        for request in reversed(self.running):  # newest first: the oldest ends at the head
            if request.request_id in admitted:
                again += unacked[request.request_id]  # its hits are looked up again
                self._preempt(request)
        self.cache.forget(written)
        for request in self.running:
            n = unacked.get(request.request_id, 0)
            again += n
            extra = request.rollback(n, size)
            self.allocator.free_all(extra[::-1])
        return again

    def drop_corrupt(self, block: int) -> list[str]:
        """A block's K/V is not what was written: it leaves the index and every running request
        holding it is preempted, to be recomputed; so is every request newer than the oldest
        of them, since nothing may wait that is older than a running request (their cached
        blocks stay indexed: their readmission finds them). Returns the holders' ids."""
        holders = [r for r in self.running if block in r.block_ids]
        self.cache.forget([block])
        if holders:
            oldest = self.running.index(holders[0])
            while len(self.running) > oldest:  # newest first: the oldest ends at the head
                self._preempt(self.running[-1])
        return [r.request_id for r in holders]
