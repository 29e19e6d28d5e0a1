"""``RowTable``: the worker's cache rows, one per slot, and the row protocol's checks.

See the contract in protocol/messages.py (``StepItem``): a ``fresh`` item begins a row (past
position 0 when its first blocks are prefix-cache hits), any other must continue the same
tenant exactly where its cache ends. A step is checked
whole before any row changes, so a rejected step leaves every row as it was.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from protocol.messages import (
    PENDING_TOKEN,
    Rewind,
    RowSummary,
    SamplingParams,
    StepInput,
    StepItem,
)


@dataclass
class Row:
    """One slot's cache row and the request state the sampler needs."""

    request_id: str | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    params: SamplingParams | None = None
    prompt_len: int = 0
    history: list[int] = field(default_factory=list)  # every token fed into the row
    seed: int = 0
    sampled: bool = False  # whether the row's last step sampled: a PENDING_TOKEN may follow
    last_sampled: int | None = None  # that sample, once the host has it (worker.step.in_flight)
    penalty_state: object | None = None  # the reference sampler's counts (worker.sampling.sampler)
    grammar_state: object | None = None  # its grammar's matcher (worker.grammar), likewise

    @property
    def output_tokens(self) -> list[int]:
        """The generated tokens fed back so far (prompt excluded)."""
        return self.history[self.prompt_len :]


