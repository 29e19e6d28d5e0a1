"""nanoserve's own CPU kernels (``worker/cpu/csrc``).

Decode attention over a paged bfloat16 cache equals float64 softmax attention to bfloat16's
rounding, reads the right blocks, takes the new token from ``kv``, refuses what it cannot do,
and is what bfloat16 steps use. argmax gives torch.argmax's answers, ties and NaNs included,
and is what the worker's sampler uses. q4_linear equals the float64 product of its 4-bit matrix
and reads each nibble as its own column. rms_norm and silu_mul give torch's eager results (the
norm within one bfloat16 step, rarely) and are what eager bfloat16 steps use."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.worker.attention_cases import BLOCK, HEADS, case, grouped, reference
from tests.worker.conftest import make_worker
from tests.worker.kernel_checks import require_kernels
from tests.worker.q4_cases import dequantized64, q4_case, w4a8_reference
from worker.cpu import kernels
from worker.linear.packing import float16_exact, pack_q4, pack_w4a8
from worker.model.gguf import Q4Tensor
from worker.model.rope import apply_rotary, inverse_frequencies, rotary_cos_sin


@pytest.fixture(autouse=True)
def built(private_cache):
    """Build (or load) the kernel in the tests' private cache, or skip where it cannot be."""
    require_kernels("avx512")


@pytest.mark.parametrize(**HEADS)
def test_decode_attention_equals_float64_attention_to_bfloat16_rounding(n_kv, nq, hd):
    lengths = [0, 1, 15, 16, 17, 100, 255]  # empty, within, at and across block edges
    q, kv, layer, blocks, cached = case(n_kv, nq, hd, lengths, seed=nq + hd)
    assert not q.is_contiguous()
    got = torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, BLOCK)
    want = reference(q, kv, layer, blocks, cached)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # float32 arithmetic, then one rounding to bfloat16 (8 significant bits).
    error = (got.double() - want).abs()
    assert (error <= want.abs() * 2**-8 + 1e-4).all(), error.max().item()


@pytest.mark.parametrize(**HEADS)
def test_decode_attention_groups_attend_causally_within_themselves(n_kv, nq, hd):
    """A request's token and its drafts (rows sharing a table and a cached context): each row
    sees the cached positions, then its group's new tokens up to its own, none after."""
    lengths = [17, 17, 17, 40, 100, 100, 100, 100, 100, 0, 0]
    q, kv, layer, blocks, cached = case(n_kv, nq, hd, lengths, seed=nq + hd + 7)
    blocks, cached, first = grouped(q, kv, layer, blocks, cached, [3, 1, 5, 2])
    got = torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, BLOCK, first)
    want = reference(q, kv, layer, blocks, cached, first)
    error = (got.double() - want).abs()
    assert (error <= want.abs() * 2**-8 + 1e-4).all(), error.max().item()
    alone = torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, BLOCK)
    assert torch.equal(alone[[0, 3]], got[[0, 3]])  # a group's first row sees no other row
    assert not torch.equal(alone[1], got[1])
    rows = torch.arange(len(lengths))
    assert torch.equal(torch.ops.nanoserve.decode_attention(
        q, kv, layer, blocks, cached, BLOCK, rows), alone)  # fmt: skip
    with pytest.raises(RuntimeError, match="row 2's group begins at row 3"):
        bad = first.clone()
        bad[2] = 3
        torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, BLOCK, bad)


def test_a_sharp_softmax_and_a_nan_behave_as_torchs():
    q, kv, layer, blocks, cached = case(3, 9, 64, [40, 200], seed=5)
    sharp = (q.float() * 30).bfloat16()  # scores of hundreds: weights underflow to 0
    got = torch.ops.nanoserve.decode_attention(sharp, kv, layer, blocks, cached, BLOCK)
    want = reference(sharp, kv, layer, blocks, cached)
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()
    layer = layer.clone()
    layer[0, 1, int(blocks[1, 3]) * BLOCK + 2] = float("nan")  # row 1's position 50, KV head 1
    got = torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, BLOCK)
    assert got[1, 3:6].isnan().all() and not got[1, :3].isnan().any() and not got[0].isnan().any()


def test_a_row_with_nothing_cached_returns_its_own_value_exactly():
    q, kv, layer, blocks, cached = case(3, 9, 64, [0, 40], seed=1)
    got = torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, BLOCK)
    own = kv[0, 1].repeat_interleave(3, dim=0)  # (nq, hd): each KV head's group
    assert torch.equal(got[0], own)
    assert not torch.equal(got[1], kv[1, 1].repeat_interleave(3, dim=0))


