"""The 4-bit kernels' weight layouts, made once at start from a GGUF's matrices
(``worker.model.gguf.Q4Tensor``, several stacked by rows as a fused linear stacks its float
weights): ``pack_q4`` for ``csrc/q4_linear.cpp`` (and ``gguf_linear.cpp``), ``pack_q4a8`` for
``csrc/q4a8_linear_f32.cpp``, ``pack_w4a8`` for ``csrc/w4a8_linear.cpp``.
"""

from __future__ import annotations

import torch

from worker.model.gguf import Q4Tensor


def float16_exact(parts: list[Q4Tensor]) -> bool:
    """Whether every group's scale and low (weight = scale * q + low) has an exact float16 form,
    as the kernels store them. A GGUF's Q4_0, Q4_1 and Q8_0 blocks store float16 d and m, so
    theirs do; where not, the plan keeps torch's int4 kernel (``worker.plan``)."""
    scale = torch.cat([part.scale for part in parts])
    low = torch.cat([part.zero for part in parts]) - 8 * scale
    return torch.equal(scale.half().float(), scale) and torch.equal(low.half().float(), low)


def pack_q4(parts: list[Q4Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``parts`` stacked by rows in ``csrc/q4_linear.cpp``'s layout: the nibbles (N / 16, K / 32,
    256) uint8, and each group's scale and low (weight = scale * q + low) as (N / 16, K / 32, 16)
    float16. ValueError where they are not ``float16_exact``."""
    if not float16_exact(parts):
        raise ValueError("a 4-bit matrix whose scales or lows have no exact float16 form")
    q = torch.cat([part.q for part in parts])  # (N, K) uint8 in [0, 16)
    scale = torch.cat([part.scale for part in parts])  # (N, K / 32) float32
    low = torch.cat([part.zero for part in parts]) - 8 * scale
    rows, cols = q.shape
    pad = -rows % 16  # zero rows: nothing, sliced off the output
    if pad:
        q = torch.cat((q, q.new_zeros(pad, cols)))
        scale, low = (torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in (scale, low))
    blocks, groups = q.shape[0] // 16, cols // 32
    # column k = 16 h + 2 c + t of row j -> byte (c, j, t) of its 256, nibble h
    nibbles = q.view(blocks, 16, groups, 2, 8, 2).permute(0, 2, 4, 1, 5, 3)  # (RB, G, c, j, t, h)
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(blocks, groups, 256)
    scale, low = (t.view(blocks, 16, groups).transpose(1, 2).half() for t in (scale, low))
    return packed.contiguous(), scale.contiguous(), low.contiguous()


def pack_q4a8(parts: list[Q4Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``parts`` stacked by rows in ``csrc/q4a8_linear_f32.cpp``'s layout: the nibbles (N / 16,
    K / 32, 256) uint8 in 8-row x 4-column chunks, and ``pack_q4``'s scales and lows."""
    _, scale, low = pack_q4(parts)
    q = torch.cat([part.q for part in parts])  # (N, K) uint8 in [0, 16)
    rows, cols = q.shape
    if -rows % 16:  # zero rows: nothing, sliced off the output
        q = torch.cat((q, q.new_zeros(-rows % 16, cols)))
    blocks, groups = q.shape[0] // 16, cols // 32
    # column 16 h + 4 k + t of row 8 r + i -> byte (r, k, i, t) of its 256, nibble h
    nibbles = q.view(blocks, 2, 8, groups, 2, 4, 4).permute(0, 3, 1, 5, 2, 6, 4)
    chunks = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(blocks, groups, 256)
    return chunks.contiguous(), scale, low


def pack_w4a8(parts: list[Q4Tensor]) -> torch.Tensor:
    """``parts``' 4-bit integers stacked by rows in ``csrc/w4a8_linear.cpp``'s layout: (N / 16,
    K / 32, 512) uint8, one integer a byte; the scales and lows are ``pack_q4``'s."""
    q = torch.cat([part.q for part in parts])  # (N, K) uint8 in [0, 16)
    rows, cols = q.shape
    pad = -rows % 16
    if pad:
        q = torch.cat((q, q.new_zeros(pad, cols)))
    blocks, groups = q.shape[0] // 16, cols // 32
    # column k = 4 c + t of row j -> byte (c, j, t) of its 512
    chunks = q.view(blocks, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)  # (RB, G, c, j, t)
    return chunks.reshape(blocks, groups, 512).contiguous()
