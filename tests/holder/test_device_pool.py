"""A CUDA worker's shared pool, as far as a machine without a GPU can take it: the grant and its
handle cross the socket as msgpack; a holder that cannot allocate device memory refuses with the
reason and keeps serving; a worker whose handle does not open falls back to a private pool;
the holder's fence on a device pool's last worker is that process having exited; and the sums a
device pool's checks compare (``WeightedSums``) name the block and the slots that changed,
computed here on the CPU by the same torch operators. Opening the handle and the kill itself run
in ``scripts/gpu_check.py`` on a GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec
import pytest
import torch

from holder.device_pool import exited, started
from holder.process import Holder
from protocol.kv_pool import (
    PROTOCOL_VERSION,
    AttachPool,
    DeviceHandle,
    PoolGeometry,
    PoolGranted,
    pool_bytes,
)
from worker.kv.cache import KVCache
from worker.kv.device_pool import PRIME, WeightedSums, open_granted
from worker.kv.shared import Attachment

GEOMETRY = PoolGeometry(
    num_layers=2,
    n_kv_heads=2,
    head_dim=8,
    block_size=4,
    dtype="bfloat16",
    num_blocks=6,
    device="cuda:0",
)
HANDLE = DeviceHandle(
    device=0,
    handle=b"\x00\x01handle\xff",
    size=pool_bytes(GEOMETRY),
    offset=0,
    ref_counter_handle=b"/torch_1_counter",
    ref_counter_offset=3,
    event_handle=b"\x07event",
    event_sync_required=True,
)


def test_a_device_grant_crosses_the_socket_as_msgpack_bytes_and_all():
    grant = PoolGranted(
        protocol_version=PROTOCOL_VERSION,
        pool_id="abc",
        generation=2,
        geometry=GEOMETRY,
        device_handle=HANDLE,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(grant), type=PoolGranted)
    assert decoded == grant and decoded.device_handle.handle == b"\x00\x01handle\xff"
    assert HANDLE.args() == (0, b"\x00\x01handle\xff", HANDLE.size, 0, b"/torch_1_counter", 3,
                             b"\x07event", True)  # fmt: skip
    # The device is part of the layout: a CUDA pool never matches a CPU worker's geometry.
    cpu = msgspec.structs.replace(GEOMETRY, device="cpu")
    assert cpu.layout() != GEOMETRY.layout() and "on cuda:0" in GEOMETRY.describe()


def test_a_holder_that_cannot_allocate_device_memory_refuses_and_keeps_serving(tmp_path):
    holder = Holder("devtest", tmp_path)
    ask = AttachPool(protocol_version=PROTOCOL_VERSION, geometry=GEOMETRY, pid=os.getpid())
    refused = holder.attach(ask)
    assert refused.geometry is None and refused.refusal == "alloc", refused
    assert "cannot allocate 2 layers" in refused.reason and "cuda:0" in refused.reason
    assert holder.pools == {}
    cpu = msgspec.structs.replace(GEOMETRY, device="cpu")
    granted = holder.attach(AttachPool(protocol_version=PROTOCOL_VERSION, geometry=cpu, pid=1))
    assert granted.path and granted.generation == 1 and granted.device_handle is None
    holder.close()


def test_a_handle_that_does_not_open_falls_back_to_a_private_pool():
    grant = PoolGranted(
        protocol_version=PROTOCOL_VERSION,
        pool_id="abc",
        generation=1,
        geometry=GEOMETRY,
        device_handle=HANDLE,
    )
    failed = open_granted(grant, GEOMETRY, any_size=False)
    assert failed.device_pool is None and failed.fallback == "header"
    assert "cannot open the pool's CUDA handle" in failed.reason
    bigger = msgspec.structs.replace(GEOMETRY, num_blocks=7)
    assert open_granted(grant, bigger, any_size=False).fallback == "geometry"
    short = msgspec.structs.replace(grant, device_handle=msgspec.structs.replace(HANDLE, size=8))
    assert "covers 8 bytes" in open_granted(short, GEOMETRY, any_size=False).reason


def test_a_device_pool_is_fenced_until_its_last_worker_has_exited():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = started(child.pid)
        assert not exited(child.pid) and not exited(child.pid, start)
        assert exited(child.pid, start + 1)  # its pid, another process's start: reused
        os.kill(child.pid, signal.SIGKILL)
        # Wait for the exit without reaping it: a zombie has closed its files (the GPU's too).
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        with open(f"/proc/{child.pid}/stat") as stat:
            assert stat.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert exited(child.pid) and exited(child.pid, start)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert exited(child.pid)  # reaped: no such process


def _cache(flat: torch.Tensor) -> KVCache:
    """A device-pool cache over ``flat``, on this CPU: the sums' code runs as on a GPU."""
    cpu = msgspec.structs.replace(GEOMETRY, device="cpu")
    return KVCache(
        num_layers=2,
        num_blocks=6,
        block_size=4,
        n_kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        device="cpu",
        pool="device",
        attachment=Attachment(pool_id="abc", generation=2, geometry=cpu, device_pool=flat),
    )