class RowTable:
    """Per-slot rows; ``check`` raises ValueError naming the slot and numbers on a violation."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        seed: int,
        attached: bool = False,
    ) -> None:
        self.rows = [Row() for _ in range(num_slots)]
        # Blocks some step of this worker has written: a prefix-cache hit may only name these
        # (K/V in a block this process never wrote is zeros, whatever the scheduler believes).
        # On a shared pool an earlier worker wrote (``attached``), any block may hold K/V: the
        # scheduler, which kept the ledger across the restart, is trusted for all of them.
        self.written: set[int] = set(range(num_blocks)) if attached else set()
        self.attached = attached
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._seeds = random.Random(seed)  # seeds for requests that bring none

    def check(self, step: StepInput, vocab_size: int) -> None:
        """Raise ValueError if any item of ``step`` breaks the row protocol."""
        released = set(step.released_slots)
        for slot in released:
            self._check_slot(slot)
        rewound = {rewind.slot: self._check_rewind(rewind, released) for rewind in step.rewinds}
        seen: set[int] = set()
        for item in step.items:
            self._check_slot(item.slot)
            if item.slot in seen:
                raise ValueError(f"slot {item.slot} appears twice in step {step.step_id}")
            seen.add(item.slot)
            row = Row() if item.slot in released else self.rows[item.slot]
            self._check_item(item, rewound.get(item.slot, row), vocab_size)

    def _check_rewind(self, rewind: Rewind, released: set[int]) -> Row:
        """A rewind cuts a held row back, never forward; returns the row as it leaves it."""
        self._check_slot(rewind.slot)
        row = self.rows[rewind.slot]
        n, blocks = rewind.num_cached, rewind.num_blocks
        if (
            rewind.slot in released
            or row.request_id is None
            or not 0 < n <= row.num_cached
            or not 0 < blocks <= len(row.block_table)
            or n > blocks * self.block_size
        ):
            raise ValueError(
                f"slot {rewind.slot}: a rewind to {n} tokens in {blocks} blocks does not cut "
                f"back its row ({row.request_id!r}, {row.num_cached} tokens in "
                f"{len(row.block_table)} blocks)"
            )
        return Row(row.request_id, row.block_table[:blocks], n, row.params, row.prompt_len)

    def rewind(self, rewinds: list[Rewind]) -> None:
        """Cut checked rows back over rejected draft tokens: blocks, K/V count and history."""
        for rewind in rewinds:
            row = self.rows[rewind.slot]
            del row.block_table[rewind.num_blocks :]
            del row.history[rewind.num_cached :]
            row.num_cached = rewind.num_cached
            row.sampled, row.last_sampled = False, None

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self.rows):
            raise ValueError(f"slot {slot} out of range [0, {len(self.rows)})")

    def _check_item(self, item: StepItem, row: Row, vocab_size: int) -> None:
        where = f"slot {item.slot} ({item.request_id!r})"
        if not item.token_ids:
            raise ValueError(f"{where}: item has no token_ids")
        if item.fresh:
            self._check_fresh(item, where)
            blocks = len(item.new_blocks)
        else:
            if row.request_id != item.request_id or item.start != row.num_cached or not item.start:
                raise ValueError(
                    f"{where}: start {item.start} does not continue the row "
                    f"(tenant {row.request_id!r}, num_cached {row.num_cached})"
                )
            blocks = len(row.block_table) + len(item.new_blocks)
        end = item.start + len(item.token_ids)
        if end > blocks * self.block_size or end > self.max_model_len:
            raise ValueError(
                f"{where}: positions up to {end} exceed {blocks} blocks of {self.block_size} "
                f"or max_model_len {self.max_model_len}"
            )
        if item.num_draft:
            self._check_drafts(item, row, where)
        if PENDING_TOKEN in item.token_ids:
            alone = len(item.token_ids) == 1 + item.num_draft  # drafts may follow it
            if item.token_ids[0] != PENDING_TOKEN or not alone or item.fresh:
                raise ValueError(
                    f"{where}: a pending token must be an item's only token, or its first "
                    "before draft tokens"
                )
            if PENDING_TOKEN in item.token_ids[1:]:
                raise ValueError(f"{where}: a draft token is pending")
            if not row.sampled:
                raise ValueError(f"{where}: a pending token, but the row's last step sampled none")
        bad = [b for b in item.new_blocks if not 0 <= b < self.num_blocks]
        tokens = [*item.token_ids, *item.cached_token_ids]
        bad_tokens = [t for t in tokens if not 0 <= t < vocab_size and t != PENDING_TOKEN]
        if bad or bad_tokens:
            raise ValueError(f"{where}: block ids {bad} or token ids {bad_tokens} out of range")

    def _check_drafts(self, item: StepItem, row: Row, where: str) -> None:
        """Drafts follow a known token of a running row that samples at every position, with
        no state the sampler would have to roll back per position (a grammar's matcher walks
        the drafts on copies: ``worker.grammar.masks``)."""
        params = row.params or SamplingParams()
        if item.fresh or not item.sample or not 0 < item.num_draft < len(item.token_ids):
            raise ValueError(
                f"{where}: {item.num_draft} draft tokens need a sampled item of a running row, "
                "with a token before them"
            )
        if (
            (params.grammar is not None and params.min_tokens)
            or params.logprobs is not None
            or params.repetition_penalty != 1.0
            or params.presence_penalty
            or params.frequency_penalty
        ):
            message = "draft tokens on a row with logprobs, penalties, or a grammar and min_tokens"
            raise ValueError(f"{where}: {message}")

    def _check_fresh(self, item: StepItem, where: str) -> None:
        if item.params is None or item.prompt_len < 1:
            raise ValueError(f"{where}: a fresh row needs params and prompt_len >= 1")
        if item.attached and not self.attached:
            raise ValueError(f"{where}: a re-attached row, but this worker's pool is new")
        if item.attached:
            if len(item.cached_token_ids) != item.start:
                raise ValueError(f"{where}: a re-attached row needs its {item.start} tokens")
        elif item.start % self.block_size or len(item.cached_token_ids) != item.start:
            raise ValueError(
                f"{where}: a fresh row starts after whole cached blocks, with their tokens "
                f"(start {item.start}, {len(item.cached_token_ids)} cached tokens)"
            )
        hits = item.new_blocks[: item.start // self.block_size]
        unwritten = [block for block in hits if block not in self.written]
        if unwritten:
            raise ValueError(f"{where}: cache hits on blocks {unwritten} this worker never wrote")

    def release(self, slots: list[int]) -> None:
        """Empty these rows: no tenant, no blocks, nothing cached."""
        for slot in slots:
            self.rows[slot] = Row()

    def apply(self, item: StepItem) -> tuple[Row, list[int]]:
        """Update a checked item's row for the tokens about to be computed; return the row and
        those tokens. A pending token stays ``PENDING_TOKEN`` there (the device feeds it, from
        its own copy of the row's last sample); the row's history takes the sample if the host
        has it already, else a ``PENDING_TOKEN`` placeholder, which ``Launched.resolve``
        replaces once it has."""
        row = self.rows[item.slot]
        if item.fresh:
            params = item.params or SamplingParams()
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            history = list(item.cached_token_ids)
            row = Row(item.request_id, [], item.start, params, item.prompt_len, history, seed)
            self.rows[item.slot] = row
        tokens = list(item.token_ids)
        if tokens[0] == PENDING_TOKEN:  # alone, or before draft tokens
            known = row.last_sampled
            row.history.append(PENDING_TOKEN if known is None else known)
            row.history.extend(tokens[1:])
        else:
            row.history.extend(tokens)
        row.sampled, row.last_sampled = False, None  # set again only if this item samples
        self.written.update(written_blocks(item, self.block_size))
        row.block_table.extend(item.new_blocks)
        row.num_cached += len(tokens)
        return row, tokens

    def summaries(self) -> list[RowSummary]:
        """Every row (empty ones included), as the audit reports it."""
        return [
            RowSummary(
                slot=slot,
                request_id=row.request_id,
                block_ids=list(row.block_table),
                num_cached=row.num_cached,
            )
            for slot, row in enumerate(self.rows)
        ]


def written_blocks(item: StepItem, block_size: int) -> list[int]:
    """The blocks an item joins to its row that it will write and that hold nothing yet: a
    fresh row's leading blocks are prefix-cache hits, shared, and never written; a re-attached
    row's blocks up to ``start`` hold K/V (its partial last block: only its tail is zeroed)."""
    if not item.fresh:
        return item.new_blocks
    if item.attached:
        return item.new_blocks[-(-item.start // block_size) :]
    return item.new_blocks[item.start // block_size :]
