"""Where the processes find each other: ZeroMQ endpoints, all bound by the scheduler.

By default they are ipc:// sockets in a per-user runtime directory created with 0700
permissions, so no other user on the machine can connect. ``tcp`` mode binds 127.0.0.1 only.
A ``run_id`` suffix keeps parallel test runs apart.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Addresses:
    """The scheduler's two ROUTER endpoints (frontends and the worker connect to them) and its
    monitor feed for the web page (an XPUB that frontends subscribe to; None: no feed), and
    the KV pool holder's endpoint (``holder/``; always ipc: it shares memory with the worker,
    so it is on the same machine)."""

    frontend: str
    worker: str
    monitor: str | None = None
    holder: str | None = None

    def __post_init__(self) -> None:
        for name in ("frontend", "worker", "monitor", "holder"):
            value = getattr(self, name)
            if value is None and name in ("monitor", "holder"):
                continue
            if not value.startswith(("ipc://", "tcp://", "inproc://")):
                raise ValueError(f"{name} address must be ipc://, tcp:// or inproc://: {value}")


def runtime_dir() -> Path:
    """A private (0700) directory for ipc sockets: $XDG_RUNTIME_DIR/nanoserve or /tmp."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"nanoserve-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    # A directory someone else made (or widened) could let them talk to our sockets.
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(f"runtime directory {path} must be owned by you with mode 0700")
    return path


def default_addresses(
    run_id: str = "default", transport: str = "ipc", port: int = 5610
) -> Addresses:
    """Endpoints for one server instance. ``transport`` is "ipc" or "tcp" (127.0.0.1 only)."""
    if transport == "ipc":
        directory = runtime_dir()
        return Addresses(
            frontend=f"ipc://{directory}/{run_id}-frontend.sock",
            worker=f"ipc://{directory}/{run_id}-worker.sock",
            monitor=f"ipc://{directory}/{run_id}-monitor.sock",
            holder=f"ipc://{directory}/{run_id}-holder.sock",
        )
    if transport == "tcp":
        return Addresses(
            frontend=f"tcp://127.0.0.1:{port}",
            worker=f"tcp://127.0.0.1:{port + 1}",
            monitor=f"tcp://127.0.0.1:{port + 2}",
            holder=f"ipc://{runtime_dir()}/{run_id}-holder.sock",
        )
    raise ValueError(f"unknown transport {transport!r} (use ipc or tcp)")
