"""Linear methods on a GGUF file's own 4-bit matrices (``worker.model.gguf.Q4Tensor``), for the
steps that do little but stream the weights: 4 bits stream 4x fewer bytes than bfloat16.

- ``Q4Kernel``: bfloat16 rows times the 4-bit integers in nanoserve's kernel
  (``csrc/q4_linear.cpp``, AVX512-BF16), a few rows at a time;
- ``Gguf``: the same, with the bigger steps' method chosen in C++ by the rows at run time
  (``csrc/gguf_linear.cpp``): ``w4a8`` (the integers times activations quantized to 8 bits in
  groups of 32, llama.cpp's numerics, ``csrc/w4a8_linear.cpp``, AVX512-VNNI) or oneDNN's packed
  weight. A compiled graph then has no branch on its batch size;
- ``Q4A8``: float32 rows quantized to 8 bits times the integers (``csrc/q4a8_linear_f32.cpp``,
  AVX2): llama.cpp's Q4_1 x Q8_1 numerics;
- ``TorchInt4``: torch's int4 kernel, where nanoserve's are not built.

An 8-bit (Q8_0) matrix arrives as two 4-bit halves side by side (``halves`` 2): its input goes to
both. Each method's output rows are padded to a multiple of 16 (sliced off here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.linear.base import Linear, LinearMethod
from worker.linear.packing import pack_q4, pack_q4a8, pack_w4a8
from worker.model.gguf import Q4Tensor


def _halves(layer: Linear, q4: list[Q4Tensor]) -> int:
    return q4[0].q.shape[1] // layer.in_features


def _fed(x: torch.Tensor, halves: int) -> torch.Tensor:
    """x (T, in) as the kernels take it: contiguous, and repeated for each half."""
    return torch.cat([x] * halves, dim=1) if halves > 1 else x.contiguous()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _finished(layer: Linear, out: torch.Tensor) -> torch.Tensor:
    if out.shape[1] != layer.out_features:  # rows padded to a multiple of 16
        out = out[:, : layer.out_features].contiguous()
    return out if layer.bias is None else out.add_(layer.bias)


class _Packed(LinearMethod):
    """Every row on one of nanoserve's 4-bit operators (``op``), the matrices in the layout its
    packer makes (``pack``)."""

    op: str
    pack: Callable[[list[Q4Tensor]], tuple[torch.Tensor, ...]]

    def prepare(self, layer: Linear, q4: list[Q4Tensor] | None) -> None:
        layer.q4, layer.q4_halves = type(self).pack(q4), _halves(layer, q4)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = getattr(torch.ops.nanoserve, self.op)(_fed(x, layer.q4_halves), *layer.q4)
        return _finished(layer, out)

    def streamed(self, layer: Linear, rows: int) -> int:
        return _bytes(layer.q4)


class Q4Kernel(_Packed):
    """``torch.ops.nanoserve.q4_linear`` on ``pack_q4``'s layout (bfloat16 rows)."""

    name, op, pack = "q4", "q4_linear", pack_q4


class Gguf(LinearMethod):
    """``torch.ops.nanoserve.gguf_linear``: ``q4_linear`` up to ``max_rows`` rows, above them
    ``w4a8_linear`` (``big`` "w4a8") or oneDNN's packed weight ("onednn"). One half only."""

    name = "q4"

    def __init__(self, max_rows: int, big: str) -> None:
        if big not in ("w4a8", "onednn"):
            raise ValueError(f"gguf_linear's bigger steps run w4a8 or onednn, not {big}")
        self.max_rows, self.big = max_rows, big

    def prepare(self, layer: Linear, q4: list[Q4Tensor] | None) -> None:
        if _halves(layer, q4) != 1:
            raise ValueError("gguf_linear takes 4-bit matrices, not an 8-bit one's halves")
        layer.q4 = pack_q4(q4)
        layer.w4a8, layer.packed = None, None
        if self.big == "w4a8":
            layer.w4a8 = pack_w4a8(q4)
        else:
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 32)
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanoserve.gguf_linear(
            x, *layer.q4, layer.w4a8, layer.packed, layer.bias, self.max_rows, layer.out_features
        )

    def streamed(self, layer: Linear, rows: int) -> int:
        if rows <= self.max_rows:
            return _bytes(layer.q4)
        if layer.w4a8 is not None:  # one byte per integer, and q4's scales and lows
            return layer.w4a8.numel() + _bytes(layer.q4[1:])
        return layer.in_features * layer.out_features * layer.packed.element_size()


class Q4A8(_Packed):
    """``torch.ops.nanoserve.q4a8_linear_f32`` on ``pack_q4a8``'s layout (float32 rows)."""

    name, op, pack = "q4a8", "q4a8_linear_f32", pack_q4a8


class TorchInt4(LinearMethod):
    """``aten._weight_int4pack_mm_for_cpu``; rows go in rounded to bfloat16, the scales' dtype
    (torch's kernel is vectorized for bfloat16 rows only: 10-30x slower on float32 ones)."""

    name = "int4"

    def prepare(self, layer: Linear, q4: list[Q4Tensor] | None) -> None:
        # int32 only here, one matrix at a time: torch's packer wants it, and int32 copies of
        # every matrix at once would stay resident as freed heap.
        q = torch.cat([part.q for part in q4]).to(torch.int32)  # (N, K), or (N, 2K) halves
        scale = torch.cat([part.scale for part in q4]).t()  # (K / 32, N)
        zero = torch.cat([part.zero for part in q4]).t()
        scales_zeros = torch.stack((scale, zero), dim=-1).to(torch.bfloat16).contiguous()
        layer.int4 = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros)
        layer.q4_halves = _halves(layer, q4)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        packed, scales_zeros = layer.int4
        rows = _fed(x, layer.q4_halves).to(scales_zeros.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, 32, scales_zeros)
        return out.to(x.dtype) if layer.bias is None else out.to(x.dtype).add_(layer.bias)

    def streamed(self, layer: Linear, rows: int) -> int:
        return _bytes(layer.int4)


class RowSplit(LinearMethod):
    """Steps of at most ``max_rows`` rows run ``small`` (a 4-bit method), the others ``big``."""

    def __init__(self, small: LinearMethod, big: LinearMethod, max_rows: int) -> None:
        self.small, self.big, self.max_rows = small, big, max_rows
        self.name = f"{small.name}<={max_rows}|{big.name}"

    def prepare(self, layer: Linear, q4: list[Q4Tensor] | None) -> None:
        self.small.prepare(layer, q4)
        self.big.prepare(layer, q4)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return self.small.apply(layer, x)
        return self.big.apply(layer, x)

    def streamed(self, layer: Linear, rows: int) -> int:
        method = self.small if rows <= self.max_rows else self.big
        return method.streamed(layer, rows)
