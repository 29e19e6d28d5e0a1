"""``DevicePool``: one shared K/V pool in CUDA memory, allocated and owned by the holder.

The holder allocates the pool's bytes on the worker's GPU, zeroed, and exports them through a
CUDA IPC handle (``protocol.kv_pool.DeviceHandle``) that each worker it grants the pool to
opens (``worker.kv.device_pool``). The memory lives as long as the holder: a worker's death
leaves every block of K/V in it. torch is imported only here, and only when a worker asks for
a device pool: a holder of CPU pools never loads it.

Two processes must never write one pool. A CPU pool's holder knows its last worker is gone once
that process stops mapping the file; CUDA memory opened through a handle shows in no map, so
here the last worker is gone once its process has exited: it no longer exists, it is a zombie,
or its pid names a process that started later. A process becomes a zombie only after its exit
has closed its files, the GPU's among them, and the driver destroys a process's CUDA context,
its queued kernels with it, when that happens (a driver that defers that teardown, or a child
that inherited the GPU's files, would break this: neither is nanoserve's worker).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from protocol.kv_pool import DeviceHandle, PoolGeometry, pool_bytes


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (state first), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last.
    return stat[stat.rindex(")") + 2 :].split()


def started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if there is none: with
    the pid, it names the process (a pid is reused once its process is reaped)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def exited(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` (the one that started at ``start``, where given) has exited: it
    is gone, a zombie (state Z or X), or another process now has its pid."""
    fields = _stat(pid)
    if fields is None or fields[0] in "ZX":
        return True
    return start is not None and int(fields[19]) != start


class DevicePool:
    """One rank's pool in the memory of ``geometry.device``, zeroed, and its export."""

    def __init__(self, geometry: PoolGeometry) -> None:
        # CUDA IPC cannot export memory of torch's expandable segments: this process's
        # allocator must hand out plain allocations, whatever the environment asked for.
        settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments" in settings:
            kept = [s for s in settings.split(",") if not s.startswith("expandable_segments")]
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)
        import torch

        self.geometry = geometry
        self.pool_id = secrets.token_hex(8)
        self.generation = 0
        # Zero from the start, as a worker's private pool: a padded read of a block nothing
        # wrote yet must see finite numbers.
        self.tensor = torch.zeros(pool_bytes(geometry), dtype=torch.uint8, device=geometry.device)
        torch.cuda.synchronize(self.tensor.device)
        self.path = f"{geometry.device} pool {self.pool_id}"  # what the holder's log names

    def attach(self) -> int:
        """A worker opens the pool: bump the generation and return it."""
        self.generation += 1
        return self.generation

    def export(self) -> DeviceHandle:
        """A handle for one more worker: each export has its own reference counter slot."""
        fields = self.tensor.untyped_storage()._share_cuda_()
        device, handle, size, offset, counter, counter_offset, event, sync = fields
        return DeviceHandle(
            device=device,
            handle=handle,
            size=size,
            offset=offset,
            ref_counter_handle=counter,
            ref_counter_offset=counter_offset,
            event_handle=event or b"",
            event_sync_required=bool(sync),
        )

    def close(self) -> None:
        """Drop the holder's reference (the holder is going). torch frees the memory once every
        worker it was exported to has released it; a killed worker never does, so the memory
        goes with the holder's CUDA context, when the holder exits."""
        self.tensor = None
