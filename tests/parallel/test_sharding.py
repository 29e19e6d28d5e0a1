"""``Shard``: which sizes split a model, and which rows and columns each rank reads. The ranks'
parts put back together are the whole tensor, so nothing is lost or read twice."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker.parallel.sharding import Shard, valid_sizes

TINY = dict(n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=250)


def test_the_sizes_that_split_the_heads():
    assert valid_sizes(9, 3, 1536) == [1, 3]  # SmolLM2-135M
    assert valid_sizes(4, 2, 128) == [1, 2, 4]
    assert valid_sizes(32, 8, 14336) == [1, 2, 4, 8, 16, 32]


def test_a_size_that_does_not_split_the_heads_is_refused_with_the_ones_that_do():
    with pytest.raises(ValueError, match="size 2 does not split .* 9 query heads.*: 1, 3$"):
        Shard(rank=0, size=2, n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536,
              vocab_size=49152)  # fmt: skip


def test_kv_heads_split_then_replicated():
    assert [Shard(rank=r, size=2, **TINY).kv_start for r in range(2)] == [0, 1]
    four = [Shard(rank=r, size=4, **TINY) for r in range(4)]
    assert [s.local_kv_heads for s in four] == [1] * 4
    # Rank r holds query head r, which reads KV head r // 2 (two query heads per KV head).
    assert [s.kv_start for s in four] == [0, 0, 1, 1]


def test_vocabulary_ranges_cover_it_once():
    ranges = [Shard(rank=r, size=4, **TINY).vocab_range for r in range(4)]
    assert ranges == [(0, 63), (63, 126), (126, 189), (189, 250)]


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_its_part_and_the_parts_make_the_whole(tmp_path, size):
    torch.manual_seed(0)
    hd, d = TINY["head_dim"], 32
    full = {
        "model.embed_tokens.weight": torch.randn(250, d),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4 * hd, d),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(2 * hd, d),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(d, 4 * hd),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(d),
        "model.layers.0.mlp.down_proj.weight": torch.randn(d, 128),
        "model.layers.0.input_layernorm.weight": torch.randn(d),
    }
    save_file(full, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        shards = [Shard(rank=r, size=size, **TINY) for r in range(size)]
        parts = [{name: s.read(handle, name, torch.float32) for name in full} for s in shards]
    cat = lambda name, dim: torch.cat([p[name] for p in parts], dim)  # noqa: E731
    assert torch.equal(cat("model.embed_tokens.weight", 0), full["model.embed_tokens.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(cat(q, 0), full[q])
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(cat(name, 1), full[name])
    k = "model.layers.0.self_attn.k_proj.weight"
    for rank, part in enumerate(parts):  # one KV head each: split (2) or replicated (4)
        head = Shard(rank=rank, size=size, **TINY).kv_start
        assert torch.equal(part[k], full[k][head * hd : (head + 1) * hd])
    bias = "model.layers.0.self_attn.o_proj.bias"
    assert torch.equal(sum(p[bias] for p in parts), full[bias])  # rank 0's alone
    norm = "model.layers.0.input_layernorm.weight"
    assert all(torch.equal(p[norm], full[norm]) for p in parts)
