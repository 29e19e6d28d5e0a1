"""Supervisor: keep one child process running, restarting it with exponential backoff.

honcho (and ``nanoserve serve``) stop everything when any process exits, so the worker and the
scheduler run under this small supervisor: a crash costs a restart, not the whole server.

- The child exits 0: the supervisor exits 0 (it was asked to stop, or had nothing to do).
- The child exits 2: a usage error, which a restart would only repeat; the supervisor exits 2.
- Anything else (a crash, a signal): restart after a backoff that doubles from ``initial_backoff``
  up to ``max_backoff``, and falls back to ``initial_backoff`` after a run of ``healthy_after``.
- SIGTERM or SIGINT to the supervisor goes to the child; the supervisor then exits with the
  child's code (128 + N for a child ended by signal N), and never restarts it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

USAGE_ERROR = 2
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class SupervisorConfig:
    """What to run and how patiently to restart it."""

    command: tuple[str, ...]
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    healthy_after: float = 30.0
    pid_file: Path | None = None  # the current child's PID, rewritten at every start
    env: dict[str, str] | None = None  # the child's environment (None: this process's)
    label: str = "supervise"  # names this supervisor in its messages
    die_with_parent: bool = False  # the child gets SIGKILL when the thread that started it ends

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("supervise needs a command to run (after --)")
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError("backoffs must satisfy 0 < initial_backoff <= max_backoff")
        if self.healthy_after <= 0:
            raise ValueError(f"healthy_after must be > 0, got {self.healthy_after}")


class Supervisor:
    """Runs ``config.command`` until it exits 0 or 2, or until a signal asks it to stop."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.child: subprocess.Popen | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._signal: int | None = None

    def install_signal_handlers(self) -> None:
        """Forward SIGTERM and SIGINT to the child (main thread only)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.forward(signum)

    def forward(self, signum: int) -> None:
        """Stop supervising: send ``signum`` to the child, and never restart it."""
        self._signal = signum
        self._stop.set()
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def run(self) -> int:
        """Supervise until done; returns the exit status for the supervisor itself."""
        backoff = self.config.initial_backoff
        while True:
            started = time.monotonic()
            code = self._run_once()
            lived = time.monotonic() - started
            if self._stop.is_set():
                return _status(code)
            if code in (0, USAGE_ERROR):
                self._say(f"child exited with {code}: not restarting")
                return code
            if lived >= self.config.healthy_after:
                backoff = self.config.initial_backoff
            self._say(f"child exited with {code} after {lived:.1f} s; restarting in {backoff:g} s")
            if self._stop.wait(backoff):
                return _status(code)
            backoff = min(backoff * 2, self.config.max_backoff)
            self.restarts += 1

    def _run_once(self) -> int:
        preexec = _die_with_parent(os.getpid()) if self.config.die_with_parent else None
        self.child = subprocess.Popen(self.config.command, env=self.config.env, preexec_fn=preexec)
        self._say(f"started pid {self.child.pid}: {' '.join(self.config.command)}")
        if self.config.pid_file is not None:
            temporary = self.config.pid_file.with_suffix(".tmp")
            temporary.write_text(f"{self.child.pid}\n")
            os.replace(temporary, self.config.pid_file)  # readers never see a half-written file
        if self._signal is not None and self.child.poll() is None:
            self.child.send_signal(self._signal)  # a signal that came while we were starting
        return self.child.wait()

    def _say(self, text: str) -> None:
        print(f"nanoserve {self.config.label}: {text}", file=sys.stderr, flush=True)


def _die_with_parent(parent: int):
    """A ``preexec_fn``: the child gets SIGKILL when the thread that starts it ends (Linux's
    PR_SET_PDEATHSIG), and exits at once if its parent is already gone."""

    def arm() -> None:
        prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _status(code: int) -> int:
    """A shell's exit status for a child's return code (negative means ended by a signal)."""
    return 128 - code if code < 0 else code
