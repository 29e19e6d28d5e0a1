"""``CpuF32Backend``: float32 decodes and prefills through nanoserve's own AVX2 operators.

``torch.ops.nanoserve.decode_attention_f32`` (``worker/cpu/csrc/decode_attention_f32.cpp``) reads
each row's blocks in place, from a float32 pool or a float16 one (widened as it reads, as
llama.cpp's f16 K/V). ``torch.ops.nanoserve.prefill_attention_f32``
(``worker/cpu/csrc/prefill_attention_f32.cpp``) scores only the positions a query may see, where
SDPA's computes the masked half too: about half SDPA's time a layer for a 128-token prompt
(docs/performance.md). Both need only AVX2, FMA and F16C.
"""

from __future__ import annotations

import torch

from worker.attention.base import Scratch, gather_blocks
from worker.attention.metadata import DecodeRows, PrefillSpan
from worker.attention.torch_backend import TorchBackend


class CpuF32Backend(TorchBackend):
    """Decodes in ``decode_attention_f32``; prefills in ``prefill_attention_f32``
    (``prefill_kernel``) or SDPA."""

    name = "cpu-f32"

    def __init__(self, *, prefill_kernel: bool, **geometry) -> None:
        super().__init__(**geometry)
        self.prefill_kernel = prefill_kernel

    def decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: torch.Tensor,
        rows: DecodeRows,
        scratch: Scratch | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.decode``; reads the cache in place, so needs no scratch."""
        return torch.ops.nanoserve.decode_attention_f32(
            q, kv, layer, rows.blocks, rows.cached, self.block_size
        )

    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """See ``AttentionBackend.prefill``; a fresh prompt's own k and v, a continued one's
        gathered blocks (float16 widened as they are read)."""
        if not self.prefill_kernel:
            return super().prefill(q, kv, layer, span)
        if span.start == 0:
            keys, values = kv[span.begin : span.end].unbind(1)  # (n, n_kv, hd) each
        else:
            # (2, n_kv, M * bs, hd) in the pool's dtype -> (M * bs, n_kv, hd) views
            keys, values = gather_blocks(layer, span.blocks, self.block_size).transpose(1, 2)
        return torch.ops.nanoserve.prefill_attention_f32(
            q[span.begin : span.end], keys, values, span.start
        )
