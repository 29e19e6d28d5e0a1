"""Request: the scheduler's record of one request, from arrival to its finish.

The scheduler owns these records; the worker only ever sees StepItems built from them. A request
changes only through its transitions (``admit``, ``take_cached``, ``grow``, ``advance``,
``advance_draft``, ``verified``, ``cut_blocks``, ``sampled``, ``offered``, ``rollback``,
``release``, ``requeue``, ``finish``), which the scheduler and the prefix cache call; they read
its fields but never write them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from protocol.blocks import blocks_for
from protocol.messages import PENDING_TOKEN, SamplingParams
from scheduler.block_hash import block_hash, root_hash
from scheduler.drafter import DraftState


class RequestStatus(enum.Enum):
    """Where a request is. A preempted request is WAITING again (with tokens kept)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Request:
    """One request's tokens and holdings.

    ``num_computed`` is how many of its tokens have K/V in its cache row once every step sent so
    far has run: it advances when a chunk is scheduled, not when its result comes back. Between
    iterations a decoding request holds one token more than it has computed: the last sampled
    token, which the next step feeds back in.

    ``num_pending`` counts tokens sampled by steps still in flight: they are part of
    ``num_tokens`` but not yet of ``output_token_ids`` (the worker knows them, the scheduler
    does not yet). ``epoch`` changes at every preemption, so a result of a step planned before
    the preemption is recognised as stale and dropped.

    Speculative decoding: ``num_draft`` counts draft tokens in flight, computed after its last
    known token by a step whose result is not back (``advance_draft``). Their K/V counts in
    ``num_computed`` until ``verified`` takes back the rejected ones, so while they fly it may
    reach ``num_tokens - 1 + num_draft``. ``drafting`` is its drafter (None: it never drafts).

    Prefix caching: ``block_hashes`` is the hash chain of its full blocks of known tokens, grown
    as tokens become known; ``num_blocks_cached`` counts its leading blocks already offered to
    the index (or taken from it as hits); ``num_cached_tokens`` is how many prompt tokens its
    first admission found cached (None until then).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # arrival sequence number: the queue order the auditor checks
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks_sent: int = 0  # how many of block_ids the worker's row has been told about
    num_preemptions: int = 0
    admission_blocks: int = 0  # blocks bought by the latest admission (thrash window)
    high_water: int = 0  # most tokens ever computed: recomputation below this is a re-buy
    num_pending: int = 0
    epoch: int = 0
    finish_reason: str | None = None
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_blocks_cached: int = 0
    num_cached_tokens: int | None = None
    num_draft: int = 0
    drafting: DraftState | None = None
    reattached: bool = False  # its next row is begun on K/V a lost worker wrote (``rollback``)
    arrival_time: float = field(default_factory=time.monotonic)  # for its age on the web page

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the original prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus everything generated so far, the pending tokens included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus the generated tokens the scheduler has seen."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Generated tokens, the pending ones included."""
        return len(self.output_token_ids) + self.num_pending

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens at positions ``[start, stop)`` of prompt + output; a pending token reads
        ``PENDING_TOKEN``."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if stop <= n:
            return prompt[start:stop]
        output = self.output_token_ids
        if start >= n + len(output):  # a decode item with overlap: only pending tokens
            return [PENDING_TOKEN] * (stop - start)
        # Sliced apart, never concatenated whole: a decode step must not cost O(context).
        known = prompt[start:n] + output[max(0, start - n) : stop - n]
        return known + [PENDING_TOKEN] * (stop - start - len(known))

    def hash_blocks(self, num_blocks: int, block_size: int) -> list[bytes]:
        """``block_hashes``, grown to cover at least its first ``num_blocks`` blocks (each hash
        is computed once); every token of those blocks must be known."""
        hashes = self.block_hashes
        if len(hashes) < num_blocks:
            if num_blocks * block_size > self.num_known_tokens:
                raise ValueError(
                    f"request {self.request_id}: block {num_blocks - 1} has unknown tokens"
                )
            parent = hashes[-1] if hashes else root_hash(self.cache_salt)
            for index in range(len(hashes), num_blocks):
                begin = index * block_size
                parent = block_hash(parent, self.token_slice(begin, begin + block_size))
                hashes.append(parent)
        return hashes

    def finish_is_certain(self, max_model_len: int) -> bool:
        """True when a pending token will end the request by length whatever it is."""
        pending = self.num_pending
        if not pending:
            return False
        generated = len(self.output_token_ids) + pending  # fields, not properties: every step
        return (
            generated >= self.params.max_tokens
            or len(self.prompt_token_ids) + generated >= max_model_len
        )

    def stop_reason(
        self, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
    ) -> str | None:
        """Why the request ends with ``token_id``, its newest known token: "stop", "length",
        or None while it goes on."""
        params = self.params
        generated = len(self.output_token_ids)
        # A grammar lets EOS (or a stop id) through before min_tokens only once it is complete.
        if generated >= params.min_tokens or params.grammar is not None:
            if token_id in params.stop_token_ids:
                return "stop"
            if token_id in eos_token_ids and not params.ignore_eos:
                return "stop"
        if generated >= params.max_tokens or self.num_known_tokens >= max_model_len:
            return "length"
        return None

    def most_blocks(self, block_size: int, max_model_len: int) -> int:
        """The most blocks it can ever hold: its prompt and all it may generate, but the last
        token, whose K/V is never cached."""
        final = min(self.num_prompt_tokens + self.params.max_tokens, max_model_len)
        return blocks_for(final - 1, block_size)

    # -- transitions ------------------------------------------------------------------------
    def admit(self, slot: int, block_ids: list[int]) -> None:
        """Admitted from the waiting queue into ``slot``, holding ``block_ids`` (its prefix-cache
        hits first, ``take_cached``): running, with K/V for none of its tokens yet."""
        if self.status is not RequestStatus.WAITING or self.slot is not None or self.block_ids:
            raise RuntimeError(f"request {self.request_id} is admitted twice")
        self.status = RequestStatus.RUNNING
        self.slot = slot
        self.block_ids = block_ids
        self.admission_blocks = len(block_ids)

    def take_cached(self, num_blocks: int, block_size: int) -> None:
        """Its first ``num_blocks`` blocks, just admitted, are prefix-cache hits: their K/V is
        computed already, and they are in the index."""
        self.num_blocks_cached = num_blocks
        self.num_computed = num_blocks * block_size
        if self.num_cached_tokens is None:  # its first admission's, for the frontend
            self.num_cached_tokens = self.num_computed

    def grow(self, block_ids: list[int]) -> None:
        """New blocks for its next tokens, after the ones it holds."""
        self.block_ids += block_ids

    def advance(self, n: int) -> tuple[list[int], bool]:
        """Its next ``n`` tokens are scheduled: they count as computed at once (see the class
        docstring), and a chunk that reaches its last token samples the next (a pending token).
        Returns the blocks its cache row has not been told of yet, and whether it samples."""
        computed = self.num_computed + n
        new_blocks = self.block_ids[self.blocks_sent :]
        self.blocks_sent = len(self.block_ids)
        self.reattached = False
        self.num_computed = computed
        if computed > self.high_water:
            self.high_water = computed
        pending = self.num_pending
        sample = computed == len(self.prompt_token_ids) + len(self.output_token_ids) + pending
        if sample:
            self.num_pending = pending + 1
        return new_blocks, sample

    def advance_draft(self, drafts: list[int]) -> list[int]:
        """Its last token (known, or pending from a step in flight) and ``drafts`` after it
        are scheduled, sampled at every position: their K/V counts as computed until
        ``verified``. Returns the blocks its cache row has not been told of yet."""
        if self.num_draft or self.num_tokens - self.num_computed != 1:
            raise RuntimeError(f"request {self.request_id} drafts only after one decode token")
        new_blocks = self.block_ids[self.blocks_sent :]
        self.blocks_sent = len(self.block_ids)
        self.num_computed += 1 + len(drafts)
        self.high_water = max(self.high_water, self.num_computed - len(drafts))
        self.num_pending, self.num_draft = self.num_pending + 1, len(drafts)
        return new_blocks

    def verified(self, accepted: int) -> None:
        """Its drafts came back (every earlier step's token has) with the first ``accepted``
        accepted: the rest's K/V is void, and ``accepted + 1`` tokens are pending (the accepted
        drafts and the token sampled after them), to be passed to ``sampled`` in order."""
        if not 0 <= accepted <= self.num_draft or self.num_pending != 1:
            raise RuntimeError(f"request {self.request_id}: {accepted} of {self.num_draft} drafts")
        self.num_computed -= self.num_draft - accepted
        self.num_pending, self.num_draft = accepted + 1, 0

    def cut_blocks(self, keep: int) -> list[int]:
        """Keep its first ``keep`` blocks (the rest held rejected drafts' K/V); returns the
        others, for the allocator."""
        cut = self.block_ids[keep:]
        del self.block_ids[keep:]
        self.blocks_sent = min(self.blocks_sent, keep)
        return cut

    def sampled(self, token_id: int) -> None:
        """Its oldest pending token came back: it is ``token_id``."""
        if self.num_pending < 1:
            raise RuntimeError(f"request {self.request_id} has no pending token")
        self.num_pending -= 1
        self.output_token_ids.append(token_id)

    def rollback(self, n: int, block_size: int) -> list[int]:
        """The worker died with ``n`` of its computed tokens in steps it never answered; its
        blocks stay in the shared pool (docs/kv_pool.md). It keeps its slot and the blocks its
        known tokens need, forgets its pending tokens (the new worker samples them again) and
        begins a fresh row at the first token not acknowledged. Returns the blocks it no longer
        needs, for the caller to free. The epoch changes: a result of the lost steps is stale."""
        self.num_computed -= n
        self.num_pending = 0
        self.epoch += 1
        self.blocks_sent = 0
        self.reattached = True
        self.num_blocks_cached = min(self.num_blocks_cached, self.num_computed // block_size)
        need = blocks_for(self.num_tokens, block_size)
        extra, self.block_ids = self.block_ids[need:], self.block_ids[:need]
        return extra

    def offered(self, num_blocks: int) -> None:
        """Its first ``num_blocks`` blocks are in the prefix cache's index now."""
        self.num_blocks_cached = num_blocks

    def release(self) -> None:
        """Its blocks and slot went back to the ledgers: nothing held, nothing computed."""
        self.block_ids, self.blocks_sent, self.slot = [], 0, None
        self.num_computed = self.num_blocks_cached = self.num_draft = 0
        self.reattached = False

    def requeue(self) -> None:
        """Preempted (after ``release``): waiting again, its tokens kept. A token sampled by a
        step still in flight is recomputed, not awaited, and that step's result is stale."""
        self.status = RequestStatus.WAITING
        self.num_pending = 0
        self.epoch += 1
        self.num_preemptions += 1

    def finish(self, reason: str) -> None:
        """It ended (after ``release``, or holding nothing): "stop" or "length", or "abort"."""
        if self.slot is not None or self.block_ids:
            raise RuntimeError(f"request {self.request_id} ends holding a slot or blocks")
        self.status = RequestStatus.ABORTED if reason == "abort" else RequestStatus.FINISHED
        self.finish_reason = reason
