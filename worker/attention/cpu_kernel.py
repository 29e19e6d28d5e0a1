"""``CpuKernelBackend``: what nanoserve's CPU attention backends share (``cpu_bf16``,
``cpu_f32``): decodes in one of nanoserve's operators, which read each row's blocks in place
where the torch backend gathers them into a copy, and prefills in another where the plan says
it is built (``Plan.prefill``), else SDPA."""

from __future__ import annotations

from abc import abstractmethod

import torch

from worker.attention.base import Scratch
from worker.attention.metadata import DecodeRows, PrefillSpan
from worker.attention.torch_backend import TorchBackend


class CpuKernelBackend(TorchBackend):
    """A subclass names its decode operator (``decode_op``) and prefills a span in its own
    kernel (``kernel_prefill``)."""

    decode_op: str  # the torch.ops.nanoserve operator of this backend's decodes
    # A request's token and up to 16 drafts (``scheduler.speculation``'s most) in one group.
    group_rows = 17

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
        attend = getattr(torch.ops.nanoserve, self.decode_op)
        return attend(q, kv, layer, rows.blocks, rows.cached, self.block_size, rows.first)

    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """See ``AttentionBackend.prefill``: the kernel's, or SDPA's where it is not built."""
        if not self.prefill_kernel:
            return super().prefill(q, kv, layer, span)
        return self.kernel_prefill(q, kv, layer, span)

    @abstractmethod
    def kernel_prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """One span's attention in this backend's own prefill operator."""
