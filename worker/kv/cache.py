"""``KVCache``: the paged K/V pool, one tensor holding every layer's blocks.

Block ``b`` holds positions ``[0, block_size)`` of whatever row's block table names it. Each
layer's K (or V) is head-major and seen flat, as ``(n_kv_heads, num_blocks * block_size,
head_dim)``, so a token's home is one index, ``block * block_size + offset``, and gathering a
row's blocks gives each KV head's keys as one contiguous (L, head_dim) matrix, ready for a
batched matmul without a transposing copy.

One block more than ``num_blocks`` exists: ``trash_block``, which no row ever holds. The tokens
that pad a step to a bucketed size (``worker.shapes``) write their K/V there.

``scratch`` hands out reusable buffers for those gathers: a fresh multi-megabyte tensor per
layer would be a fresh mmap, and its page faults cost more than the copy itself.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from protocol.blocks import blocks_for
from protocol.kv_pool import HEADER_BYTES
from worker.cpu.machine import available_ram
from worker.kv.device_pool import WeightedSums
from worker.kv.host_pool import HostPool
from worker.kv.shared import Attachment, PeerPools

_HOST_BUDGET_CAP = 4 << 30


def default_budget(pool: str) -> int:
    """The pool's bytes when none is given, by the plan's ``kv_pool``: "device", 80% of the
    GPU's free memory (weights already loaded); "host", a quarter of available RAM, at most
    4 GiB."""
    if pool == "device":
        free, _ = torch.cuda.mem_get_info()
        return int(free * 0.8)
    return min(available_ram() // 4, _HOST_BUDGET_CAP)


class QueuedSums(NamedTuple):
    """A device pool's sums on their way to the host: ``host`` once ``event`` has passed."""

    host: torch.Tensor  # (n,) int64
    event: object | None  # a torch.cuda.Event; None where the copy was synchronous


