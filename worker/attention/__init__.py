"""Paged attention over the ``KVCache``: one interface, one file per backend, chosen once.

- ``base``: ``AttentionBackend``, the operations a backend provides;
- ``metadata``: ``AttentionMetadata``, ``DecodeRows``, ``PrefillSpan`` and ``PrefillBatch``,
  built once per step;
- ``torch_backend``: ``TorchBackend``, plain torch (the reference, and the generic path on CPU
  and CUDA alike);
- ``cpu_kernel``: ``CpuKernelBackend``, what the two below share;
- ``cpu_bf16``: ``CpuBf16Backend``, bfloat16 in nanoserve's own CPU operators;
- ``cpu_f32``: ``CpuF32Backend``, float32 (over a float32 or float16 pool) in its AVX2 ones;
- ``triton_backend``: ``TritonBackend``, nanoserve's Triton kernels (``triton_kernels``), what
  CUDA runs: imported only by a plan that names it, since importing Triton is slow and its
  kernels are made interpreted or compiled when their module is imported (``TRITON_INTERPRET``).

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


def _triton(prefill_kernel: bool, **geometry) -> AttentionBackend:
    from worker.attention.triton_backend import TritonBackend

    return TritonBackend(prefill_kernel=prefill_kernel, **geometry)


# The plan's attention choices (``Plan.attention``) -> what builds them from the geometry and
# whether prefills take the backend's own kernel (``Plan.prefill``).
BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": lambda prefill_kernel, **geometry: TorchBackend(**geometry),
    "cpu-bf16": CpuBf16Backend,
    "cpu-f32": CpuF32Backend,
    "triton": _triton,
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
