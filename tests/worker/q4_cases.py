"""Random GGUF-like 4-bit matrices and llama.cpp's 4-bit x 8-bit dot as a float64 reference,
shared by the 4-bit kernels' tests (``test_kernels.py``, ``test_q4a8.py``)."""

from __future__ import annotations

import torch

from worker.model.gguf import Q4Tensor


def q4_case(rows: int, cols: int, seed: int, has_min: bool = True):
    """A random 4-bit matrix as ``read_q4_tensors`` gives one: float16 d (and m) per group."""
    gen = torch.Generator().manual_seed(seed)
    groups = cols // 32
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, groups, generator=gen) * 0.09 + 0.01).half().float()
    m = (-torch.rand(rows, groups, generator=gen) * 0.5).half().float() if has_min else -8 * d
    return Q4Tensor(q, d, m + 8 * d)  # weight = (q - 8) * scale + zero


def dequantized64(q4: Q4Tensor) -> torch.Tensor:
    return (q4.q.double() - 8) * q4.scale.double().repeat_interleave(
        32, 1
    ) + q4.zero.double().repeat_interleave(32, 1)


def w4a8_reference(x: torch.Tensor, q4: Q4Tensor) -> torch.Tensor:
    """llama.cpp's Q4_1 x Q8_1 dot (ggml_vec_dot_q4_1_q8_1 after quantize_row_q8_1), summed in
    float64: x (M, K) bfloat16 or float32 -> (M, N)."""
    rows, cols = x.shape
    xs = x.float().view(rows, cols // 32, 32)
    amax = xs.abs().amax(-1, keepdim=True)  # (M, G, 1)
    # 127 / amax as C divides: torch's scalar / tensor multiplies by a rounded reciprocal.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    a = torch.round(xs * inverse)  # float32 product, rounded half to even
    d = amax / 127
    s = d * a.sum(-1, keepdim=True)
    d, s = d.half().double().squeeze(-1), s.half().double().squeeze(-1)  # block_q8_1's ds
    scale, low = q4.scale.double(), (q4.zero - 8 * q4.scale).double()  # w = scale * q + low
    sums = torch.einsum("mgk,ngk->mng", a.double(), q4.q.double().view(-1, cols // 32, 32))
    return (sums * d[:, None] * scale).sum(-1) + (s[:, None] * low).sum(-1)
