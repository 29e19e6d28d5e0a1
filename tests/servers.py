"""Start real nanoserve processes for a test, and end them by PID: the one place tests do.

Each server gets its own run id (so its ipc sockets never collide with another run's) and a
free port on 127.0.0.1. Every wait is bounded; ``stop`` SIGTERMs, then SIGKILLs what lingers.
A role started ``supervised`` runs under ``nanoserve supervise``, which writes its child's PID to
<log_dir>/<role>.pid, so a test can kill the child and watch it come back.

``server_fixture(**options)`` makes a module's (or a session's) fixture of a whole stack;
``start_server`` starts a stack, or some of its roles, inside a test; ``Server.join`` is another
process on a running server's sockets.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nanoserve.bench.metrics import samples

ROLES = ("scheduler", "worker", "frontend")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Server:
    """A running set of nanoserve processes."""

    port: int
    run_id: str
    log_dir: Path
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(
        self, role: str, *extra: str, supervised: bool = False, name: str | None = None
    ) -> subprocess.Popen:
        """Start (or restart) one role's process (or ``serve``'s, all three in one tree), its output
        going to <log_dir>/<name>.log (``name``: the role's, unless a second process of one role
        needs its own, a standby worker say)."""
        name = name or role
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        command = [sys.executable, "-m", "nanoserve.cli", role, *extra]
        if supervised:
            pid_file = str(self.pid_file(name))
            supervise = ["supervise", "--initial-backoff", "0.2", "--pid-file", pid_file, "--"]
            command = [sys.executable, "-m", "nanoserve.cli", *supervise, *command]
        process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.processes[name] = process
        return process

    def join(self, log_dir: Path, **options: object) -> Server:
        """Another Server on this one's run (its sockets, its environment plus ``options``) with
        a port of its own and nothing started: a second frontend, say."""
        port = free_port()
        env = {**self.env, **_variables(options), "NANOSERVE_PORT": str(port)}
        log_dir.mkdir(parents=True, exist_ok=True)
        return Server(port=port, run_id=self.run_id, log_dir=log_dir, env=env)

    def pid_file(self, role: str) -> Path:
        """Where a supervised role's supervisor writes its child's PID."""
        return self.log_dir / f"{role}.pid"

    def child_pid(self, role: str, other_than: int | None = None, timeout: float = 60.0) -> int:
        """The supervised child's PID (waiting, bounded, for one other than ``other_than``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = int(self.pid_file(role).read_text())
            except (FileNotFoundError, ValueError):
                pid = None
            if pid is not None and pid != other_than:
                return pid
            time.sleep(0.02)
        raise TimeoutError(f"no new {role} child after {timeout}s\n{self.logs()}")

    def wait_log(self, role: str, pattern: str, after: int = 0, timeout: float = 30.0) -> int:
        """Wait (bounded) for a line matching ``pattern`` in a role's log past byte ``after``;
        returns the byte offset just past the match."""
        path = self.log_dir / f"{role}.log"
        regex = re.compile(pattern.encode())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = regex.search(path.read_bytes(), after) if path.exists() else None
            if found is not None:
                return found.end()
            time.sleep(0.01)
        raise TimeoutError(f"{pattern!r} not in the {role} log after {timeout}s\n{self.logs()}")

    def log_size(self, role: str) -> int:
        """The current size of a role's log: pass it as ``after`` to wait for new lines only."""
        path = self.log_dir / f"{role}.log"
        return path.stat().st_size if path.exists() else 0

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """GET a path; returns (status, body) and never raises for an HTTP status."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def wait_healthy(self, timeout: float = 240.0) -> None:
        """Block until /health answers 200, or raise with the processes' logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if self.get("/health", timeout=2.0)[0] == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy after {timeout}s\n{self.logs()}")

    def check_alive(self) -> None:
        """Raise, with the logs, if any process has exited."""
        for role, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{role} exited with {process.returncode}\n{self.logs()}")

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value} (comments dropped)."""
        status, body = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return samples(body)

    def logs(self, tail: int = 40) -> str:
        """The last lines of every process's log."""
        parts = []
        for role in dict.fromkeys([*ROLES, *self.processes]):
            path = self.log_dir / f"{role}.log"
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {role} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process by PID, then SIGKILL whatever is still alive."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for role, process in self.processes.items():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
                self._kill_orphan(role)

    def _kill_orphan(self, role: str) -> None:
        """A supervised child outlives its SIGKILLed supervisor: end it too."""
        try:
            os.kill(int(self.pid_file(role).read_text()), signal.SIGKILL)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pass


def new_server(log_dir: Path, run_id: str | None = None, **options: object) -> Server:
    """A Server with nothing started yet: a run id of its own (or ``run_id``, whose sockets its
    processes then use), a free port, and NANOSERVE_<OPTION> set from ``options``."""
    port = free_port()
    run_id = run_id or f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env.update({"NANOSERVE_RUN_ID": run_id, "NANOSERVE_PORT": str(port), "PYTHONUNBUFFERED": "1"})
    env.update(_variables(options))
    log_dir.mkdir(parents=True, exist_ok=True)
    return Server(port=port, run_id=run_id, log_dir=log_dir, env=env)


def start_server(
    log_dir: Path,
    roles: tuple[str, ...] = ROLES,
    supervised: tuple[str, ...] = (),
    run_id: str | None = None,
    **options: object,
) -> Server:
    """Start ``roles`` (scheduler, worker and frontend unless told) with NANOSERVE_<OPTION> set
    from ``options``; the roles in ``supervised`` run under ``nanoserve supervise``. A whole
    stack is returned healthy; fewer roles, as soon as they are started."""
    server = new_server(log_dir, run_id, **options)
    try:
        for role in roles:
            server.start(role, supervised=role in supervised)
        if set(ROLES) <= set(roles):
            server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


def server_fixture(
    scope: str = "module",
    after_stop: Callable[[Server], None] | None = None,
    **options: object,
) -> Callable[..., Iterator[Server]]:
    """A fixture of one server started by ``start_server(**options)`` once per ``scope``, its
    logs under a tmp directory named after the fixture; ``after_stop(server)`` runs once it is
    stopped. A module declares each server it needs: ``server = server_fixture(audit=1)``."""

    @pytest.fixture(scope=scope)
    def fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
        running = start_server(tmp_path_factory.mktemp(request.fixturename), **options)
        try:
            yield running
        finally:
            running.stop()
            if after_stop is not None:
                after_stop(running)

    return fixture


def _variables(options: dict[str, object]) -> dict[str, str]:
    """``{"num_slots": 4}`` as ``{"NANOSERVE_NUM_SLOTS": "4"}``."""
    return {f"NANOSERVE_{name.upper()}": str(value) for name, value in options.items()}


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from any of its threads), from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass  # the thread (or the process) ended meanwhile
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def sse_events(raw: bytes) -> list[dict]:
    """Parse an SSE body into its JSON events, checking it ends with ``data: [DONE]``."""
    lines = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
    if not lines or lines[-1] != "data: [DONE]":
        raise AssertionError(f"stream did not end with [DONE]: {lines[-3:]}")
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]
