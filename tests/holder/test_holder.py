"""The pool holder and a worker's attach, without a model: a real ``nanoserve kv-holder``
process grants one private /dev/shm file, bumps its generation at every attach, refuses another
geometry or a second live worker with the reason, and its pool's bytes outlive the mapping that
wrote them. A killed holder's file is removed by the next holder of the run."""

from __future__ import annotations

import logging
import mmap
import os
import signal
import stat
import threading
from pathlib import Path

import pytest
import torch

from holder.pool_file import pool_directory, pool_prefix
from holder.process import Holder
from protocol.kv_pool import HEADER_BYTES, PROTOCOL_VERSION, AttachPool, PoolGeometry
from tests.servers import new_server, start_server
from worker.kv.cache import KVCache
from worker.kv.shared import attach

GEOMETRY = PoolGeometry(
    num_layers=2, n_kv_heads=2, head_dim=8, block_size=4, dtype="float32", num_blocks=6
)


@pytest.fixture
def holder(tmp_path):
    """A real holder process on a run of its own (ended by PID)."""
    server = start_server(tmp_path, roles=("kv-holder",))
    address = server_address(server.run_id)
    try:
        server.wait_log("kv-holder", "pool holder pid", timeout=30.0)
        yield server, address
    finally:
        server.stop()


def server_address(run_id: str) -> str:
    from protocol.addresses import default_addresses

    return default_addresses(run_id).holder


def files(run_id: str) -> list[Path]:
    return sorted(pool_directory().glob(pool_prefix(run_id) + "*"))


def test_a_grant_is_a_private_file_whose_generation_counts_attaches(holder) -> None:
    server, address = holder
    first = attach(address, GEOMETRY, any_size=False)
    assert first.mapping is not None, first.reason
    assert (first.generation, first.fallback, first.reused) == (1, "", False)
    [path] = files(server.run_id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = attach(address, GEOMETRY, any_size=False)  # the same pid: it may attach again
    assert (again.pool_id, again.generation, again.reused) == (first.pool_id, 2, True)


def test_k_v_written_through_one_mapping_is_read_through_the_next(holder) -> None:
    _, address = holder
    shape = dict(num_layers=2, num_blocks=6, block_size=4, n_kv_heads=2, head_dim=8)
    first = KVCache(
        **shape,
        dtype=torch.float32,
        device="cpu",
        attachment=attach(address, GEOMETRY, any_size=False),
    )
    torch.manual_seed(0)
    first.pool[:, :, :, 3] = torch.randn_like(first.pool[:, :, :, 3])
    written = first.pool[:, :, :, 3].clone()
    second = KVCache(
        **shape,
        dtype=torch.float32,
        device="cpu",
        attachment=attach(address, GEOMETRY, any_size=False),
    )
    assert torch.equal(second.pool[:, :, :, 3], written)
    assert not second.pool[:, :, :, 2].any()  # never written: zero


def test_another_geometry_is_refused_with_the_reason(holder) -> None:
    _, address = holder
    attach(address, GEOMETRY, any_size=False)
    other = PoolGeometry(**{**_fields(GEOMETRY), "dtype": "bfloat16"})
    refused = attach(address, other, any_size=False)
    assert refused.mapping is None and refused.fallback == "geometry"
    assert "float32" in refused.reason and "bfloat16" in refused.reason
    bigger = PoolGeometry(**{**_fields(GEOMETRY), "num_blocks": 9})
    assert attach(address, bigger, any_size=False).fallback == "geometry"
    adopted = attach(address, bigger, any_size=True)  # a budget's count: the pool's will do
    assert adopted.geometry is not None and adopted.geometry.num_blocks == 6


def test_no_holder_is_a_fallback_not_an_error(tmp_path) -> None:
    address = f"ipc://{tmp_path}/nobody.sock"
    result = attach(address, GEOMETRY, any_size=False, start_s=0.2)
    assert (result.mapping, result.fallback) == (None, "no_holder")
    assert f"no pool holder at {address} after 0.2 s" in result.reason
    (tmp_path / "nobody.sock").touch()  # a killed holder's socket file: nobody answers it
    result = attach(address, GEOMETRY, any_size=False, timeout_s=0.2)
    assert (result.mapping, result.fallback) == (None, "no_holder")
    assert "no pool holder answered" in result.reason


def test_a_holder_that_binds_after_the_worker_asks_is_waited_for(tmp_path, caplog) -> None:
    """``serve`` starts the holder beside the worker: on a loaded machine the worker may ask
    before the holder has bound its socket, and must get the pool, not a private one."""
    server = new_server(tmp_path)
    address = server_address(server.run_id)
    waiting = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for the pool holder" in record.getMessage():
                waiting.set()

    seen = Seen()
    caplog.set_level(logging.INFO, logger="nanoserve.worker")
    logging.getLogger("nanoserve.worker").addHandler(seen)
    result: list = []
    # A short answer timeout: only the wait for the socket can let this attach succeed.
    asking = threading.Thread(
        target=lambda: result.append(attach(address, GEOMETRY, any_size=False, timeout_s=0.5))
    )
    try:
        asking.start()
        assert waiting.wait(timeout=10.0), "the attach did not wait for the socket"
        server.start("kv-holder")
        asking.join(timeout=60.0)
        assert not asking.is_alive()
        [granted] = result
        assert granted.mapping is not None, granted.reason
        assert granted.generation == 1
    finally:
        logging.getLogger("nanoserve.worker").removeHandler(seen)
        server.stop()


def test_a_second_worker_is_refused_while_the_first_maps_the_pool(tmp_path) -> None:
    holder = Holder("unit-" + os.urandom(4).hex(), directory=tmp_path)
    try:
        request = AttachPool(protocol_version=PROTOCOL_VERSION, geometry=GEOMETRY, pid=os.getpid())
        granted = holder.attach(request)
        assert granted.generation == 1
        with open(granted.path, "r+b") as file:
            mapping = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED)
        other = AttachPool(protocol_version=PROTOCOL_VERSION, geometry=GEOMETRY, pid=os.getppid())
        refused = holder.attach(other)
        assert refused.refusal == "in_use" and f"pid {os.getpid()}" in refused.reason
        mapping.close()  # as a dying worker's exit detaches its memory
        assert holder.attach(other).generation == 2
        header = (tmp_path / Path(holder.pool.path).name).read_bytes()[:HEADER_BYTES]
        assert header.startswith(b"NSKVPOOL")
    finally:
        holder.close()
    assert not list(tmp_path.iterdir())  # closing removes the file


def test_a_killed_holders_file_is_removed_by_the_next(holder) -> None:
    server, address = holder
    attach(address, GEOMETRY, any_size=False)
    [left] = files(server.run_id)
    process = server.processes["kv-holder"]
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10.0)
    assert left.exists()  # nobody removed it
    mark = server.log_size("kv-holder")
    server.start("kv-holder")
    server.wait_log("kv-holder", "removed .*left by a holder that was killed", mark, 30.0)
    assert not left.exists()
    fresh = attach(address, GEOMETRY, any_size=False)
    assert fresh.generation == 1 and fresh.pool_id not in str(left)


def _fields(geometry: PoolGeometry) -> dict:
    return {name: getattr(geometry, name) for name in geometry.__struct_fields__}
