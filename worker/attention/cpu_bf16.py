"""``CpuBf16Backend``: bfloat16 decodes and prefills through nanoserve's own CPU operators.

``torch.ops.nanoserve.decode_attention`` (``worker/cpu/csrc/decode_attention.cpp``) reads each
row's bfloat16 blocks in place, where the torch backend first gathers them into a copy: a
decode's attention costs one pass over its K/V. Eager and compiled steps call the same operator.

``torch.ops.nanoserve.prefill_attention`` (``worker/cpu/csrc/prefill_attention.cpp``) takes each
prefill span, fresh or continuing a cached prefix, from its blocks in place: 4 to 5 times faster
than SDPA's flash kernel on these heads. Built only with AVX512-BF16: elsewhere the plan says
``prefill="sdpa"`` and prefills are the torch backend's.
"""

from __future__ import annotations

import torch

from worker.attention.cpu_kernel import CpuKernelBackend
from worker.attention.metadata import PrefillSpan


class CpuBf16Backend(CpuKernelBackend):
    """Decodes in ``decode_attention``; prefills in ``prefill_attention`` or SDPA."""

    name = "cpu-bf16"
    decode_op = "decode_attention"

    def kernel_prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """Reads the span's K/V from the pool, where ``forward`` has just written them."""
        return torch.ops.nanoserve.prefill_attention(
            q[span.begin : span.end], layer, span.blocks, span.start, self.block_size
        )
