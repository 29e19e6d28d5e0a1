"""The CPU fast path's pieces against the plain formulas they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.kv.cache import KVCache
from worker.linear.base import Linear
from worker.linear.dense import OneDnn
from worker.model.llama import RMSNorm
from worker.model.rope import apply_rotary, rotary_cos_sin
from worker.plan import _onednn_packs


def test_rotary_is_bitwise_transformers_rotate_half():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 64, generator=gen)  # (T, heads, hd)
    positions = torch.arange(100, 107)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    want = x * cos + rotated * sin
    got = apply_rotary(x, *rotary_cos_sin(inv_freq, positions, torch.float32))
    assert torch.equal(got, want)


def test_rms_norm_is_bitwise_transformers_in_float32():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 576, generator=gen) * 3
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=gen) + 0.5
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(norm(x), want)  # the torch ops (ModelOps' default)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_linear_matches_f_linear(dtype):
    """The plan packs a weight for oneDNN only where oneDNN can (bfloat16 needs AVX-512 or
    AVX-NE-CONVERT); the packed linear computes F.linear's numbers."""
    if not _onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (the plan keeps dense)")
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 64, generator=gen).to(getattr(torch, dtype))
    bias = torch.randn(96, generator=gen).to(weight.dtype)
    layer = Linear.of(weight.clone(), bias.clone())
    x = torch.randn(5, 64, generator=gen).to(weight.dtype)
    want = F.linear(x, weight, bias).float()
    layer.use(OneDnn())
    assert layer.weight is None and layer.packed is not None
    got = layer(x).float()
    tol = 1e-5 if dtype == "float32" else 0.1
    assert (got - want).abs().max().item() < tol


def small_cache(num_layers: int, num_blocks: int, n_kv_heads: int, dtype) -> KVCache:
    return KVCache(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=4,
        n_kv_heads=n_kv_heads,
        head_dim=2,
        dtype=dtype,
        device="cpu",
    )


def test_scratch_reuses_memory_and_grows():
    cache = small_cache(num_layers=1, num_blocks=2, n_kv_heads=1, dtype=torch.float32)
    a = cache.scratch("k", (3, 4))
    b = cache.scratch("k", (2, 5))
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 5)
    c = cache.scratch("k", (10, 10))
    assert c.shape == (10, 10) and c.numel() == 100
    assert cache.scratch("v", (1,)).data_ptr() != c.data_ptr()


def test_zero_blocks_zeroes_exactly_the_given_blocks_in_every_layer():
    """Runs of adjacent ids, a lone id, repeats and the unsorted order a step lists them in."""
    cache = small_cache(num_layers=3, num_blocks=12, n_kv_heads=2, dtype=torch.bfloat16)
    cache.pool.fill_(float("nan"))
    cache.zero_blocks([7, 3, 4, 5, 10, 4])
    zeroed = [3, 4, 5, 7, 10]
    blocks = cache.pool.permute(3, 0, 1, 2, 4, 5).flatten(1)  # (num_blocks + 1, everything else)
    for block in range(13):
        if block in zeroed:
            assert torch.equal(blocks[block], torch.zeros_like(blocks[block])), block
        else:
            assert blocks[block].isnan().all(), block
    cache.zero_blocks([])  # a step that takes no new block
    assert blocks.isnan().sum() == 8 * blocks.shape[1]