class KVCache:
    """The K/V pool: (num_layers, 2, n_kv_heads, num_blocks + 1, block_size, head_dim)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        pool: str = "host",
        attachment: Attachment | None = None,
    ) -> None:
        """``attachment``: where a host pool lives; its ``mapping`` (the pool holder's shared
        file, ``worker.kv.shared``) or, without one, a private mapping of this process."""
        self.attachment = attachment or Attachment()
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.trash_block = num_blocks  # the one block past the ledger's
        shape = (num_layers, 2, n_kv_heads, num_blocks + 1, block_size, head_dim)
        # Zero from the start: a padded read of a block nothing wrote yet must see finite
        # numbers. The plan's ``kv_pool``: "host", mapped pages, backed behind serving
        # (worker.kv.host_pool); "device", zeroed now.
        self.host: HostPool | None = None
        if pool == "host":
            mapping = self.attachment.mapping
            offset = HEADER_BYTES if mapping is not None else 0
            self.host = HostPool(shape, block_axis=3, dtype=dtype, mapping=mapping, offset=offset)
            self.pool = self.host.tensor
        elif pool == "device" and self.attachment.device_pool is not None:
            # The holder's memory (worker.kv.device_pool), zeroed when it was made: a worker
            # before this one may have left K/V in it.
            self.pool = self.attachment.device_pool.view(dtype).view(shape)
        elif pool == "device":
            self.pool = torch.zeros(shape, dtype=dtype, device=device)
        else:
            raise ValueError(f"no K/V pool kind {pool!r}")
        flat = (num_layers, 2, n_kv_heads, (num_blocks + 1) * block_size, head_dim)
        self._flat = self.pool.view(flat)
        self._scratch: dict[str, torch.Tensor] = {}
        # A tensor-parallel leader's maps of the other ranks' shared pools: ``checksum`` covers
        # every rank's shard of a block (worker.kv.shared).
        self.peers: PeerPools | None = None
        # A device pool's sums are taken on the device (worker.kv.device_pool), a host pool's are
        # CRC-32s of its bytes.
        self.weighted: WeightedSums | None = None
        if self.attachment.device_pool is not None:
            self.weighted = WeightedSums(self.pool, block_size)

    def populate(
        self, after: Callable[[], object] | None = None, busy: Callable[[], bool] | None = None
    ) -> None:
        """Make the whole pool resident in the background, once ``after`` returns and while
        ``busy`` says False (on the CPU; a device's pool already is)."""
        if self.host is not None:
            self.host.populate(after, busy)

    def close(self) -> None:
        """Stop making the pool resident (the worker is going)."""
        if self.host is not None:
            self.host.stop()

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero blocks as they join a row: a padded read of a block's unwritten tail must see
        finite numbers, which a zero attention weight cancels, whatever a poisoned or reused
        block held before."""
        # One slice per run of adjacent ids (the allocator keeps a row's blocks adjacent where it
        # can): index_fill_ over the pool's strided block axis took 0.43 ms for 8 adjacent
        # blocks, a slice's zero_ 0.04 ms; 256 scattered blocks 17.6 against 12.4 ms.
        ids = sorted(set(blocks))
        first = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                self.pool[:, :, :, ids[first] : ids[i - 1] + 1].zero_()
                first = i

    def zero_tail(self, block: int, offset: int) -> None:
        """Zero positions ``[offset, block_size)`` of a block whose head holds K/V a worker
        before this one wrote (a re-attached row's last, partial block)."""
        self.pool[:, :, :, block, offset:].zero_()

    def checksum(self, block: int) -> int:
        """CRC-32 of a block's K/V bytes, every layer, K then V (what the scheduler records
        and checks after a re-attach: docs/kv_pool.md); on a tensor-parallel leader, continued
        over every other rank's shard of it, in rank order."""
        data = self.pool[:, :, :, block].contiguous().view(torch.uint8)  # (L, 2, H, bs, hd * e)
        crc = zlib.crc32(data.cpu().numpy())
        return self.peers.checksum(block, crc) if self.peers is not None else crc

    def asked_sums(
        self, blocks: list[int], ranges: list[tuple[int, int, int]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]]]:
        """``checksum`` of each of ``blocks`` and ``range_sums`` of ``ranges``, leaving out block
        ids outside the pool and ranges outside a block (what a check after a re-attach asks
        for in ``StepInput.verify_blocks`` and ``verify_ranges``, and what a step wrote)."""
        known = range(self.num_blocks)
        blocks = [block for block in blocks if block in known]
        inside = [r for r in ranges if r[0] in known and 0 <= r[1] < r[2] <= self.block_size]
        if self.weighted is not None:
            return self._paired(blocks, inside, self.weighted.of(blocks, inside).tolist())
        return [(block, self.checksum(block)) for block in blocks], self.range_sums(inside)

    def queue_sums(
        self, blocks: list[int], ranges: list[tuple[int, int, int]]
    ) -> QueuedSums | None:
        """A device pool's sums of what a step wrote (``asked_sums``' arguments), queued on the
        device behind the step and copied back without waiting; None for a host pool, whose
        sums ``written_sums`` takes once the step is done."""
        if self.weighted is None:
            return None
        sums = self.weighted.of(blocks, ranges)  # (len(blocks) + len(ranges),) int64
        host = torch.empty(sums.shape, dtype=torch.int64, pin_memory=sums.is_cuda)
        host.copy_(sums, non_blocking=True)
        event = torch.cuda.Event() if sums.is_cuda else None
        if event is not None:
            event.record()
        return QueuedSums(host, event)

    def written_sums(
        self, blocks: list[int], ranges: list[tuple[int, int, int]], queued: QueuedSums | None
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]]]:
        """The sums of what a step wrote, as ``asked_sums`` gives them: ``queued``'s, once its
        copy is done, or (a host pool) taken now."""
        if queued is None:
            return self.asked_sums(blocks, ranges)
        if queued.event is not None:
            queued.event.synchronize()
        return self._paired(blocks, ranges, queued.host.tolist())

    @staticmethod
    def _paired(blocks, ranges, values: list[int]):
        """``asked_sums``' pairs from one value per block, then per range."""
        cut = len(blocks)
        sums = list(zip(blocks, values[:cut], strict=True))
        return sums, [(*r, value) for r, value in zip(ranges, values[cut:], strict=True)]

    def range_sums(self, ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        """(block, first, end, CRC-32) for each (block, first, end): the sum of slots ``[first,
        end)`` of a block's K/V, slot by slot, each slot every layer, K then V (what the
        scheduler records for a block a step left partial: docs/kv_pool.md); on a tensor-parallel
        leader, continued over every other rank's shard of those slots. One gather for them
        all: a decode step asks one slot a row."""
        if not ranges:
            return []
        size = self.block_size
        positions = [
            block * size + slot for block, first, end in ranges for slot in range(first, end)
        ]
        index = torch.tensor(positions, device=self.pool.device)
        gathered = self._flat.index_select(3, index)  # (L, 2, H, N, hd)
        slots = gathered.permute(3, 0, 1, 2, 4).contiguous()  # (N, L, 2, H, hd)
        data = slots.view(torch.uint8).view(len(positions), -1).cpu().numpy()
        sums, at = [], 0
        for block, first, end in ranges:
            crc = zlib.crc32(data[at : at + end - first])
            if self.peers is not None:  # a tensor-parallel leader: every rank's shard
                crc = self.peers.range_checksum(block, first, end, crc)
            sums.append((block, first, end, crc))
            at += end - first
        return sums

    def layers(self) -> torch.Tensor:
        """Every layer's K and V, (num_layers, 2, n_kv_heads, (num_blocks + 1) * block_size,
        head_dim)."""
        return self._flat

    def layer(self, index: int) -> torch.Tensor:
        """K and V of one layer, (2, n_kv_heads, (num_blocks + 1) * block_size, head_dim)."""
        return self._flat[index]

    def scratch(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A reusable buffer of ``shape`` in the pool's dtype; contents are garbage. The same
        name returns the same memory (grown when too small) until the next call."""
        numel = 1
        for size in shape:
            numel *= size
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=self.pool.dtype, device=self.pool.device)
            self._scratch[name] = buffer
        return buffer[:numel].view(shape)

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes across all layers, K and V."""
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * n_kv_heads * head_dim * element

    @staticmethod
    def blocks_for_budget(budget: int, bytes_per_block: int, max_model_len: int, block_size: int):
        """How many blocks fit in ``budget`` bytes; ValueError if not even one request of
        ``max_model_len`` tokens fits."""
        num_blocks = budget // bytes_per_block
        needed = blocks_for(max_model_len, block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks, but one request of "
                f"max_model_len={max_model_len} needs {needed} ({needed * bytes_per_block} bytes)"
            )
        return num_blocks
