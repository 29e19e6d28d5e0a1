"""``Linear``: ``nn.Linear`` with the CPU's faster weight layouts.

On CPU the worker may trade a weight for oneDNN's pre-packed layout (``pack``), and keep a GGUF
file's own 4-bit integers beside it for small steps (``attach_q4``): multiplied by nanoserve's
own kernel where the CPU has AVX512-BF16 (``pack_q4``), else by torch's int4 kernel. Where the
CPU also has AVX512-VNNI, big steps multiply the same integers by 8-bit activations
(``pack_w4a8``, llama.cpp's numerics) instead of oneDNN's bfloat16 matrices, which it then
drops. A float32 model (``auto`` on a CPU without native bfloat16) multiplies them by 8-bit
activations in nanoserve's AVX2 kernel (``q4a8``), at every step by default. The generic path
(and CUDA) keeps the plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.cpu import kernels
from worker.model.gguf import Q4Tensor

# torch.ops.nanoserve.q4_linear's most rows (csrc/q4_linear.cpp's kMaxRows).
Q4_KERNEL_MAX_ROWS = 8
# A q4a8 linear's step limit when every step runs on its 4-bit integers (``attach_q4``).
Q4A8_ALL_ROWS = 1 << 62


class Linear(nn.Linear):
    """``nn.Linear`` that can trade its weight for oneDNN's pre-packed layout (``pack``), which
    oneDNN multiplies faster than ``F.linear`` does at decode batch sizes.

    It can also keep a 4-bit GGUF weight's own integers (``attach_q4``) for small steps.
    """

    packed: torch.Tensor | None = None
    # torch's int4-packed weight and its scales and zeros, or ``pack_q4``'s nibbles, scales and
    # lows (``q4_kernel``)
    q4: tuple[torch.Tensor, ...] | None = None
    q4_max_tokens: int = 0
    q4_halves: int = 1  # 2 for an 8-bit weight held as two 4-bit halves: the input goes to both
    q4_kernel: bool = False  # q4 is ``pack_q4``'s form, for torch.ops.nanoserve.q4_linear
    # q4 is ``pack_q4a8``'s form, for torch.ops.nanoserve.q4a8_linear_f32 (float32 rows)
    q4a8: bool = False
    # ``pack_w4a8``'s integers: steps of more than q4_max_tokens rows (torch.ops.nanoserve.
    # w4a8_linear, with q4's scales and lows)
    w4a8: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """A layer around existing tensors (no initialization of fresh ones)."""
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight = _frozen(weight)
        layer.bias = None if bias is None else _frozen(bias)
        return layer

    def pack(self) -> bool:
        """Keep only the packed weight, where oneDNN packs this dtype on this CPU
        (``onednn_packs``); returns whether it did. The batch size hint (32) barely matters."""
        if not onednn_packs(self.weight.dtype):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 32)
        self.weight = None
        return True

    def attach_q4(self, parts: list[Q4Tensor], max_tokens: int, w4a8: bool = False) -> None:
        """Also keep this weight's 4-bit form (``parts`` stacked by rows, as ``fuse`` stacked
        the float weights); steps of at most ``max_tokens`` tokens run on it. A small step
        does little but stream the weights, and 4 bits stream 4x fewer bytes than bfloat16
        (the kernels compute in bfloat16; a float32 model's rows are rounded to it, and only
        where ``auto`` chose float32: ``Worker._load_model``).

        With ``w4a8`` (and a CPU with AVX512-VNNI), bigger steps run on the same integers
        times their input quantized to 8 bits, and the bfloat16 matrix goes: a big step is
        bound by multiplies, and vpdpbusd does twice vdpbf16ps's.

        A float32 model's linears take nanoserve's AVX2 kernel instead, wherever it
        is built: rows quantized to 8 bits times the 4-bit integers, llama.cpp's numerics (only
        where ``auto`` chose float32: ``Worker._load_model``). With ``w4a8`` every step runs
        on it, and the float32 matrix goes: on a 2-core Zen 3 it is 1.3-1.9 times oneDNN's
        float32 matmul at 32 and 128 rows, and 4-5 times torch's int4 kernel at one row
        (docs/performance.md)."""
        self.q4_max_tokens = max_tokens
        self.q4_halves = parts[0].q.shape[1] // self.in_features
        dtype = (self.weight if self.packed is None else self.packed).dtype
        if dtype == torch.float32 and kernels.loaded():
            packed = pack_q4a8(parts)
            if packed is not None:
                self.q4, self.q4a8 = packed, True
                if w4a8:
                    self.q4_max_tokens = Q4A8_ALL_ROWS
                    self.packed = self.weight = None
                return
        if max_tokens <= Q4_KERNEL_MAX_ROWS and kernels.available() and kernels.uses_bf16():
            self.q4 = pack_q4(parts)
            if self.q4 is not None:
                self.q4_kernel = True
                if w4a8 and self.q4_halves == 1 and kernels.uses_vnni():
                    self.w4a8 = pack_w4a8(parts)
                    self.packed = None
                return
        # int32 only here, one matrix at a time: torch's packer wants it, and int32 copies of
        # every matrix at once would stay resident as freed heap.
        q = torch.cat([part.q for part in parts]).to(torch.int32)  # (N, K), or (N, 2K) halves
        scale = torch.cat([part.scale for part in parts]).t()  # (K / 32, N)
        zero = torch.cat([part.zero for part in parts]).t()
        scales_zeros = torch.stack((scale, zero), dim=-1).to(torch.bfloat16).contiguous()
        self.q4 = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = self.w4a8 is not None or self.packed is not None  # what runs above the limit
        if self.q4 is not None and self.q4_kernel and self.q4_halves == 1 and big:
            # The same choice as below, made in C++ at run time: a compiled graph then has no
            # branch on its batch size (csrc/gguf_linear.cpp).
            return torch.ops.nanoserve.gguf_linear(
                x, *self.q4, self.w4a8, self.packed, self.bias, self.q4_max_tokens,
                self.out_features,
            )  # fmt: skip
        if self.q4 is not None and x.shape[0] <= self.q4_max_tokens:
            x = torch.cat([x] * self.q4_halves, dim=1) if self.q4_halves > 1 else x.contiguous()
            if self.q4a8:
                out = torch.ops.nanoserve.q4a8_linear_f32(x, *self.q4)
                if out.shape[1] != self.out_features:  # rows padded to a multiple of 16
                    out = out[:, : self.out_features].contiguous()
            elif self.q4_kernel:
                out = torch.ops.nanoserve.q4_linear(x, *self.q4)
                if out.shape[1] != self.out_features:  # rows padded to a multiple of 16
                    out = out[:, : self.out_features].contiguous()
            else:
                packed, scales_zeros = self.q4
                # A float32 model's rows go in rounded to bfloat16, the scales' dtype: torch's
                # kernel is vectorized for bfloat16 rows only (10-30x slower on float32 ones).
                rows = x.to(scales_zeros.dtype)
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, 32, scales_zeros)
                out = out.to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a ``dtype`` weight on this CPU: float32 wherever torch has oneDNN;
    bfloat16 only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, and on a plain AVX2 CPU the
    reorder raises rather than fall back."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_q4(parts: list[Q4Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``parts`` stacked by rows in ``csrc/q4_linear.cpp``'s layout: the nibbles (N / 16, K / 32,
    256) uint8, and each group's scale and low (weight = scale * q + low) as (N / 16, K / 32, 16)
    float16. None where a scale or low has no exact float16 form (the caller keeps torch's
    kernel); a GGUF's Q4_0, Q4_1 and Q8_0 blocks store float16 d and m, so theirs do."""
    q = torch.cat([part.q for part in parts])  # (N, K) uint8 in [0, 16)
    scale = torch.cat([part.scale for part in parts])  # (N, K / 32) float32
    low = torch.cat([part.zero for part in parts]) - 8 * scale
    if not (torch.equal(scale.half().float(), scale) and torch.equal(low.half().float(), low)):
        return None
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


def pack_q4a8(parts: list[Q4Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``parts`` stacked by rows in ``csrc/q4a8_linear_f32.cpp``'s layout: the nibbles (N / 16,
    K / 32, 256) uint8 in 8-row x 4-column chunks, and ``pack_q4``'s scales and lows. None
    where ``pack_q4`` gives None."""
    packed = pack_q4(parts)
    if packed is None:
        return None
    _, scale, low = packed
    q = torch.cat([part.q for part in parts])  # (N, K) uint8 in [0, 16)
    rows, cols = q.shape
    if -rows % 16:  # zero rows: nothing, sliced off the output
        q = torch.cat((q, q.new_zeros(-rows % 16, cols)))
    blocks, groups = q.shape[0] // 16, cols // 32
    # column 16 h + 4 k + t of row 8 r + i -> byte (r, k, i, t) of its 256, nibble h
    nibbles = q.view(blocks, 2, 8, groups, 2, 4, 4).permute(0, 3, 1, 5, 2, 6, 4)
    chunks = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(blocks, groups, 256)
    return chunks.contiguous(), scale, low


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


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
