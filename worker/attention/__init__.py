"""Paged attention over the ``KVCache``: one interface, one file per backend, chosen once.

- ``base``: ``AttentionBackend``, the operations a backend provides;
- ``metadata``: ``AttentionMetadata``, ``DecodeRows`` and ``PrefillSpan``, built once per step;
- ``torch_backend``: ``TorchBackend``, plain torch (what CUDA runs, and the generic path);
- ``cpu_kernel``: ``CpuKernelBackend``, what the two below share;
- ``cpu_bf16``: ``CpuBf16Backend``, bfloat16 in nanoserve's own CPU operators;
- ``cpu_f32``: ``CpuF32Backend``, float32 (over a float32 or float16 pool) in its AVX2 ones.

The worker calls ``make_backend`` once, at start, with its plan's choice (``worker.plan``);
nothing else asks which backend it has.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.attention.base import AttentionBackend
from worker.attention.cpu_bf16 import CpuBf16Backend
from worker.attention.cpu_f32 import CpuF32Backend
from worker.attention.metadata import AttentionMetadata, DecodeRows, PrefillSpan
from worker.attention.torch_backend import TorchBackend

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuBf16Backend",
    "CpuF32Backend",
    "DecodeRows",
    "PrefillSpan",
    "TorchBackend",
    "make_backend",
]

# The plan's attention choices (``Plan.attention``) -> what builds them from the geometry and
# whether prefills take the backend's own kernel (``Plan.prefill``).
BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": lambda prefill_kernel, **geometry: TorchBackend(**geometry),
    "cpu-bf16": CpuBf16Backend,
    "cpu-f32": CpuF32Backend,
}


def make_backend(
    plan,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> AttentionBackend:
    """The backend a ``worker.plan.Plan`` names, for this shard's heads and the pool's blocks."""
    geometry = dict(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=getattr(torch, plan.dtype),
        kv_dtype=getattr(torch, plan.kv_dtype),
        device=plan.device,
    )
    return BACKENDS[plan.attention](prefill_kernel=plan.prefill == "kernel", **geometry)
