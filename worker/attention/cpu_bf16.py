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

from worker.attention.base import Scratch
from worker.attention.metadata import DecodeRows, PrefillSpan
from worker.attention.torch_backend import TorchBackend


class CpuBf16Backend(TorchBackend):
    """Decodes in ``decode_attention``; prefills in ``prefill_attention`` (``prefill_kernel``)
    or SDPA."""

    name = "cpu-bf16"

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
        return torch.ops.nanoserve.decode_attention(
            q, kv, layer, rows.blocks, rows.cached, self.block_size
        )

    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """See ``AttentionBackend.prefill``; reads the span's K/V from the pool, where
        ``forward`` has just written them."""
        if not self.prefill_kernel:
            return super().prefill(q, kv, layer, span)
        return torch.ops.nanoserve.prefill_attention(
            q[span.begin : span.end], layer, span.blocks, span.start, self.block_size
        )
