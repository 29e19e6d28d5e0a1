"""``PoolFile``: one shared K/V pool as a file in /dev/shm, created and owned by the holder.

The file is private to the user (created 0600, O_EXCL) and named after the run id, so a holder
that starts finds and removes the files a killed holder of the same run left behind. Its pages
read as zero until written (a sparse tmpfs file), like the worker's private pool.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from protocol.kv_pool import HEADER_BYTES, PoolGeometry, pack_header, pool_bytes

SHM = Path("/dev/shm")


def pool_directory() -> Path:
    """/dev/shm where it exists (memory, not disk), else the private runtime directory."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        return SHM
    from protocol.addresses import runtime_dir

    return runtime_dir()


def pool_prefix(run_id: str) -> str:
    """The start of every pool file's name for this user and run."""
    return f"nanoserve-{os.getuid()}-{run_id}-kv-"


def remove_stale(run_id: str, directory: Path | None = None) -> list[Path]:
    """Remove the pool files of this run that a killed holder left; returns them."""
    directory = directory or pool_directory()
    stale = sorted(directory.glob(pool_prefix(run_id) + "*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class PoolFile:
    """One pool's file: its geometry, id and generation, the header rewritten at each attach."""

    def __init__(self, run_id: str, geometry: PoolGeometry, directory: Path | None = None):
        self.geometry = geometry
        self.pool_id = secrets.token_hex(8)  # 16 characters: the header's id field
        self.generation = 0
        self.path = (directory or pool_directory()) / (pool_prefix(run_id) + self.pool_id)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self._fd, HEADER_BYTES + pool_bytes(geometry))
        except OSError:
            self.close()
            raise
        self._write_header()

    def attach(self) -> int:
        """A worker maps the pool: bump the generation (in the header too) and return it."""
        self.generation += 1
        self._write_header()
        return self.generation

    def _write_header(self) -> None:
        os.pwrite(self._fd, pack_header(self.geometry, self.pool_id, self.generation), 0)

    def close(self) -> None:
        """Remove the file: its memory returns once no worker maps it."""
        os.close(self._fd)
        self.path.unlink(missing_ok=True)
