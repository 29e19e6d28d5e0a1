"""nanoserve's 4-bit kernel against torch's, on random matrices of the default model's shapes.

    python scripts/bench_q4_linear.py            # rows 1, 4 and 8; medians of 200 calls

For each matrix: the error against the float64 product (relative to the largest output), the
time of each kernel, and the rate nanoserve's streams the 4-bit bytes at; then the whole model
(30 layers of qkv, o, gate_up and down, and the lm head's two 4-bit halves). Needs AVX512-BF16.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.cpu import kernels  # noqa: E402 - after the path setup above
from worker.linear.packing import pack_q4  # noqa: E402
from worker.model.gguf import Q4Tensor  # noqa: E402

SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 1152, 1)]


def median_seconds(call, reps: int = 200) -> float:
    for _ in range(10):
        call()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return sorted(times)[reps // 2]


def random_q4(rows: int, cols: int, gen: torch.Generator) -> tuple[Q4Tensor, torch.Tensor]:
    """A random Q4_1-like matrix (float16 scales and mins) and its (rows, cols) float64 value."""
    groups = cols // 32
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, groups, generator=gen) * 0.02).half().float()
    m = (-torch.rand(rows, groups, generator=gen) * 0.1).half().float()
    q4 = Q4Tensor(q, d, m + 8 * d)
    weight = (q.double() - 8) * q4.scale.double().repeat_interleave(32, 1)
    return q4, weight + q4.zero.double().repeat_interleave(32, 1)


def whole_model(one, batch: int, shapes: list, gen: torch.Generator) -> tuple[float, float]:
    """``one``'s two times summed over ``shapes`` (rows, cols, how many the model has)."""
    ours = theirs = 0.0
    for rows, cols, count in shapes:
        t_ours, t_theirs = one(rows, cols, batch, gen)
        ours, theirs = ours + count * t_ours, theirs + count * t_theirs
    return ours, theirs


def one(rows: int, cols: int, batch: int, gen: torch.Generator) -> tuple[float, float]:
    groups = cols // 32
    q4, weight = random_q4(rows, cols, gen)
    q = q4.q
    x = torch.randn(batch, cols, generator=gen).bfloat16()
    want = x.double() @ weight.T
    ours = pack_q4([q4])
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    scales_zeros = torch.stack((q4.scale.t(), q4.zero.t()), -1).bfloat16().contiguous()

    def nanoserve():
        return torch.ops.nanoserve.q4_linear(x, *ours)

    def torch_int4():
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, theirs, 32, scales_zeros)

    top = want.abs().max().item()
    error = [(f().double() - want).abs().max().item() / top for f in (nanoserve, torch_int4)]
    t_ours, t_torch = median_seconds(nanoserve), median_seconds(torch_int4)
    rate = (rows * cols / 2 + rows * groups * 4) / t_ours / 1e9
    print(
        f"{rows}x{cols}, {batch} rows: error {error[0]:.1e} (torch {error[1]:.1e}); "
        f"{t_ours * 1e3:.3f} ms ({rate:.1f} GB/s) against torch's {t_torch * 1e3:.3f} ms"
    )
    return t_ours, t_torch


def main() -> int:
    if not (kernels.available() and kernels.uses_bf16()):
        print("bench_q4_linear: needs worker.cpu.kernels built with AVX512-BF16", file=sys.stderr)
        return 1
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 4, 8):
        ours, theirs = whole_model(one, batch, SHAPES, gen)
        print(f"whole model, {batch} rows: {ours * 1e3:.2f} ms against torch's {theirs * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
