"""``HostPool``: the CPU K/V pool's memory, zero from the start and made resident behind serving.

The pool is an anonymous private mapping, so every page reads as zero before anything writes it
(the kernel guarantees it), and the worker announces itself without touching it. Zeroing it up
front was the worker's whole start on some machines: 4.3 GB is about a million 4 KiB pages, and
in a guest where a first touch costs 10-18 us it took 16-27 s (docs/performance.md).

Once the worker has loaded its compiled steps (they load faster without it), a thread asks the
kernel to back the pages (``MADV_POPULATE_WRITE``, Linux 5.14), the low block ids first, since
the allocator hands those out first. Populating never changes a page's contents, so it needs no
coordination with the steps writing K/V meanwhile; a step that meets a page not yet populated
faults it in itself, as any first write would. The thread backs pages only while the worker is
idle (``busy``, asked before each call of half a MiB), so it takes no CPU from the steps. Once
it is done, the whole budget is resident and memory stays flat however blocks are reused. On a
kernel without the call, pages are backed as blocks are first written.

The thread runs at the process's own priority, not niced. The last thread of a killed process
to exit unmaps its memory, gigabytes here: a thread at nice 19 on a busy machine got so little
CPU that a SIGKILLed worker took 62 s to die (ad hoc), holding its memory while its
replacement started.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger("worker")

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it before 3.13
_BLOCKS_A_CALL = 256  # with 2 KiB a block and slice, 512 KiB a madvise: a short syscall
_BUSY_RECHECK_S = 0.05  # how long the thread waits before asking ``busy`` again


class HostPool:
    """``shape``'s tensor over a fresh mapping, seen as (slices, blocks, block bytes) when
    populating, where ``slices`` is every dimension before the block axis. ``resident`` is set
    once ``populate`` has backed every page, found the kernel cannot be asked to, or was
    stopped (``populate_s`` stays None then)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        block_axis: int,
        dtype: torch.dtype,
        mapping: mmap.mmap | None = None,
        offset: int = 0,
    ) -> None:
        """A fresh private mapping, or the pool's bytes at ``offset`` (page-aligned) of
        ``mapping``, a shared one (``worker.kv.shared``)."""
        element = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for size in shape:
            numel *= size
        if mapping is None:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            mapping = mmap.mmap(-1, numel * element, flags=flags)
        self._map, self._offset = mapping, offset
        tensor = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)
        self.tensor = tensor.view(shape)
        slices = 1
        for size in shape[:block_axis]:
            slices *= size
        block_bytes = numel * element // slices // shape[block_axis]
        self._geometry = (slices, shape[block_axis], block_bytes)
        self.resident = threading.Event()
        # Set by ``stop``: the thread ends at its next call, and with it its references to the
        # pool and to ``busy``'s owner (a worker dropped in-process is then freed, not backed).
        self._stopped = threading.Event()
        self.populate_s: float | None = None  # from the first call to the last, waits included
        self.waited_s = 0.0  # of which waiting for the worker to be idle

    def populate(
        self, after: Callable[[], object] | None = None, busy: Callable[[], bool] | None = None
    ) -> None:
        """Start backing every page in a thread, once ``after`` (if given) returns, and only
        while ``busy`` (if given) says False; returns at once. Until then, pages are backed as
        steps first write them."""
        threading.Thread(
            target=self._populate, args=(after, busy), name="kv-populate", daemon=True
        ).start()

    def stop(self) -> None:
        """End the populating thread at its next call (within ``_BUSY_RECHECK_S`` while it
        waits for idle); pages already backed stay backed until the mapping goes."""
        self._stopped.set()

    def _populate(
        self, after: Callable[[], object] | None, busy: Callable[[], bool] | None
    ) -> None:
        """Back every page, a run of blocks at a time across all slices, lowest ids first."""
        if after is not None:
            after()
        slices, blocks, block_bytes = self._geometry
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map)) + self._offset
        began = time.perf_counter()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        page = mmap.PAGESIZE
        slice_bytes = blocks * block_bytes
        try:
            for first in range(0, blocks, _BLOCKS_A_CALL):
                end = min(blocks, first + _BLOCKS_A_CALL) * block_bytes
                for index in range(slices):
                    while busy is not None and busy() and not self._stopped.is_set():
                        paused = time.perf_counter()
                        time.sleep(_BUSY_RECHECK_S)
                        self.waited_s += time.perf_counter() - paused
                    if self._stopped.is_set():
                        return
                    start = base + index * slice_bytes + first * block_bytes
                    aligned = start - start % page  # madvise wants a page-aligned start
                    length = base + index * slice_bytes + end - aligned
                    if libc.madvise(aligned, length, MADV_POPULATE_WRITE) != 0:
                        error = ctypes.get_errno()
                        log.info(
                            "KV pool: pages are backed as blocks are first written (%s)",
                            os.strerror(error),
                        )
                        return
            self.populate_s = time.perf_counter() - began
            log.info(
                "KV pool resident: %.1f GiB backed in %.1f s (%.1f s of it waiting for idle)",
                slices * slice_bytes / 2**30,
                self.populate_s,
                self.waited_s,
            )
        finally:
            self.resident.set()
