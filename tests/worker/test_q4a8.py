"""``torch.ops.nanoserve.q4a8_linear_f32`` (``worker/cpu/csrc/q4a8_linear_f32.cpp``): float32 rows,
quantized to 8 bits in groups of 32, times ``pack_q4a8``'s 4-bit matrix, in AVX2.

It is llama.cpp's Q4_1 x Q8_1 dot to float32's rounding, at every row count its tiles split
into, reads each nibble as its own column, and refuses malformed input."""

from __future__ import annotations

import pytest
import torch

from tests.worker.kernel_checks import require_kernels
from tests.worker.q4_cases import dequantized64, q4_case, w4a8_reference
from worker.linear.packing import pack_q4a8
from worker.model.gguf import Q4Tensor


@pytest.fixture(autouse=True)
def built(private_cache):
    """Build (or load) the kernels in the tests' private cache, or skip where they cannot be."""
    require_kernels("avx2")


def linear(x, packed):
    return torch.ops.nanoserve.q4a8_linear_f32(x, *packed)


@pytest.mark.parametrize(
    "rows, cols, batch, has_min",
    [(16, 32, 1, True), (48, 64, 9, False), (960, 576, 32, True), (100, 96, 13, True),
     (3072, 576, 6, True), (576, 1536, 130, False), (49152, 576, 1, False)],
)  # fmt: skip
def test_it_is_llamacpps_q4_1_q8_1_dot_to_float32_rounding(rows, cols, batch, has_min):
    q4 = q4_case(rows, cols, seed=rows + cols, has_min=has_min)
    packed = pack_q4a8([q4])
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch)) * 3
    if batch > 1:
        x[1, :32] = 0  # a group of zeros quantizes to zeros, not NaNs
    want = w4a8_reference(x, q4)
    got = linear(x, packed)
    assert got.dtype == torch.float32 and got.shape == (batch, -(-rows // 16) * 16)
    got = got[:, :rows].double()
    # float32 sums of a few dozen groups
    bound = 1e-5 * want.abs() + 1e-5 * want.abs().max()
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    # and not the unquantized product: the 8-bit activations are what it multiplies
    exact = x.double() @ dequantized64(q4).T
    assert not ((got - exact).abs() <= 1e-5 * exact.abs()).all()
    # within what 8-bit activations allow: 0.4% of a group's largest |x| per column, at most
    assert ((got - exact).abs() <= 0.01 * exact.abs().max()).all()


def test_it_reads_each_nibble_as_its_own_column():
    """One 1 at each (row, column) in turn, over a few rows of x: exactly that column of x."""
    rows, cols = 16, 64
    x = torch.arange(1, 4 * cols + 1, dtype=torch.float32).view(4, cols) % 97 - 48
    x[:, :: cols // 2] = 127  # each group's largest |x| is 127: its 8-bit values are x itself
    for row in (0, 7, 8, 15):
        for col in range(cols):
            q = torch.zeros(rows, cols, dtype=torch.uint8)
            q[row, col] = 1
            scale = torch.ones(rows, cols // 32)
            got = linear(x, pack_q4a8([Q4Tensor(q, scale, 8 * scale)]))  # weight = q
            want = torch.zeros(4, rows)
            want[:, row] = x[:, col]
            assert torch.equal(got, want), (row, col)


def test_it_refuses_what_it_cannot_compute():
    packed = pack_q4a8([q4_case(32, 64, seed=1)])
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        linear(x.bfloat16(), packed)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        linear(torch.randn(64, 2).t(), packed)
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        linear(torch.randn(2, 96), packed)
    nibbles, scale, low = packed
    with pytest.raises(RuntimeError, match="scale and low must be"):
        linear(x, (nibbles, scale.float(), low))
    with pytest.raises(RuntimeError, match="packed must be"):
        linear(x, (nibbles[..., :128], scale, low))
    assert linear(x[:0], packed).shape == (0, 32)
