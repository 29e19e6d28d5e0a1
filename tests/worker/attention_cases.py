"""Paged decode-attention cases and their float64 reference, shared by the kernels' tests
(``test_kernels.py`` for bfloat16, ``test_f32_attention.py`` for float32)."""

from __future__ import annotations

import torch

BLOCK = 16

# (KV heads, query heads, head_dim) and their ids: SmolLM2's, the tiny Llama's, Qwen2's, and
# every group shape the kernels' templates cover.
HEADS = dict(
    argnames="n_kv, nq, hd",
    argvalues=[
        (3, 9, 64),
        (2, 4, 16),
        (2, 14, 128),
        (1, 8, 32),
        (4, 4, 64),
        (2, 10, 64),
        (2, 8, 64),
        (2, 12, 32),
    ],
    ids=["smollm2", "tiny", "qwen2", "mqa", "mha", "group5", "group4", "group6"],
)


def reference(q, kv, layer, blocks, cached, first=None):
    """float64 softmax attention of each row over its cached slots, then the new k/v of its
    group's rows (``first[b]`` to b; without ``first``, its own alone)."""
    batch, nq, hd = q.shape
    n_kv = layer.shape[1]
    group = nq // n_kv
    out = torch.empty(batch, nq, hd, dtype=torch.float64)
    for b in range(batch):
        slots = [int(blocks[b, t // BLOCK]) * BLOCK + t % BLOCK for t in range(int(cached[b]))]
        new = slice(b if first is None else int(first[b]), b + 1)
        for h in range(n_kv):
            keys = torch.cat([layer[0, h, slots], kv[new, 0, h]]).double()  # (L + n, hd)
            values = torch.cat([layer[1, h, slots], kv[new, 1, h]]).double()
            queries = q[b, h * group : (h + 1) * group].double()  # (group, hd)
            weights = torch.softmax(queries @ keys.T / hd**0.5, dim=-1)
            out[b, h * group : (h + 1) * group] = weights @ values
    return out


def case(
    n_kv: int, nq: int, hd: int, lengths: list[int], seed: int, dtype=torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    """q (B, nq, hd), kv (B, 2, n_kv, hd), a 48-block pool layer (2, n_kv, 768, hd), shuffled
    block tables (B, M) and the cached lengths (B,), seeded; q and kv strided as the model's."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 48
    layer = torch.randn(2, n_kv, num_blocks * BLOCK, hd, generator=gen).to(dtype)
    width = max(-(-(n + 1) // BLOCK) for n in lengths) + 1  # padded tables, as the worker's
    blocks = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lengths])
    # q and kv as the model passes them: strided views of one qkv output.
    qkv = torch.randn(len(lengths), nq + 2 * n_kv, hd, generator=gen).to(dtype)
    q, kv = qkv[:, :nq], qkv[:, nq:].view(len(lengths), 2, n_kv, hd)
    return q, kv, layer, blocks, torch.tensor(lengths)


def grouped(q, kv, layer, blocks, cached, sizes: list[int]):
    """The case's rows as groups of ``sizes`` rows (a token and its drafts): each group's rows
    share its first row's table and cached count; -> (blocks, cached, first)."""
    blocks, cached, first, row = blocks.clone(), cached.clone(), [], 0
    for size in sizes:
        blocks[row : row + size] = blocks[row]
        cached[row : row + size] = cached[row]
        first += [row] * size
        row += size
    assert row == q.shape[0]
    return blocks, cached, torch.tensor(first)
