"""A shared pool in device memory: open the holder's CUDA export, and sum blocks on the device.

``open_granted`` turns the holder's ``DeviceHandle`` (``holder.device_pool``) into a flat uint8
tensor over the pool's bytes, on this worker's GPU: the memory stays the holder's, so a
worker's death leaves every block of K/V in it.

``WeightedSums`` is what a device pool's checks compare (docs/kv_pool.md, "Proving the
contents"): a CPU pool's CRC-32 would copy every block a step fills to the host, and on a GPU
that copy would wait for the next step, already queued behind it, so a step could never overlap
the host's work on the next one again. Instead each 32-bit word of the bytes summed is
multiplied by a weight that depends on its place, modulo the prime 2^31 - 1, and the products are
added: torch operators, queued on the device right after the step's forward and downloaded with
its samples. Every term is below 2^31, so a sum of up to 2^32 of them fits in int64, and integer
sums do not depend on their order. A changed word changes its term unless the change is a
multiple of the prime; two changed words cancel only by a 1 in 2^31 chance, as for a CRC-32.
"""

from __future__ import annotations

import torch

from protocol.kv_pool import PoolGeometry, PoolGranted, pool_bytes

PRIME = 2**31 - 1
# Blocks summed in one go: their words' int64 terms take 4 times their bytes (a prefill chunk of
# 2,048 tokens fills 128 blocks, 256 MB of K/V for an 8B model's 2 MB blocks).
BLOCKS_AT_ONCE = 16
# Neighbouring words far apart, and coprime with PRIME - 1: every weight differs from the
# next 2^31 - 2 places' (a multiplicative congruential generator's multiplier).
_STRIDE = 1664525


def open_granted(grant: PoolGranted, asked: PoolGeometry, any_size: bool):
    """The granted device pool as a flat uint8 tensor (``Attachment.device_pool``), or a
    fallback ``Attachment`` saying why not (another geometry, a handle that does not open)."""
    from worker.kv.shared import Attachment, private

    granted, handle = grant.geometry, grant.device_handle
    if granted.layout() != asked.layout() or (
        granted.num_blocks != asked.num_blocks and not any_size
    ):
        return private("geometry", f"granted {granted.describe()}, asked {asked.describe()}")
    if handle.size != pool_bytes(granted):
        return private("header", f"the handle covers {handle.size} bytes, not the pool's")
    try:
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(*handle.args())
    except Exception as exc:  # no CUDA in this build, a stale or foreign handle: recompute
        return private("header", f"cannot open the pool's CUDA handle: {exc}")
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (handle.size,))
    return Attachment(
        pool_id=grant.pool_id,
        generation=grant.generation,
        geometry=granted,
        device_pool=flat,
    )


class WeightedSums:
    """The weighted sums of one pool's blocks and of slots of them, on the pool's device."""

    def __init__(self, pool: torch.Tensor, block_size: int) -> None:
        """``pool`` (num_layers, 2, n_kv, num_blocks + 1, block_size, head_dim)."""
        self.pool, self.block_size = pool, block_size
        num_layers, two, n_kv, _, _, head_dim = pool.shape
        self.slot_words = num_layers * two * n_kv * head_dim * pool.element_size() // 4
        self._weights: torch.Tensor | None = None

    def weights(self, count: int) -> torch.Tensor:
        """(count,) int64 weights, 1 to PRIME - 1, of the words at places 0 to count - 1."""
        if self._weights is None or self._weights.numel() < count:
            places = torch.arange(count, dtype=torch.int64, device=self.pool.device)
            self._weights = (places * _STRIDE) % (PRIME - 1) + 1
        return self._weights[:count]

    def of(self, blocks: list[int], ranges: list[tuple[int, int, int]]) -> torch.Tensor:
        """One int64 sum per block of ``blocks`` (every layer, K then V, as ``KVCache.checksum``
        orders its bytes), then per (block, first, end) of ``ranges`` (slots ``[first, end)``
        slot by slot, each slot every layer, K then V, as ``KVCache.range_sums``); on the pool's
        device, nothing waited for."""
        sums = []
        for at in range(0, len(blocks), BLOCKS_AT_ONCE):
            index = self._index(blocks[at : at + BLOCKS_AT_ONCE])
            data = (
                self.pool.index_select(3, index).movedim(3, 0).contiguous()
            )  # (n, L, 2, H, bs, hd)
            words = data.view(torch.int32).view(index.numel(), -1)  # (n, W)
            sums.append(self._sum(words))
        if ranges:
            size = self.block_size
            slots = [block * size + s for block, first, end in ranges for s in range(first, end)]
            flat = self.pool.flatten(3, 4)  # (L, 2, H, (N + 1) * bs, hd)
            index = self._index(slots)
            data = flat.index_select(3, index).movedim(3, 0).contiguous()  # (S, L, 2, H, hd)
            words = data.view(torch.int32).view(len(slots), -1)  # (S, slot_words)
            # Each range's slots end to end: a word's place counts from its range's first slot.
            within = [s for _, first, end in ranges for s in range(end - first)]
            offsets = self._index(within)[:, None] * words.shape[1]
            terms = self._terms(words, offsets)  # (S, slot_words)
            owner = [i for i, (_, first, end) in enumerate(ranges) for _ in range(end - first)]
            per_range = torch.zeros(len(ranges), dtype=torch.int64, device=self.pool.device)
            per_range.index_add_(0, self._index(owner), terms.sum(1))
            sums.append(per_range % PRIME)
        if not sums:
            return torch.zeros(0, dtype=torch.int64, device=self.pool.device)
        return torch.cat(sums)

    def _index(self, values: list[int]) -> torch.Tensor:
        """int64 ``values`` on the pool's device, copied without waiting: ``torch.tensor(...,
        device=cuda)`` would copy synchronously, behind the step already queued."""
        host = torch.tensor(values, dtype=torch.long, pin_memory=self.pool.is_cuda)
        return host.to(self.pool.device, non_blocking=True)

    def _sum(self, words: torch.Tensor) -> torch.Tensor:
        """(N, W) int32 words -> (N,) int64 sums, each word at its place in its row."""
        return self._terms(words, None).sum(1) % PRIME

    def _terms(self, words: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        """Each word (as unsigned) times its place's weight, modulo PRIME: (N, W) int64."""
        unsigned = words.to(torch.int64) & 0xFFFFFFFF
        if offsets is None:
            weights = self.weights(words.shape[1])[None, :]
        else:
            places = offsets + torch.arange(words.shape[1], device=words.device)[None, :]
            weights = (places * _STRIDE) % (PRIME - 1) + 1
        return unsigned * weights % PRIME