def test_it_reads_the_rows_blocks_and_nothing_past_the_cached_positions():
    q, kv, layer, blocks, cached = case(3, 9, 64, [20, 33], seed=2)
    before = torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, BLOCK)
    poisoned = layer.clone()
    # Row 0's slots from position 20 on, and every block no row has, become NaN.
    poisoned[:, :, int(blocks[0, 1]) * BLOCK + 4 : int(blocks[0, 1] + 1) * BLOCK] = float("nan")
    used = {int(b) for b in blocks[0, :2]} | {int(b) for b in blocks[1, :3]}
    for block in set(range(48)) - used:
        poisoned[:, :, block * BLOCK : (block + 1) * BLOCK] = float("nan")
    assert torch.equal(
        torch.ops.nanoserve.decode_attention(q, kv, poisoned, blocks, cached, BLOCK), before
    )
    # One changed key of row 1's first block changes row 1 only.
    poisoned[0, :, int(blocks[1, 0]) * BLOCK] += 1
    after = torch.ops.nanoserve.decode_attention(q, kv, poisoned, blocks, cached, BLOCK)
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])


def test_it_refuses_what_it_cannot_compute():
    q, kv, layer, blocks, cached = case(3, 9, 64, [5], seed=3)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        torch.ops.nanoserve.decode_attention(q.float(), kv, layer, blocks, cached, BLOCK)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        torch.ops.nanoserve.decode_attention(q, kv, layer, blocks.int(), cached, BLOCK)
    assert not torch.ops.nanoserve.decode_attention_supports(48, 3)
    assert not torch.ops.nanoserve.decode_attention_supports(64, 9)
    q48, kv48, layer48, blocks48, cached48 = case(1, 2, 48, [5], seed=4)
    with pytest.raises(RuntimeError, match="needs head_dim 16, 32, 64 or 128"):
        torch.ops.nanoserve.decode_attention(q48, kv48, layer48, blocks48, cached48, BLOCK)
    # Indices that would read outside the tensors are refused, not followed.
    width = blocks.shape[1]
    for bad_cached, match in (([-1], "has -1 cached"), ([width * BLOCK + 1], "its table holds")):
        with pytest.raises(RuntimeError, match=match):
            attend = torch.ops.nanoserve.decode_attention
            attend(q, kv, layer, blocks, torch.tensor(bad_cached), BLOCK)
    for bad_block in (-1, 48):
        wrong = blocks.clone()
        wrong[0, 0] = bad_block
        with pytest.raises(RuntimeError, match=f"names block {bad_block} of a pool of 48"):
            torch.ops.nanoserve.decode_attention(q, kv, layer, wrong, cached, BLOCK)
    with pytest.raises(RuntimeError, match="block_size must divide"):
        torch.ops.nanoserve.decode_attention(q, kv, layer, blocks, cached, 0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.nanoserve.decode_attention(q, kv[:, :, :0], layer[:, :0], blocks, cached, BLOCK)


def _prefill_case(n_kv: int, nq: int, hd: int, start: int, n: int, seed: int):
    """A span of n queries from position ``start`` over scattered blocks of a 48-block pool,
    q a strided view as the model passes it."""
    gen = torch.Generator().manual_seed(seed)
    layer = torch.randn(2, n_kv, 48 * BLOCK, hd, generator=gen).bfloat16()
    blocks = torch.randperm(48, generator=gen)[: -(-(start + n) // BLOCK)]
    qkv = torch.randn(n, nq + 2 * n_kv, hd, generator=gen).bfloat16()
    return qkv[:, :nq], layer, blocks


def _prefill_reference(q, layer, blocks, start):
    """float64 causal softmax attention: query i over positions [0, start + i]."""
    n, nq, hd = q.shape
    n_kv = layer.shape[1]
    group = nq // n_kv
    slots = [int(blocks[t // BLOCK]) * BLOCK + t % BLOCK for t in range(start + n)]
    out = torch.empty(n, nq, hd, dtype=torch.float64)
    for h in range(n_kv):
        keys, values = layer[0, h, slots].double(), layer[1, h, slots].double()  # (L, hd)
        queries = q[:, h * group : (h + 1) * group].double()  # (n, group, hd)
        scores = torch.einsum("ngd,ld->ngl", queries, keys) / hd**0.5
        seen = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]  # (n, L)
        scores = scores.masked_fill(~seen[:, None], float("-inf"))
        out[:, h * group : (h + 1) * group] = torch.softmax(scores, -1) @ values
    return out


@pytest.mark.kernels("bf16")  # else prefills take SDPA
@pytest.mark.parametrize(
    "n_kv, nq, hd",
    [(3, 9, 64), (2, 14, 128), (1, 8, 32), (4, 4, 64), (2, 16, 64)],
    ids=["smollm2", "qwen2", "mqa", "mha", "group8"],
)
@pytest.mark.parametrize(
    "start, n", [(0, 1), (0, 16), (0, 37), (15, 2), (16, 16), (100, 33), (5, 200), (700, 20)]
)
def test_prefill_attention_equals_float64_causal_attention(n_kv, nq, hd, start, n):
    """Fresh spans and spans after a cached prefix, within, at and across block and 16-position
    tile edges, odd and even lengths (the work is split in pairs of queries), and a long cached
    prefix (45 tiles of scores held per query between the kernel's two passes)."""
    q, layer, blocks = _prefill_case(n_kv, nq, hd, start, n, seed=start + n + hd)
    assert q.stride(0) == (nq + 2 * n_kv) * hd  # a view of the qkv output
    got = torch.ops.nanoserve.prefill_attention(q, layer, blocks, start, BLOCK)
    want = _prefill_reference(q, layer, blocks, start)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    error = (got.double() - want).abs()
    assert (error <= want.abs() * 2**-8 + 1e-4).all(), error.max().item()


@pytest.mark.kernels("bf16")
def test_prefill_attention_reads_only_the_positions_each_query_may_see():
    q, layer, blocks = _prefill_case(3, 9, 64, 20, 10, seed=7)
    before = torch.ops.nanoserve.prefill_attention(q, layer, blocks, 20, BLOCK)
    poisoned = layer.clone()
    for block in set(range(48)) - {int(b) for b in blocks}:  # no block of the span's
        poisoned[:, :, block * BLOCK : (block + 1) * BLOCK] = float("nan")
    # Past the span's end (positions 30 and 31, in its last block): read by no query.
    poisoned[:, :, int(blocks[1]) * BLOCK + 14 : int(blocks[1] + 1) * BLOCK] = float("nan")
    assert torch.equal(
        torch.ops.nanoserve.prefill_attention(q, poisoned, blocks, 20, BLOCK), before
    )
    # Position 25's key: queries at 20..24 do not see it, those at 25..29 do.
    poisoned[0, :, int(blocks[1]) * BLOCK + 9] += 1
    after = torch.ops.nanoserve.prefill_attention(q, poisoned, blocks, 20, BLOCK)
    assert torch.equal(after[:5], before[:5])
    assert all(not torch.equal(after[i], before[i]) for i in range(5, 10))


@pytest.mark.kernels("bf16")
def test_prefill_attention_refuses_what_it_cannot_compute():
    q, layer, blocks = _prefill_case(3, 9, 64, 10, 20, seed=3)
    attend = torch.ops.nanoserve.prefill_attention
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        attend(q.float(), layer, blocks, 10, BLOCK)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        attend(q, layer, blocks.int(), 10, BLOCK)
    assert not torch.ops.nanoserve.prefill_attention_supports(16, 3)
    assert not torch.ops.nanoserve.prefill_attention_supports(64, 9)
    # Indices that would read outside the tensors are refused, not followed.
    with pytest.raises(RuntimeError, match=r"positions \[0, 47\) need more than the table's 2"):
        attend(q, layer, blocks[:2], 27, BLOCK)
    for bad_block in (-1, 48):
        wrong = blocks.clone()
        wrong[1] = bad_block
        with pytest.raises(RuntimeError, match=f"block {bad_block} is outside the pool of 48"):
            attend(q, layer, wrong, 10, BLOCK)
    with pytest.raises(RuntimeError, match="block_size must divide"):
        attend(q, layer, blocks, 10, 0)
    with pytest.raises(RuntimeError, match="needs head_dim 32, 64 or 128"):
        attend(q, layer[:, :2], blocks, 10, BLOCK)


needs_bf16 = pytest.mark.kernels("bf16")  # q4_linear


@needs_bf16
@pytest.mark.parametrize(
    "rows, cols, batch, has_min",
    [(16, 32, 1, True), (48, 64, 3, False), (960, 576, 8, True), (100, 96, 5, True),
     (3072, 576, 1, True), (576, 1536, 2, False)],
)  # fmt: skip
def test_q4_linear_equals_the_float64_product_to_bfloat16s_rounding(rows, cols, batch, has_min):
    q4 = q4_case(rows, cols, seed=rows + cols, has_min=has_min)
    packed = pack_q4([q4])
    assert packed is not None and packed[0].shape == (-(-rows // 16), cols // 32, 256)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch)).bfloat16()
    want = x.double() @ dequantized64(q4).T  # (batch, rows)
    got = torch.ops.nanoserve.q4_linear(x, *packed)[:, :rows].double()
    assert got.shape == want.shape
    # bfloat16's rounding of the output, plus float32 sums of a few hundred products.
    bound = 2**-8 * want.abs() + 1e-5 * want.abs().max()
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


@needs_bf16
def test_q4_linear_reads_each_nibble_as_its_own_column():
    """One weight of 1.0 at a time, everywhere else 0: each output is exactly the x it picks."""
    rows, cols = 32, 64
    x = torch.arange(1, cols + 1, dtype=torch.bfloat16)[None]  # exact small integers
    for row, col in [(0, 0), (0, 1), (5, 16), (15, 17), (16, 2), (31, 63), (7, 40)]:
        q = torch.zeros(rows, cols, dtype=torch.uint8)
        q[row, col] = 1
        scale = torch.ones(rows, cols // 32)
        packed = pack_q4([Q4Tensor(q, scale, 8 * scale)])  # weight = q
        out = torch.ops.nanoserve.q4_linear(x, *packed)
        want = torch.zeros(1, rows)
        want[0, row] = col + 1
        assert torch.equal(out.float(), want), (row, col)


@needs_bf16
def test_q4_linear_refuses_what_it_cannot_compute():
    packed = pack_q4([q4_case(32, 64, seed=1)])
    x = torch.randn(2, 64).bfloat16()
    linear = torch.ops.nanoserve.q4_linear
    with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):
        linear(torch.randn(9, 64).bfloat16(), *packed)
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        linear(torch.randn(2, 96).bfloat16(), *packed)
    with pytest.raises(RuntimeError, match="contiguous \\(M, K\\) bfloat16"):
        linear(x.float(), *packed)
    with pytest.raises(RuntimeError, match="contiguous \\(M, K\\) bfloat16"):
        linear(torch.randn(64, 2).bfloat16().t(), *packed)
    with pytest.raises(RuntimeError, match="scale and low must be contiguous"):
        linear(x, packed[0], packed[1].float(), packed[2])
    with pytest.raises(RuntimeError, match="scale and low must be contiguous"):
        linear(x, packed[0], packed[1], packed[2][:1])
    with pytest.raises(RuntimeError, match="packed must be contiguous"):
        linear(x, packed[0][..., :128], packed[1], packed[2])


needs_vnni = pytest.mark.kernels("vnni")  # w4a8_linear


@needs_vnni
@pytest.mark.parametrize(
    "rows, cols, batch, has_min",
    [(16, 32, 1, True), (48, 64, 9, False), (960, 576, 32, True), (100, 96, 13, True),
     (3072, 576, 6, True), (576, 1536, 130, False)],
)  # fmt: skip
def test_w4a8_linear_is_llamacpps_q4_1_q8_1_dot_to_bfloat16s_rounding(rows, cols, batch, has_min):
    q4 = q4_case(rows, cols, seed=rows + cols, has_min=has_min)
    _, scale, low = pack_q4([q4])
    packed = pack_w4a8([q4])
    assert packed.shape == (-(-rows // 16), cols // 32, 512)
    x = (torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch)) * 3).bfloat16()
    if batch > 1:
        x[1, :32] = 0  # a group of zeros quantizes to zeros, not NaNs
    want = w4a8_reference(x, q4)
    got = torch.ops.nanoserve.w4a8_linear(x, packed, scale, low)[:, :rows].double()
    assert got.shape == want.shape
    # bfloat16's rounding of the output, plus float32 sums of a few dozen groups.
    bound = 2**-8 * want.abs() + 1e-5 * want.abs().max()
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    # and not the unquantized product: the 8-bit activations are what it multiplies
    exact = x.double() @ dequantized64(q4).T
    assert not ((got - exact).abs() <= 2**-8 * exact.abs()).all()


@needs_vnni
def test_w4a8_linear_reads_each_byte_as_its_own_column():
    """One weight of 1.0 at a time, everywhere else 0, and x's groups quantized exactly
    (each group's largest is 127): each output is exactly the x it picks."""
    rows, cols = 32, 64
    x = torch.arange(1, cols + 1, dtype=torch.bfloat16)[None]
    x[0, 31], x[0, 63] = 127, 127
    for row, col in [(0, 0), (0, 1), (5, 4), (15, 17), (16, 2), (31, 62), (7, 40)]:
        q = torch.zeros(rows, cols, dtype=torch.uint8)
        q[row, col] = 1
        scale = torch.ones(rows, cols // 32)
        q4 = Q4Tensor(q, scale, 8 * scale)  # weight = q
        _, s, low = pack_q4([q4])
        out = torch.ops.nanoserve.w4a8_linear(x, pack_w4a8([q4]), s, low)
        want = torch.zeros(1, rows)
        want[0, row] = x[0, col].float()
        assert torch.equal(out.float(), want), (row, col)


@needs_vnni
def test_w4a8_linear_refuses_what_it_cannot_compute():
    q4 = q4_case(32, 64, seed=1)
    _, scale, low = pack_q4([q4])
    packed = pack_w4a8([q4])
    x = torch.randn(2, 64).bfloat16()
    linear = torch.ops.nanoserve.w4a8_linear
    with pytest.raises(RuntimeError, match="x has no rows"):
        linear(x[:0], packed, scale, low)
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        linear(torch.randn(2, 96).bfloat16(), packed, scale, low)
    with pytest.raises(RuntimeError, match="contiguous \\(M, K\\) bfloat16"):
        linear(x.float(), packed, scale, low)
    with pytest.raises(RuntimeError, match="scale and low must be contiguous"):
        linear(x, packed, scale.float(), low)
    with pytest.raises(RuntimeError, match="scale and low must be contiguous"):
        linear(x, packed, scale, low[:1])
    with pytest.raises(RuntimeError, match="packed must be contiguous"):
        linear(x, packed[..., :256], scale, low)


@pytest.mark.parametrize("rows, width", [(1, 576), (7, 64), (128, 576), (300, 40)])
def test_rms_norm_equals_torchs(rows, width):
    gen = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, width + 8, generator=gen) * 3).bfloat16()
    x = wide[:, 4 : 4 + width]  # rows apart by a stride, as views of a wider output are
    weight = (torch.rand(width, generator=gen) * 2).bfloat16()
    x[-1, 0] = float("nan") if rows > 1 else x[-1, 0]  # a NaN row stays NaN
    want = F.rms_norm(x, (width,), weight, 1e-5)
    got = torch.ops.nanoserve.rms_norm(x, weight, 1e-5)
    if rows > 1:
        assert got[-1].isnan().all() and not got[:-1].isnan().any()
        want, got = want[:-1], got[:-1]
    want, got = want.float(), got.float()
    # The same float32 formula, rounded once; only the sum of squares adds in another order,
    # which moves a rare result across a rounding boundary: one bfloat16 step at most.
    differ = want != got
    assert differ.float().mean().item() < 1e-4
    assert ((want - got).abs() <= 2**-7 * want.abs()).all()


def test_rms_norm_refuses_what_it_cannot_compute():
    x, weight = torch.randn(4, 64).bfloat16(), torch.ones(64).bfloat16()
    norm = torch.ops.nanoserve.rms_norm
    with pytest.raises(RuntimeError, match="x must be \\(T, H\\) bfloat16"):
        norm(x.float(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="x must be \\(T, H\\) bfloat16"):
        norm(x.t(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be a contiguous \\(64,\\) bfloat16"):
        norm(x, weight[:32], 1e-5)


@pytest.mark.parametrize("rows, width", [(1, 1536), (128, 1536), (5, 40)])
def test_silu_mul_equals_torchs_two_steps(rows, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 6).bfloat16()
    gate_up[0, :3] = torch.tensor([-95.0, 95.0, 0.0])  # exp's clamped and exact ends
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate.clone(), inplace=True).mul_(up)
    got = torch.ops.nanoserve.silu_mul(gate_up)
    assert torch.equal(got, want)


def test_silu_mul_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="gate_up must be \\(T, 2I\\) bfloat16"):
        torch.ops.nanoserve.silu_mul(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="gate_up must be \\(T, 2I\\) bfloat16"):
        torch.ops.nanoserve.silu_mul(torch.randn(2, 7).bfloat16())


@pytest.mark.parametrize("tokens, heads, head_dim", [(128, 12, 64), (3, 6, 16), (5, 2, 40)])
def test_rotary_equals_torchs_roll_multiply_and_add(tokens, heads, head_dim):
    """In place on q|k as the model's view of its fused qkv (strided heads), whole vectors and
    masked tails alike."""
    gen = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(tokens, heads + 2, head_dim, generator=gen) * 4).bfloat16()
    qk = qkv[:, :heads]  # (T, heads, hd), rows strided past v
    inv_freq = inverse_frequencies({"rope_theta": 10000.0, "rope_type": "default"}, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rotary_cos_sin(inv_freq, positions, torch.bfloat16)
    want = qkv.clone()
    apply_rotary(want[:, :heads], cos, sin, out=want[:, :heads])
    torch.ops.nanoserve.rotary_(qk, cos, sin)
    assert torch.equal(qkv, want)  # v untouched too


def test_rotary_refuses_what_it_cannot_compute():
    cos = sin = torch.ones(2, 1, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be \\(T, heads, hd\\) bfloat16"):
        torch.ops.nanoserve.rotary_(torch.randn(2, 3, 8), cos, sin)
    with pytest.raises(RuntimeError, match="hd contiguous and even"):
        torch.ops.nanoserve.rotary_(torch.randn(2, 3, 7).bfloat16(), cos, sin)
    with pytest.raises(RuntimeError, match="cos and sin must be \\(2, 1, 8\\) bfloat16"):
        torch.ops.nanoserve.rotary_(torch.randn(2, 3, 8).bfloat16(), cos[:, :, :4], sin)


def _count_layer_kernels(monkeypatch) -> dict[str, int]:
    """Calls of the layers' eager kernels from now on, by name."""
    calls = {"rms_norm": 0, "silu_mul": 0, "rotary_": 0}
    for name in calls:
        real = getattr(torch.ops.nanoserve, name)

        def counting(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(torch.ops.nanoserve, name, counting)
    return calls


def test_eager_bfloat16_steps_norm_rotate_and_activate_with_them(tiny_dir, monkeypatch):
    """The plan turns them on for bfloat16 and they run in its eager steps; the same plan with
    torch's pointwise ops runs none of them, and its tokens equal the kernels' and its logits
    stay within bfloat16's reach."""
    import dataclasses

    from tests.worker.driver import Driver, Request

    calls = _count_layer_kernels(monkeypatch)
    planned = make_worker(tiny_dir, dtype="bfloat16", compile=False).plan
    assert (planned.norm, planned.activation, planned.rotary) == ("kernel", "kernel", "kernel")

    def run(plan):
        worker = make_worker(tiny_dir, dtype="bfloat16", compile=False, plan=plan)
        return Driver(worker, eos=[]).run([Request("r", list(range(3, 30)), 5)])

    with_kernels = run(planned)
    # 2 layers x 2 norms + the final norm, and 2 MLPs and 2 attentions, in each of 5 steps
    expected = {"rms_norm": 5 * 5, "silu_mul": 5 * 2, "rotary_": 5 * 2}
    assert calls == expected
    without = run(dataclasses.replace(planned, norm="torch", activation="torch", rotary="torch"))
    assert calls == expected
    for a, b in zip(with_kernels, without, strict=True):
        assert a.output == b.output
        worst = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))
        assert worst < 0.05, worst
    float32 = make_worker(tiny_dir, dtype="float32")
    Driver(float32, eos=[]).run([Request("r", list(range(3, 30)), 5)])
    assert calls == expected  # float32 steps keep torch's


def test_eager_steps_keep_the_kernels_while_another_thread_compiles(tiny_dir, monkeypatch):
    """torch sets ``torch.compiler.is_compiling()`` for a whole compile session, process-wide:
    while the background thread loads the compiled graphs, the stepping thread's eager steps
    keep the plan's operators (they never ask the flag: the compiled graph traces its own)."""
    from tests.worker.driver import Driver, Request

    calls = _count_layer_kernels(monkeypatch)
    worker = make_worker(tiny_dir, dtype="bfloat16", compile=False)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()  # what the other thread's session makes everyone see
    Driver(worker, eos=[]).run([Request("r", list(range(3, 30)), 5)])
    assert calls == {"rms_norm": 5 * 5, "silu_mul": 5 * 2, "rotary_": 5 * 2}


def test_pack_q4_refuses_scales_float16_cannot_hold():
    """And the plan does not give such a matrix nanoserve's kernel (``Q4Fact.exact``)."""
    q4 = q4_case(16, 32, seed=2)
    assert float16_exact([q4]) and pack_q4([q4]) is not None
    q4.zero[3, 0] += 1e-4  # low = zero - 8 scale is no longer a float16
    assert not float16_exact([q4])
    with pytest.raises(ValueError, match="no exact float16 form"):
        pack_q4([q4])


def _argmax_rows(width: int, seed: int) -> torch.Tensor:
    """Nine rows of ``width`` logits, each a case torch.argmax settles in its own way."""
    x = torch.randn(9, width, generator=torch.Generator().manual_seed(seed))
    top = x.abs().max() + 1
    x[1, width // 3] = x[1, -1] = top  # a tie: the first index wins, across lanes and the tail
    x[2] = 0.5  # all equal: index 0
    x[3] = float("-inf")  # index 0
    x[4, 0], x[4, width // 2], x[4, width * 3 // 4] = top, float("nan"), float("nan")  # first NaN
    x[5, -1] = top  # the maximum in the last position
    x[6, width // 2] = float("inf")
    if width > 35:  # a tie where the later index sits in the lower lane (35: lane 3; 20: lane 4)
        x[7, 35] = x[7, 20] = top
    x[8, -1] = float("nan")  # a NaN in the tail only (in the last vector where width is 16)
    return x


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152 + 5])
def test_argmax_equals_torchs(width):
    x = _argmax_rows(width, seed=width)
    assert torch.equal(torch.ops.nanoserve.argmax(x), x.argmax(dim=-1))
    rows = torch.randn(5, width + 7, generator=torch.Generator().manual_seed(1))[:, :width]
    assert torch.equal(torch.ops.nanoserve.argmax(rows), rows.argmax(dim=-1))  # strided rows
    empty = torch.zeros(0, width)
    assert torch.ops.nanoserve.argmax(empty).shape == (0,)


def test_argmax_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.nanoserve.argmax(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.nanoserve.argmax(torch.zeros(8))
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.nanoserve.argmax(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="rows of 1 to"):
        torch.ops.nanoserve.argmax(torch.zeros(2, 0))


@pytest.mark.kernels("bf16")  # else the float32 scoring is the default
def test_the_float32_scoring_too():
    """Where the CPU has AVX512-BF16 the scores take vdpbf16ps, and the float32 path is compiled
    out: build it (NANOSERVE_KERNELS_BF16=0, its own directory) and run the numeric tests on
    it in a child pytest."""
    tests = "equals_float64 or sharp_softmax or nothing_cached or reads_the_rows"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env={**os.environ, "NANOSERVE_KERNELS_BF16": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"\b11 passed", done.stdout), done.stdout[-3000:]


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("NANOSERVE_KERNELS", "0")
    kernels.loaded.cache_clear()
    try:
        assert not kernels.available()
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        kernels.loaded.cache_clear()
        assert kernels.available()


def test_bfloat16_steps_attend_with_it_and_float32_steps_do_not(tiny_dir, monkeypatch):
    calls = []
    real = torch.ops.nanoserve.decode_attention

    class Counting:
        def __call__(self, *args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(torch.ops.nanoserve, "decode_attention", Counting())
    from tests.worker.driver import Driver, Request

    argmax_calls = []
    real_argmax = torch.ops.nanoserve.argmax

    def counting_argmax(scores):
        argmax_calls.append(scores.shape)
        return real_argmax(scores)

    monkeypatch.setattr(torch.ops.nanoserve, "argmax", counting_argmax)
    for dtype, want in (("float32", 0), ("bfloat16", 2 * 3)):  # 2 layers x 3 decode steps
        calls.clear()
        argmax_calls.clear()
        worker = make_worker(tiny_dir, dtype=dtype)
        # known, and built, at start (float32 decodes in decode_attention_f32)
        assert worker.plan.attention == {"float32": "cpu-f32", "bfloat16": "cpu-bf16"}[dtype]
        assert worker.sampler.argmax == "kernel"  # greedy choices in both
        Driver(worker, eos=[]).run([Request("r", [1, 2, 3, 4, 5], 4)])
        assert len(calls) == want, dtype
        assert len(argmax_calls) == 4, dtype  # the prefill's token and 3 decodes


def test_mixed_eager_steps_match_the_torch_attention(tiny_dir):
    """Chunked prefills beside decodes, bucketed and padded: the kernel's logits stay within
    bfloat16's reach of the gather-and-bmm path's, and pick the same tokens. The same plan but
    for its attention: nothing else differs between the two runs."""
    import dataclasses

    from tests.worker.driver import Driver, Request

    planned = make_worker(tiny_dir, dtype="bfloat16").plan
    assert planned.attention == "cpu-bf16"

    def run(plan):
        worker = make_worker(tiny_dir, dtype="bfloat16", plan=plan)
        # "a" prefills in chunks of 5 while "b" and "c" decode beside it.
        prompts = {"a": list(range(3, 40)), "b": [5, 6, 7], "c": [9, 8, 7, 6]}
        requests = [Request(name, prompt, 6) for name, prompt in prompts.items()]
        return Driver(worker, eos=[]).run(requests, chunk=5)

    with_kernel = run(planned)
    without = run(dataclasses.replace(planned, attention="torch", prefill="sdpa"))
    for a, b in zip(with_kernel, without, strict=True):
        assert a.output == b.output
        worst = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))
        assert worst < 0.05, worst


@pytest.mark.kernels("avx512")
def test_a_stale_build_lock_does_not_block_the_next_load(tmp_path):
    """A build killed mid-way leaves cpp_extension's ``lock`` file; the next process removes it
    (under an flock no dead process can hold) instead of waiting on it forever."""
    import shutil

    # This process's build, copied: the copy's sources have other paths, so it compiles again
    # (half a minute), but in a cache of its own.
    built = kernels._load()
    cache, build = tmp_path / "cache", tmp_path / "cache" / "kernels" / built.name
    shutil.copytree(built, build, ignore=shutil.ignore_patterns("*.flock", kernels.BUILT))
    (build / "lock").write_text("")  # what a SIGKILLed build leaves
    done = subprocess.run(
        [sys.executable, "-c", "from worker.cpu import kernels; kernels._load(); print('loaded')"],
        env={**os.environ, "NANOSERVE_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=300,  # without the fix it waits on the lock forever
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
    assert "stale lock" in done.stderr
    assert not (build / "lock").exists()


@pytest.mark.kernels("avx512")
def test_another_torch_build_builds_in_a_directory_of_its_own(monkeypatch):
    """Another torch version or commit has other headers: its kernels are built apart."""
    built = kernels._load()
    assert kernels.build_dir() == built
    monkeypatch.setattr(kernels, "torch_build", lambda: "2.13.0 0123abc abi1")
    other = kernels.build_dir()
    assert other != built and other.parent == built.parent
    assert other.name.startswith(f"torch-{torch.__version__}")


@pytest.mark.kernels("avx512")
def test_another_venv_with_the_same_torch_loads_the_build_without_ninja(tmp_path):
    """A fresh clone's virtual environment installs the same torch elsewhere. Its build
    commands name that directory, so ninja would rebuild a build made from another venv (48 s
    of a fresh clone's first start): a finished build is loaded as it is."""
    import shutil

    built = kernels._load()
    assert (built / kernels.BUILT).exists()
    cache, build = tmp_path / "cache", tmp_path / "cache" / "kernels" / built.name
    shutil.copytree(built, build, ignore=shutil.ignore_patterns("*.flock"))
    # As another venv's build leaves it: its commands name that venv's torch. (The build found
    # here may come from yet another venv already: the marker names the one it was made from.)
    ninja = build / "build.ninja"
    maker = (build / kernels.BUILT).read_text().removeprefix("built against ").strip()
    assert maker in ninja.read_text()
    ninja.write_text(ninja.read_text().replace(maker, "/elsewhere/site-packages/torch"))
    library = build / "nanoserve_kernels.so"
    before = library.stat().st_mtime_ns
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from worker.cpu import kernels; print(kernels._load()); "
            "print(torch.ops.nanoserve.argmax(torch.tensor([[0.0, 2.0, 1.0]])).item())",
        ],
        env={**os.environ, "NANOSERVE_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(build.resolve()), "1"]
    assert library.stat().st_mtime_ns == before, "the build was compiled again"
    assert "/elsewhere/" in ninja.read_text(), "ninja ran"


@pytest.mark.kernels("avx512")
def test_another_checkout_loads_the_same_build_without_compiling(tmp_path):
    """Ninja rebuilds when a source's path changes, not only its bytes: the build must not
    depend on where the checkout is, or two checkouts taking turns compile again (half a
    minute) at every start."""
    import shutil

    built = kernels._load()
    library = built / "nanoserve_kernels.so"
    before = library.stat().st_mtime_ns
    checkout = tmp_path / "csrc"  # the same sources, elsewhere
    shutil.copytree(kernels.HEADERS[0].parent, checkout)
    script = (
        "from worker.cpu import kernels\n"
        "from pathlib import Path\n"
        f"csrc = Path({str(checkout)!r})\n"
        "for name in ('SOURCES', 'BF16_SOURCES', 'VNNI_SOURCES', 'AVX2_SOURCES', 'HEADERS'):\n"
        "    setattr(kernels, name, [csrc / path.name for path in getattr(kernels, name)])\n"
        "print(kernels._load())\n"
    )
    done = subprocess.run(  # the cache directory is this session's (the conftest's fixture)
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(built)
    assert library.stat().st_mtime_ns == before, "the other checkout's sources were compiled"