def test_a_device_pool_cache_keeps_what_the_holder_memory_holds():
    flat = torch.zeros(pool_bytes(GEOMETRY), dtype=torch.uint8)
    flat[:64] = 7  # a lost worker's K/V
    cache = _cache(flat)
    assert cache.pool.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert (cache.pool.view(torch.uint8).flatten()[:64] == 7).all()  # not zeroed at attach
    cache.pool[1, 1, 1, 5] = 3.0
    assert flat.view(torch.bfloat16).view(cache.pool.shape)[1, 1, 1, 5].eq(3.0).all()


def test_weighted_sums_name_the_block_and_the_slots_that_changed():
    generator = torch.Generator().manual_seed(7)
    flat = torch.randint(0, 256, (pool_bytes(GEOMETRY),), dtype=torch.uint8, generator=generator)
    cache = _cache(flat)
    blocks, ranges = [0, 3, 5], [(1, 0, 3), (4, 2, 4)]
    before = cache.asked_sums(blocks, ranges)
    queued = cache.queue_sums(blocks, ranges)
    assert cache.written_sums(blocks, ranges, queued) == before  # the step's path, the same
    assert all(0 <= value < PRIME for _, value in before[0])
    # One byte of block 3, layer 1's V: that block's sum alone changes.
    cache.pool[1, 1, 0, 3, 2].view(torch.uint8)[5] ^= 0x10
    after = cache.asked_sums(blocks, ranges)
    assert [a == b for a, b in zip(before[0], after[0], strict=True)] == [True, False, True]
    assert after[1] == before[1]
    # A byte of slot 2 of block 1 (inside the range [0, 3)), then of slot 0 of block 4 (outside
    # the range [2, 4)).
    cache.pool[0, 0, 1, 1, 2].view(torch.uint8)[0] ^= 0x01
    cache.pool[0, 0, 1, 4, 0].view(torch.uint8)[0] ^= 0x01
    changed = cache.asked_sums(blocks, ranges)[1]
    assert [a == b for a, b in zip(after[1], changed, strict=True)] == [False, True]


def test_weighted_sums_depend_on_the_bytes_and_their_places_only():
    pool = torch.zeros(2, 2, 2, 7, 4, 8, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(11)
    block = torch.randn(2, 2, 2, 4, 8, generator=generator).to(torch.bfloat16)
    pool[:, :, :, 1], pool[:, :, :, 6] = block, block
    sums = WeightedSums(pool, 4)
    one, six = sums.of([1, 6], []).tolist()
    assert one == six  # the same bytes in another block: the same sum
    first, second = pool[0, 0, 0, 6, 0, 0:2].clone(), pool[0, 0, 0, 6, 0, 2:4].clone()
    assert not torch.equal(first, second)
    pool[0, 0, 0, 6, 0, 0:2], pool[0, 0, 0, 6, 0, 2:4] = second, first  # two words trade places
    assert sums.of([6], []).item() != one
    with pytest.raises(IndexError):
        sums.of([9], [])  # outside the pool: asked_sums leaves such ids out first
