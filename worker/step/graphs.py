"""``DecodeGraphs``: decode steps replayed from graphs captured at start (``cuda-graphs``).

A decode step's work is fixed by two numbers: its rows, padded to a batch bucket
(``graph_bucket``, up to the slot count), and the widest block table it reads.
At start, one function per (bucket, width) runs the model over persistent input buffers, and
the adapter captures it (``worker.step.graph_adapters``: a CUDA graph; on the CPU the function
itself). A step that fits (decodes only, at most the biggest bucket, no row wider than the
widest width) fills the buffers and replays its key; anything else runs eagerly.

Padding: the rows past a step's own up to its bucket read the block tables' trash row and write
their K/V into the trash block (``KVCache.trash_block``), at position 0, so they write no
block any row holds; the step's sampled rows never include them.

Widths: a backend that reads the cache in place pays nothing for a wide table, so it gets one
width, the longest context. The torch reference gathers each row's whole table, so a graph of
the longest context would gather all of it for every row at every step: it gets a few widths
(``GATHERED_CONTEXTS``), and rows longer than the widest run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from protocol.blocks import blocks_for
from protocol.messages import StepItem
from worker.attention import AttentionBackend, AttentionMetadata
from worker.kv.cache import KVCache
from worker.model.llama import LlamaModel
from worker.model.ops import ModelOps
from worker.rows import Row
from worker.shapes import padded_count
from worker.step.block_tables import BlockTables
from worker.step.graph_adapters import ADAPTERS
from worker.step.pack import HostPack, Packed

log = logging.getLogger("nanoserve.worker")

# The plan's attention -> the context lengths (tokens) its graphs are captured for, where a
# graph's cost grows with its width; any other backend gets one, the longest context.
GATHERED_CONTEXTS: dict[str, tuple[int, ...]] = {"torch": (256, 1024)}

Key = tuple[int, int]  # (batch bucket, width in blocks)


class DecodeGraphs:
    """The captured decode steps of one model over one cache, and their buffers."""

    def __init__(
        self,
        *,
        model: LlamaModel,
        cache: KVCache,
        attention: AttentionBackend,
        ops: ModelOps,
        plan,
        num_slots: int,
        max_model_len: int,
    ) -> None:
        self.model, self.cache, self.attention, self.ops = model, cache, attention, ops
        self.adapter = ADAPTERS[plan.device]()
        bs, device = cache.block_size, plan.device
        self.tables = BlockTables(
            num_slots=num_slots,
            max_model_len=max_model_len,
            block_size=bs,
            trash_block=cache.trash_block,
            device=device,
        )
        self.buckets = sorted({graph_bucket(n) for n in range(1, num_slots + 1)})
        contexts = GATHERED_CONTEXTS.get(plan.attention, (max_model_len,))
        widths = {blocks_for(min(c, max_model_len), bs) for c in contexts}
        self.widths = sorted(widths)
        most, widest = self.buckets[-1], self.widths[-1]
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(most, **long)
        self.positions = torch.zeros(most, **long)
        self.write = torch.zeros(most, **long)
        self.cached = torch.zeros(most, **long)
        self.blocks = torch.zeros(most * widest, **long)  # (B, W) views, each contiguous
        dtype = getattr(torch, plan.dtype)
        self.hidden = torch.zeros(most, model.spec.hidden_size, dtype=dtype, device=device)
        self.replays = 0  # steps replayed (not counting capture)
        self.capture_s = 0.0
        self.capture_bytes: int | None = None  # device memory the graphs took (None: CPU)

    @property
    def keys(self) -> list[Key]:
        return [(b, w) for b in self.buckets for w in self.widths]

    def choose(self, items: list[StepItem]) -> Key | None:
        """The key a step replays, or None: it runs eagerly."""
        if not items or len(items) > self.buckets[-1]:
            return None
        if any(len(item.token_ids) != 1 or item.start == 0 for item in items):
            return None  # a prefill
        widest = blocks_for(max(item.start for item in items) + 1, self.cache.block_size)
        width = next((w for w in self.widths if w >= widest), None)
        return None if width is None else (graph_bucket(len(items)), width)

    def pack(self, pack: HostPack, items: list[StepItem], rows: list[Row], key: Key) -> None:
        """Add the step's rows padded to the key's bucket (``g.*``): their slots (the trash row
        for padding), cached lengths, and where their new K/V goes."""
        batch, bs = key[0], self.cache.block_size
        trash = self.cache.trash_block * bs
        slots, cached, write = [], [], []
        for item, row in zip(items, rows, strict=True):
            slots.append(item.slot)
            cached.append(item.start)
            write.append(row.block_table[item.start // bs] * bs + item.start % bs)
        padding = batch - len(items)
        slots.extend([self.tables.trash_row] * padding)
        cached.extend([0] * padding)
        write.extend([trash] * padding)  # position 0 of the trash block
        pack.add("g.slot", slots)
        pack.add("g.cached", cached)
        pack.add("g.write", write)

    def run(self, packed: Packed, ids: torch.Tensor, positions: torch.Tensor, key: Key):
        """Fill the buffers from the step's device inputs (``ids`` and ``positions`` padded to
        the bucket) and replay -> hidden states (B, hidden) of the bucket's rows."""
        batch, width = key
        self.ids[:batch].copy_(ids)
        self.positions[:batch].copy_(positions)
        self.write[:batch].copy_(packed["g.write"])
        self.cached[:batch].copy_(packed["g.cached"])
        blocks = self.blocks[: batch * width].view(batch, width)
        torch.index_select(self.tables.tables[:, :width], 0, packed["g.slot"], out=blocks)
        self.adapter.replay(key)
        self.replays += 1
        return self.hidden[:batch]

    def capture(self) -> None:
        """Capture every key, biggest first (later ones reuse the pool's memory), on buffers
        that point every row at the trash block; logs how long it took and what it took."""
        began = time.perf_counter()
        free = self.adapter.free_memory()
        with torch.inference_mode():
            self.ids.zero_()
            self.positions.zero_()
            self.cached.zero_()
            self.write.fill_(self.cache.trash_block * self.cache.block_size)
            self.blocks.fill_(self.cache.trash_block)
            for width in self.widths:  # scratch buffers grow to their most outside a capture
                self._body(self.buckets[-1], width)
            for key in sorted(self.keys, reverse=True):
                self.adapter.capture(key, lambda key=key: self._body(*key))
        self.capture_s = time.perf_counter() - began
        after = self.adapter.free_memory()
        self.capture_bytes = None if free is None else free - after
        taken = "" if free is None else f", {(free - after) / (1 << 20):.0f} MiB"
        log.info(
            "decode graphs: %d buckets (%d to %d rows) x %d widths (%s blocks) in %.1f s%s",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
            len(self.widths),
            ", ".join(map(str, self.widths)),
            self.capture_s,
            taken,
        )

    def _body(self, batch: int, width: int) -> None:
        """The captured step: the model over the buffers' first ``batch`` rows, reading
        ``width`` blocks of each row's table -> ``self.hidden[:batch]``."""
        blocks = self.blocks[: batch * width].view(batch, width)
        cached = self.cached[:batch]
        meta = AttentionMetadata(
            write_index=self.write[:batch],
            decode_tokens=None,
            decode_targets=None,
            decodes=self.attention.decode_rows(blocks, cached),
            prefills=[],
            num_tokens=batch,
        )
        ids, positions = self.ids[:batch], self.positions[:batch]
        hidden = self.model(ids, positions, meta, self.cache, self.attention, self.ops)
        self.hidden[:batch].copy_(hidden)


def graph_bucket(n: int) -> int:
    """The captured batch a decode step of ``n`` rows replays: ``padded_count``'s, but 5 to 8
    rows share the graph of 8 (a graph is captured per bucket and width, and on a GPU a few
    padding rows cost next to nothing)."""
    return padded_count(max(n, 8)) if n > 4 else n
