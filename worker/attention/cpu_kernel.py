"""``CpuKernelBackend``: decodes and prefills through nanoserve's own CPU operators.

``torch.ops.nanoserve.decode_attention`` (``worker/cpu/csrc/decode_attention.cpp``, built by
``worker.cpu.kernels``) reads each row's bfloat16 blocks in place, where the torch backend first
gathers them into a copy: a decode's attention costs one pass over its K/V. Eager and compiled
steps call the same operator.

``torch.ops.nanoserve.prefill_attention`` (``worker/cpu/csrc/prefill_attention.cpp``) takes each
prefill span, fresh or continuing a cached prefix, from its blocks in place: 4 to 5 times
faster than SDPA's flash kernel on these heads. Where it is not built (no AVX512-BF16), prefills
are the torch backend's.

A float32 model decodes in ``torch.ops.nanoserve.decode_attention_f32``
(``worker/cpu/csrc/decode_attention_f32.cpp``) over its float32 or float16 pool, and prefills in
``torch.ops.nanoserve.prefill_attention_f32`` (``worker/cpu/csrc/prefill_attention_f32.cpp``): both
need only AVX2. The prefill kernel scores only the positions a query may see, where SDPA's
computes the masked half too: 201 against 456 us a layer for a 128-token prompt on a 2-core Zen
3.
"""

from __future__ import annotations

import functools

import torch

from worker.attention.base import Scratch, gather_blocks
from worker.attention.metadata import DecodeRows, PrefillSpan
from worker.attention.torch_backend import TorchBackend
from worker.cpu import kernels


class CpuKernelBackend(TorchBackend):
    """Decodes in ``torch.ops.nanoserve.decode_attention`` (``decode_attention_f32`` for a
    float32 model), prefills in ``torch.ops.nanoserve.prefill_attention`` (or SDPA where it is
    not built; ``prefill_attention_f32`` for a float32 model)."""

    name = "cpu-kernel"

    @staticmethod
    def supports(
        dtype: torch.dtype, device: str, head_dim: int, n_heads: int, n_kv_heads: int
    ) -> bool:
        """Whether the operator serves a pool of this dtype on this device with these heads:
        bfloat16 (AVX-512) or float32 (AVX2) on CPU, where it builds (the first call may build
        it) and takes the heads."""
        if device != "cpu" or n_heads % n_kv_heads:
            return False
        group = n_heads // n_kv_heads
        ops = torch.ops.nanoserve
        if dtype == torch.float32:
            return kernels.loaded() and ops.decode_attention_f32_supports(head_dim, group)
        if dtype == torch.bfloat16:
            return kernels.available() and ops.decode_attention_supports(head_dim, group)
        return False

    def decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: torch.Tensor,
        rows: DecodeRows,
        scratch: Scratch | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.decode``; reads the cache in place, so needs no scratch."""
        if self.dtype == torch.float32:
            attend = torch.ops.nanoserve.decode_attention_f32
        else:
            attend = torch.ops.nanoserve.decode_attention
        return attend(q, kv, layer, rows.blocks, rows.cached, self.block_size)

    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """See ``AttentionBackend.prefill``; bfloat16 reads the span's K/V from the pool, where
        ``forward`` has just written them; float32 takes a fresh prompt's own k and v, and a
        continued one's gathered blocks (float16 widened as they are read)."""
        if self.dtype == torch.float32 and _prefill_kernel_f32(self.head_dim):
            if span.start == 0:
                keys, values = kv[span.begin : span.end].unbind(1)  # (n, n_kv, hd) each
            else:
                # (2, n_kv, M * bs, hd) in the pool's dtype -> (M * bs, n_kv, hd) views
                keys, values = gather_blocks(layer, span.blocks, self.block_size).transpose(1, 2)
            return torch.ops.nanoserve.prefill_attention_f32(
                q[span.begin : span.end], keys, values, span.start
            )
        if self.dtype != torch.bfloat16 or not _prefill_kernel(
            self.head_dim, self.n_heads // self.n_kv_heads
        ):
            return super().prefill(q, kv, layer, span)
        return torch.ops.nanoserve.prefill_attention(
            q[span.begin : span.end], layer, span.blocks, span.start, self.block_size
        )


@functools.cache
def _prefill_kernel_f32(head_dim: int) -> bool:
    """Whether the float32 prefill operator (AVX2) takes this head_dim."""
    return kernels.loaded() and torch.ops.nanoserve.prefill_attention_f32_supports(head_dim)


@functools.cache
def _prefill_kernel(head_dim: int, group: int) -> bool:
    """Whether the prefill operator is built here (AVX512-BF16) for these heads."""
    return kernels.uses_bf16() and torch.ops.nanoserve.prefill_attention_supports(head_dim, group)
