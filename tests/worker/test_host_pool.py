"""The CPU K/V pool: zero before anything is written, backed behind serving (only while the
worker is idle) without losing a write made meanwhile, and fully resident once the populating
thread is done."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import torch

from worker.kv.cache import KVCache

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


def _small_cache() -> KVCache:
    """64 MiB: (layers 2, K/V 2, kv heads 2, blocks 4095 + 1, block 16, head_dim 64) bfloat16."""
    return KVCache(
        num_layers=2,
        num_blocks=4095,
        block_size=16,
        n_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device="cpu",
    )


def test_pages_are_backed_only_while_the_worker_is_idle():
    before = rss_anon()
    cache = _small_cache()
    size = cache.pool.numel() * cache.pool.element_size()
    busy, asked = [True], threading.Event()
    calls = [0]

    def is_busy() -> bool:
        calls[0] += 1
        if calls[0] == 3:  # the thread has waited out two rechecks
            asked.set()
        return busy[0]

    cache.populate(busy=is_busy)
    assert cache.host is not None and asked.wait(timeout=30)
    assert not cache.host.resident.is_set()
    assert rss_anon() - before < 4 * MIB, "pages were backed while a step ran"
    busy[0] = False
    assert cache.host.resident.wait(timeout=60)
    assert cache.host.populate_s is not None, "MADV_POPULATE_WRITE refused on this kernel"
    assert cache.host.waited_s > 0
    grown = rss_anon() - before
    assert grown > size - 16 * MIB, f"only {grown / MIB:.0f} MiB of {size / MIB:.0f} resident"


def test_the_populating_thread_runs_at_the_process_priority():
    """Not niced: the last thread of a killed process to exit unmaps its memory, and a nice-19
    thread on a busy machine made a SIGKILLed worker take a minute to die (worker.kv.host_pool)."""
    cache = _small_cache()
    release = threading.Event()
    cache.populate(after=release.wait)
    try:
        threads = [thread for thread in threading.enumerate() if thread.name == "kv-populate"]
        assert threads and threads[-1].native_id is not None
        nice = os.getpriority(os.PRIO_PROCESS, threads[-1].native_id)
        assert nice == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    finally:
        release.set()
    assert cache.host is not None and cache.host.resident.wait(timeout=60)


def test_a_closed_pool_stops_backing_and_lets_its_worker_go():
    """``Worker.close`` ends the thread: an in-process worker dropped mid-population is freed,
    not kept alive by ``busy`` while the thread backs gigabytes nobody will use."""

    class Owner:  # the worker, whose bound ``_busy`` the thread holds
        def busy(self) -> bool:
            return True

    before = rss_anon()
    cache, owner = _small_cache(), Owner()
    cache.populate(busy=owner.busy)
    gone = weakref.ref(owner)
    del owner
    assert not cache.host.resident.wait(timeout=0.2), "populated while busy"
    assert gone() is not None, "the thread holds its owner while it runs"
    cache.close()
    assert cache.host.resident.wait(timeout=10)
    threads = [thread for thread in threading.enumerate() if thread.name == "kv-populate"]
    for thread in threads:
        thread.join(timeout=10)
    gc.collect()
    assert gone() is None, "the stopped thread still holds its owner"
    assert cache.host.populate_s is None
    assert rss_anon() - before < 4 * MIB, "pages were backed after close"
