"""SimWorker: a model-free worker that keeps cache rows exactly as the real worker does.

It implements the scheduler/worker row contract (a slot is a cache row with a tenant, a block
table and a K/V count) and simulates K/V by storing each position's token id in its block.
A sampled token is a hash of the tokens read back through the row's block table, so it is a
deterministic function of the request's text, but a wrong block table, a block shared by two
rows or a block reused too early changes the output. Used by sweeps, benchmarks and tests.
"""

from __future__ import annotations

import time
import zlib
from array import array
from dataclasses import dataclass, field

import msgspec

from protocol.messages import (
    PENDING_TOKEN,
    PROTOCOL_VERSION,
    RowSummary,
    Sample,
    SamplingParams,
    StepInput,
    StepItem,
    StepResult,
    WorkerReady,
)


@dataclass
class _Row:
    request_id: str | None = None
    block_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    params: SamplingParams | None = None
    prompt_len: int = 0
    last_sampled: int | None = None  # fed back where a step names PENDING_TOKEN


class SimWorker:
    """A deterministic stand-in for worker.worker.Worker, torch-free and instant."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        max_model_len: int = 4096,
        vocab_size: int = 1000,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._ready = WorkerReady(
            protocol_version=PROTOCOL_VERSION,
            model_id="sim",
            num_blocks=num_blocks,
            block_size=block_size,
            num_slots=num_slots,
            max_model_len=max_model_len,
            eos_token_ids=list(eos_token_ids),
            vocab_size=vocab_size,
        )
        self._kv = [array("q", [-1] * block_size) for _ in range(num_blocks)]
        self._rows = [_Row() for _ in range(num_slots)]

    def successor(self) -> SimWorker:
        """A new worker on this one's pool, as after a SIGKILL with the pool holder alive: the
        same K/V blocks (whatever the lost steps wrote in them), the next generation, no rows."""
        ready = self._ready
        new = SimWorker(
            ready.num_blocks,
            ready.block_size,
            ready.num_slots,
            ready.max_model_len,
            ready.vocab_size,
            tuple(ready.eos_token_ids),
        )
        pool_id = ready.pool_id or "sim-pool"
        generation = ready.pool_generation + 1 if ready.pool_id else 2
        new._ready = msgspec.structs.replace(
            new._ready, pool_id=pool_id, pool_generation=generation
        )
        new._kv = self._kv
        return new

    def shared(self) -> SimWorker:
        """This worker as the first to attach to a shared pool (generation 1)."""
        self._ready = msgspec.structs.replace(self._ready, pool_id="sim-pool", pool_generation=1)
        return self

    def corrupt(self, block: int, offset: int = 0) -> None:
        """Flip one position of a block's simulated K/V (a fault injector's bit flip)."""
        self._kv[block][offset] ^= 1 << 20

    def ready(self) -> WorkerReady:
        """The cache geometry."""
        return self._ready

    def rows(self) -> list[RowSummary]:
        """One summary per slot, empty rows included."""
        return [
            RowSummary(
                slot=i,
                request_id=r.request_id,
                block_ids=list(r.block_ids),
                num_cached=r.num_cached,
            )
            for i, r in enumerate(self._rows)
        ]

    def execute(self, step: StepInput) -> StepResult:
        """Run one step under the row contract; ValueError on a protocol violation."""
        began = time.perf_counter()
        for slot in step.released_slots:
            self._rows[slot] = _Row()
        for rewind in step.rewinds:
            row = self._rows[rewind.slot]
            if rewind.num_cached > row.num_cached or rewind.num_blocks > len(row.block_ids):
                raise ValueError(f"slot {rewind.slot}: a rewind past the row's end")
            del row.block_ids[rewind.num_blocks :]
            row.num_cached, row.last_sampled = rewind.num_cached, None
        sums = [(block, self.checksum(block)) for block in step.verify_blocks]
        ranges = [(b, a, e, self.checksum(b, a, e)) for b, a, e in step.verify_ranges]
        samples = []
        size = len(self._kv[0])
        for item in step.items:
            token = self._run_item(item)
            if token is not None:
                row = self._rows[item.slot]
                drafts = [  # sampled after each draft token, as the real worker does
                    self._next_token(row, row.num_cached - item.num_draft + i)
                    for i in range(1, item.num_draft + 1)
                ]
                sample = Sample(request_id=item.request_id, token_id=token, draft_samples=drafts)
                samples.append(sample)
            table, end = self._rows[item.slot].block_ids, item.start + len(item.token_ids)
            sums += [(b, self.checksum(b)) for b in table[item.start // size : end // size]]
            if end % size:  # the slots it wrote into the block it leaves partial
                b, a = table[end // size], max(item.start, end - end % size) % size
                ranges.append((b, a, end % size, self.checksum(b, a, end % size)))
        rows = self.rows() if step.audit else None
        return StepResult(
            step_id=step.step_id,
            samples=samples,
            rows=rows,
            forward_s=time.perf_counter() - began,
            block_sums=sums,
            range_sums=ranges,
        )

    def checksum(self, block: int, first: int = 0, end: int | None = None) -> int:
        """CRC-32 of a block's simulated K/V (of its slots ``[first, end)``), as the real
        worker sums its blocks' bytes."""
        return zlib.crc32(self._kv[block][first:end].tobytes())

    def _run_item(self, item: StepItem) -> int | None:
        if not 0 <= item.slot < len(self._rows):
            raise ValueError(f"slot {item.slot} out of range")
        row = self._begin(item) if item.fresh else self._rows[item.slot]
        if not item.fresh and (item.start != row.num_cached or item.request_id != row.request_id):
            raise ValueError(
                f"slot {item.slot}: item for {item.request_id} at start {item.start}, but the row "
                f"holds {row.request_id} with {row.num_cached} tokens cached"
            )
        tokens = list(item.token_ids)
        if PENDING_TOKEN in tokens:
            if tokens[0] != PENDING_TOKEN or item.fresh or row.last_sampled is None:
                raise ValueError(f"slot {item.slot}: a pending token with nothing sampled")
            tokens = [row.last_sampled, *tokens[1:]]
        row.last_sampled = None
        if not item.fresh:
            row.block_ids += item.new_blocks
        size = len(self._kv[0])
        for offset, token in enumerate(tokens):
            pos = item.start + offset
            if pos // size >= len(row.block_ids):
                raise ValueError(f"slot {item.slot}: position {pos} is past the row's blocks")
            self._kv[row.block_ids[pos // size]][pos % size] = token
        row.num_cached += len(tokens)
        if item.sample:
            row.last_sampled = self._next_token(row, row.num_cached - item.num_draft)
        return row.last_sampled

    def _begin(self, item: StepItem) -> _Row:
        """A fresh row; positions below ``start`` must already be in its first blocks (hits),
        holding exactly the tokens the scheduler says they hold."""
        size = len(self._kv[0])
        aligned = not item.start % size or (item.attached and self._ready.pool_generation > 1)
        if not aligned or item.start > len(item.new_blocks) * size:
            raise ValueError(f"slot {item.slot}: a fresh row cannot start at {item.start}")
        if list(item.cached_token_ids) != [
            self._kv[item.new_blocks[p // size]][p % size] for p in range(item.start)
        ]:
            raise ValueError(f"slot {item.slot}: its cached blocks do not hold its prefix")
        row = _Row(item.request_id, list(item.new_blocks), item.start, item.params, item.prompt_len)
        self._rows[item.slot] = row
        return row

    def _next_token(self, row: _Row, length: int) -> int:
        """The token sampled after the row's first ``length`` positions."""
        size = len(self._kv[0])
        history = array("q", (self._kv[row.block_ids[p // size]][p % size] for p in range(length)))
        if -1 in history:
            raise ValueError(f"row of {row.request_id} reads K/V that was never computed")
        return zlib.crc32(history.tobytes()) % self._ready.vocab_size
