"""The plan's attention choices (``worker.plan.resolve``): the backend, how its prefills attend,
and the K/V pool's dtype, from the device, the dtype, the heads and what this machine runs.

Part of the plan, so it may ask the machine: whether Triton runs here (``triton_runs``), and
which of nanoserve's CPU kernels are built and take these heads.
"""

from __future__ import annotations

import torch

from worker.config import WorkerConfig
from worker.cpu import kernels


def triton_runs(device: str) -> bool:
    """Whether Triton's kernels run on ``device``: triton imports, and it is a GPU, or Triton
    interprets them on CPU tensors (``TRITON_INTERPRET=1``, as the tests run them)."""
    try:
        import triton
    except ImportError:
        return False
    return device == "cuda" or triton.knobs.runtime.interpret


def attention_choice(
    own: bool, own_f32: bool, gpu: bool, dtype: str, head_dim: int, n_heads: int, n_kv: int
) -> tuple[str, str]:
    """(backend, prefill): on a GPU off the generic path (``gpu``), nanoserve's Triton kernels
    where triton imports; on CPU, its C++ kernels where they are built (``own``: the AVX-512
    ones, ``own_f32``: the AVX2 ones) and take these heads; else plain torch."""
    if n_heads % n_kv:
        return "torch", "sdpa"
    if gpu:
        return ("triton", "kernel") if triton_runs("cuda") else ("torch", "sdpa")
    group, ops = n_heads // n_kv, torch.ops.nanoserve
    if dtype == "float32" and own_f32 and ops.decode_attention_f32_supports(head_dim, group):
        fits = ops.prefill_attention_f32_supports(head_dim)
        return "cpu-f32", "kernel" if fits else "sdpa"
    if dtype == "bfloat16" and own and ops.decode_attention_supports(head_dim, group):
        fits = kernels.uses_bf16() and ops.prefill_attention_supports(head_dim, group)
        return "cpu-bf16", "kernel" if fits else "sdpa"
    return "torch", "sdpa"


def kv_dtype_choice(config: WorkerConfig, dtype: str, attention: str) -> str:
    """The pool's dtype: the model's, or float16 under a float32 model whose attention is the
    AVX2 kernel (it widens float16 as it reads; the default under ``auto``'s float32)."""
    wanted = config.kv_cache_dtype
    half_ok = attention == "cpu-f32"
    if wanted == "auto":
        return "float16" if half_ok and config.dtype == "auto" else dtype
    if wanted != dtype and not (wanted == "float16" and half_ok):
        raise ValueError(
            f"kv_cache_dtype {wanted} needs a {wanted} model, or float16 a float32 one on a "
            f"CPU with AVX2 and F16C (this worker: {dtype}, attention {attention})"
        )
    return wanted
