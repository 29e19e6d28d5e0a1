"""nanoserve's 4-bit x 8-bit kernel against oneDNN's bfloat16 matmul, on random matrices of the
default model's layer shapes, at the row counts of big steps.

    python scripts/bench_w4a8_linear.py          # rows 16, 32 and 128; medians of 200 calls

For each matrix: the time of each (the 8-bit quantizing of x included), and the multiply-adds
per second the 4-bit x 8-bit kernel reaches; then the 30 layers' sum. Needs AVX512-BF16 and
AVX512-VNNI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_q4_linear import (  # noqa: E402 - after the path setup above
    SHAPES,
    median_seconds,
    random_q4,
    whole_model,
)

from worker.cpu import kernels  # noqa: E402
from worker.linear.packing import pack_q4, pack_w4a8  # noqa: E402


def one(rows: int, cols: int, batch: int, gen: torch.Generator) -> tuple[float, float]:
    q4, weight = random_q4(rows, cols, gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), 32)
    _, scale, low = pack_q4([q4])
    integers = pack_w4a8([q4])
    x = torch.randn(batch, cols, generator=gen).bfloat16()

    def w4a8():
        return torch.ops.nanoserve.w4a8_linear(x, integers, scale, low)

    def onednn():
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    t_ours, t_onednn = median_seconds(w4a8), median_seconds(onednn)
    rate = batch * rows * cols / t_ours / 1e9
    print(
        f"{rows}x{cols}, {batch} rows: {t_ours * 1e3:.3f} ms ({rate:.0f} G multiply-adds/s) "
        f"against oneDNN bfloat16's {t_onednn * 1e3:.3f} ms ({t_onednn / t_ours:.2f}x)"
    )
    return t_ours, t_onednn


def main() -> int:
    if not (kernels.available() and kernels.uses_vnni()):
        print("bench_w4a8_linear: needs worker.cpu.kernels with AVX512-VNNI", file=sys.stderr)
        return 1
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    for batch in (16, 32, 128):
        # the layers only: the lm head stays bfloat16 in big steps
        ours, theirs = whole_model(one, batch, SHAPES[:-1], gen)
        print(f"30 layers, {batch} rows: {ours * 1e3:.2f} ms against oneDNN's {theirs * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
