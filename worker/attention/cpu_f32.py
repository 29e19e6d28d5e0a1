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

from worker.attention.base import gather_blocks
from worker.attention.cpu_kernel import CpuKernelBackend
from worker.attention.metadata import PrefillSpan


class CpuF32Backend(CpuKernelBackend):
    """Decodes in ``decode_attention_f32``; prefills in ``prefill_attention_f32`` or SDPA."""

    name = "cpu-f32"
    decode_op = "decode_attention_f32"

    def kernel_prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """A fresh prompt's own k and v, a continued one's gathered blocks (float16 widened as
        they are read)."""
        if span.start == 0:
            keys, values = kv[span.begin : span.end].unbind(1)  # (n, n_kv, hd) each
        else:
            # (2, n_kv, M * bs, hd) in the pool's dtype -> (M * bs, n_kv, hd) views
            keys, values = gather_blocks(layer, span.blocks, self.block_size).transpose(1, 2)
        return torch.ops.nanoserve.prefill_attention_f32(
            q[span.begin : span.end], keys, values, span.start
        )
