"""``torch.ops.nanoserve.prefill_attention_f32`` (``worker/cpu/csrc/prefill_attention_f32.cpp``):
causal attention of a float32 prefill span over its K/V in AVX2, built on any CPU with AVX2, FMA
and F16C.

It equals float64 causal attention to float32's rounding for fresh and continued spans (the
kernel's row blocks and position tiles cut at 4 and 32), reads float16 K/V as their widened
values bit for bit, gives the same result on any number of threads, lets no query see a later
position, and refuses what it cannot compute. A CPU worker's float32 prefills call it, with the
torch backend's tokens (``test_f32_attention.py``, beside the decodes)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.attention_cases import HEADS
from tests.worker.kernel_checks import require_kernels


@pytest.fixture(autouse=True)
def built(private_cache):
    """Build (or load) the kernels in the tests' private cache, or skip where they cannot be."""
    require_kernels("avx2")


def attend(q, k, v, start):
    return torch.ops.nanoserve.prefill_attention_f32(q, k, v, start)


def span(n_kv: int, nq: int, hd: int, n: int, start: int, seed: int, spare: int = 3):
    """q (n, nq, hd) and k, v (start + n + spare, n_kv, hd), every one a strided view, as the
    worker passes them: q of the qkv output, k and v of one (m, 2, n_kv, hd) tensor."""
    generator = torch.Generator().manual_seed(seed)
    m = start + n + spare
    q = torch.randn(n, nq + 2, hd, generator=generator)[:, 1 : nq + 1]
    kv = torch.randn(m, 2, n_kv, hd, generator=generator)
    return q, kv[:, 0], kv[:, 1]


def reference(q, k, v, start):
    """Float64 causal softmax attention: query row i sees positions 0 .. start + i."""
    n, nq, hd = q.shape
    group = nq // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (nq, m, hd)
    values = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) / hd**0.5  # (nq, n, m)
    seen = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)  # (n, nq, hd)


def close(got, want) -> bool:
    # float32 sums of a few hundred products of order 1, and the exp's 2e-7.
    return bool(((got.double() - want).abs() <= want.abs() * 1e-5 + 1e-5).all())


@pytest.mark.parametrize(**HEADS)
def test_it_equals_float64_causal_attention_to_float32_rounding(n_kv, nq, hd):
    # Fresh and continued spans; lengths within, at and across 4-row blocks and 32-position tiles.
    for n, start in ((1, 0), (3, 0), (4, 0), (5, 0), (33, 0), (130, 0), (1, 17), (7, 31), (40, 64)):
        q, k, v = span(n_kv, nq, hd, n, start, seed=n + start + hd)
        got = attend(q, k, v, start)
        assert got.dtype == torch.float32 and got.shape == (n, nq, hd)
        assert close(got, reference(q, k, v, start)), (n, start)


@pytest.mark.parametrize(**HEADS)
def test_float16_keys_and_values_give_what_their_widened_values_give(n_kv, nq, hd):
    q, k, v = span(n_kv, nq, hd, 37, 20, seed=hd)
    k16, v16 = k.half(), v.half()
    got = attend(q, k16, v16, 20)
    assert torch.equal(got, attend(q, k16.float(), v16.float(), 20))
    assert close(got, reference(q, k16.float(), v16.float(), 20))


def test_it_runs_on_several_threads_as_on_one():
    q, k, v = span(3, 9, 64, 300, 45, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        parallel = attend(q, k, v, 45)
        torch.set_num_threads(1)
        serial = attend(q, k, v, 45)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(parallel, serial)
    assert close(parallel, reference(q, k, v, 45))


def test_no_query_sees_a_later_position():
    """A NaN key at position p reaches exactly the rows at p or later of that KV head's query
    heads; NaN past the span's last position reaches none."""
    start, n = 10, 50
    q, k, v = span(3, 9, 64, n, start, seed=5)
    clean = attend(q, k, v, start)
    poisoned_k = k.clone()
    poisoned_k[start + n :] = float("nan")
    assert torch.equal(attend(q, poisoned_k, v, start), clean)
    p = start + 21
    poisoned_k[p, 1] = float("nan")  # KV head 1: query heads 3, 4 and 5
    got = attend(q, poisoned_k, v, start)
    assert got[21:, 3:6].isnan().all()
    assert torch.equal(got[:21], clean[:21])
    assert torch.equal(got[:, :3], clean[:, :3]) and torch.equal(got[:, 6:], clean[:, 6:])


def test_a_sharp_softmax_stays_exact():
    q, k, v = span(3, 9, 64, 64, 8, seed=6)
    sharp = q * 30  # scores of hundreds: most weights underflow to 0
    assert close(attend(sharp, k, v, 8), reference(sharp, k, v, 8))


def test_it_refuses_what_it_cannot_compute():
    q, k, v = span(3, 9, 64, 5, 2, seed=3)  # m = 10
    with pytest.raises(RuntimeError, match="q must be float32"):
        attend(q.bfloat16(), k, v, 2)
    with pytest.raises(RuntimeError, match="k and v both float32 or float16"):
        attend(q, k, v.half(), 2)
    with pytest.raises(RuntimeError, match="need 11 positions of K/V, got 10"):
        attend(q, k, v, 6)
    with pytest.raises(RuntimeError, match="from position -1"):
        attend(q, k, v, -1)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        attend(q, k, v[:4], 2)
    with pytest.raises(RuntimeError, match="whole groups of query heads"):
        attend(q[:, :8], k, v, 2)
    q48, k48, v48 = span(1, 2, 48, 5, 0, seed=4)
    with pytest.raises(RuntimeError, match="needs head_dim 16, 32, 64 or 128"):
        attend(q48, k48, v48, 0)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        attend(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 2)
    assert torch.ops.nanoserve.prefill_attention_f32_supports(64)
    assert not torch.ops.nanoserve.prefill_attention_f32_supports(48)
