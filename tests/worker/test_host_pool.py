"""The CPU K/V pool: zero before anything is written, backed behind serving without losing a
write made meanwhile, and fully resident once the populating thread is done."""

from __future__ import annotations

import torch

from worker.kv_cache import KVCache

MIB = 1 << 20


def rss_anon() -> int:
    """This process's resident anonymous memory, in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def test_pool_is_zero_is_backed_in_the_background_and_keeps_early_writes():
    before = rss_anon()
    # 256 MiB: (layers 8, K/V 2, kv heads 2, blocks 4095 + 1, block 16, head_dim 64) bfloat16
    cache = KVCache(
        num_layers=8,
        num_blocks=4095,
        block_size=16,
        n_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device="cpu",
    )
    size = cache.pool.numel() * cache.pool.element_size()
    assert size == 256 * MIB
    cache.populate()
    # Written at once, likely before the thread reaches these blocks: population must not undo it.
    cache.pool[:, :, :, 4000].fill_(3.0)
    cache.pool[7, 1, 1, 17].fill_(-2.0)
    assert cache.host is not None and cache.host.resident.wait(timeout=60)
    assert cache.host.populate_s is not None, "MADV_POPULATE_WRITE refused on this kernel"
    grown = rss_anon() - before
    assert grown > size - 16 * MIB, f"only {grown / MIB:.0f} MiB of {size / MIB:.0f} resident"
    assert torch.all(cache.pool[:, :, :, 4000] == 3.0)
    assert torch.all(cache.pool[7, 1, 1, 17] == -2.0)
    cache.pool[:, :, :, 4000].zero_()
    cache.pool[7, 1, 1, 17].zero_()
    assert int(torch.count_nonzero(cache.pool)) == 0  # every other element read as zero
