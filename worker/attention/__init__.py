"""Paged attention over the ``KVCache``: one interface, one file per backend, chosen once.

- ``base``: ``AttentionBackend``, the operations a backend provides;
- ``metadata``: ``AttentionMetadata``, ``DecodeRows`` and ``PrefillSpan``, built once per step;
- ``torch_backend``: ``TorchBackend``, plain torch (what CUDA runs, and the generic path);
- ``cpu_kernel``: ``CpuKernelBackend``, CPU decodes in nanoserve's own operators.

The worker calls ``select_backend`` once, at start; nothing else asks which backend it has.
"""

from __future__ import annotations

import logging

import torch

from worker.attention.base import AttentionBackend
from worker.attention.cpu_kernel import CpuKernelBackend
from worker.attention.metadata import AttentionMetadata, DecodeRows, PrefillSpan
from worker.attention.torch_backend import TorchBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuKernelBackend",
    "DecodeRows",
    "PrefillSpan",
    "TorchBackend",
    "select_backend",
]

log = logging.getLogger(__name__)


def select_backend(
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    kv_dtype: torch.dtype | None = None,
    generic: bool = False,
) -> AttentionBackend:
    """The backend for this model's heads, computing in ``dtype`` over a pool of ``kv_dtype``
    (default: ``dtype``) on ``device``: nanoserve's CPU kernel where it serves them, else torch;
    always torch when ``generic``. May build the kernel (``worker.cpu.kernels``)."""
    kv_dtype = kv_dtype or dtype
    geometry = dict(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        device=device,
    )
    own = not generic and CpuKernelBackend.supports(dtype, device, head_dim, n_heads, n_kv_heads)
    if kv_dtype != dtype and not (own and dtype == torch.float32 and kv_dtype == torch.float16):
        raise ValueError(f"no attention backend computes in {dtype} over a {kv_dtype} pool")
    backend = CpuKernelBackend(**geometry) if own else TorchBackend(**geometry)
    log.info("attention: the %s backend, for a %s pool on %s", backend.name, kv_dtype, device)
    return backend
