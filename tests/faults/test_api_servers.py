"""``nanoserve frontend --api-servers N``'s manager (``nanoserve.api_servers``): it keeps N
children, each told its index; a killed one is restarted and the others are left alone;
SIGTERM reaches every child; a child that gives up (exit 2) ends the rest; and a SIGKILLed
manager takes its children with it. The children are small shell loops, so this runs in
seconds; the real frontends are in tests/e2e/test_api_servers.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.api_servers import INDEX_VARIABLE, ApiServers

# The manager, in a process of its own (its signal handlers need a main thread): argv[1] is
# the child's shell script, argv[2] the count.
_MANAGER = """
import os, sys
from nanoserve.api_servers import ApiServers
manager = ApiServers(int(sys.argv[2]), dict(os.environ), ("sh", "-c", sys.argv[1]), 0.05)
manager.install_signal_handlers()
sys.exit(manager.run())
"""


def _child(directory: Path, extra: str = "") -> str:
    """A child that writes its pid to <index>.pid and exits 0 on SIGTERM."""
    pid_file = f"{directory}/${INDEX_VARIABLE}.pid"
    return (
        f"{extra} trap 'exit 0' TERM; echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file};"
        " while true; do sleep 0.05; done"
    )


def _manager(script: str, count: int) -> subprocess.Popen:
    command = [sys.executable, "-c", _MANAGER, script, str(count)]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def _pids(directory: Path, count: int, other_than: dict[int, int] | None = None) -> dict[int, int]:
    """Each child's pid, once every index has one (other than ``other_than``'s, where given)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = {}
        for index in range(count):
            path = directory / f"{index}.pid"
            if path.exists() and path.read_text().strip():
                found[index] = int(path.read_text())
        changed = other_than is None or any(found.get(i) != p for i, p in other_than.items())
        if len(found) == count and changed:
            return found
        time.sleep(0.02)
    raise AssertionError(f"children's pids not written: {found}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _end(process: subprocess.Popen, directory: Path, count: int) -> None:
    """Whatever the test left: SIGKILL the manager and every child by pid."""
    if process.poll() is None:
        process.kill()
        process.communicate()
    for index in range(count):
        path = directory / f"{index}.pid"
        if path.exists() and _alive(int(path.read_text())):
            os.kill(int(path.read_text()), signal.SIGKILL)


def test_a_killed_child_is_restarted_alone_and_sigterm_reaches_all(tmp_path):
    manager = _manager(_child(tmp_path), 3)
    try:
        first = _pids(tmp_path, 3)
        os.kill(first[1], signal.SIGKILL)
        second = _pids(tmp_path, 3, other_than={1: first[1]})
        assert second[0] == first[0] and second[2] == first[2]  # the others untouched
        assert second[1] != first[1]
        manager.send_signal(signal.SIGTERM)
        _, err = manager.communicate(timeout=20)
        assert manager.returncode == 0, err
        assert _gone(second.values())
        assert "nanoserve frontend 2 of 3: child exited with -9" in err
        assert err.count("started pid") == 4  # three, and the one restarted
    finally:
        _end(manager, tmp_path, 3)


def test_a_child_that_gives_up_ends_the_others(tmp_path):
    # Index 1 exits 2 (a usage error, as a frontend whose port is taken) once the others run.
    wait = f"[ ${INDEX_VARIABLE} = 1 ] && sleep 0.3 && exit 2;"
    manager = _manager(_child(tmp_path, wait), 3)
    try:
        _, err = manager.communicate(timeout=20)
        assert manager.returncode == 2, err
        assert "frontend 2 of 3: child exited with 2: not restarting" in err
        pids = [int((tmp_path / f"{i}.pid").read_text()) for i in (0, 2)]
        assert _gone(pids)
    finally:
        _end(manager, tmp_path, 3)


def test_a_sigkilled_manager_takes_its_children_with_it(tmp_path):
    manager = _manager(_child(tmp_path), 2)
    try:
        pids = _pids(tmp_path, 2)
        manager.kill()
        manager.communicate(timeout=10)
        assert _gone(pids.values())  # none is left holding the port
    finally:
        _end(manager, tmp_path, 2)


def test_each_child_is_told_its_index_and_the_options():
    manager = ApiServers(2, {"NANOSERVE_PORT": "8123"}, ("true",))
    environments = [s.config.env for s in manager.supervisors]
    assert [e[INDEX_VARIABLE] for e in environments] == ["0", "1"]
    assert all(e["NANOSERVE_PORT"] == "8123" for e in environments)
    labels = [s.config.label for s in manager.supervisors]
    assert labels == ["frontend 1 of 2", "frontend 2 of 2"]
    with pytest.raises(ValueError, match="at least 2"):
        ApiServers(1, {})


@pytest.mark.parametrize("servers", ["1", "2"])
def test_a_port_held_by_another_program_is_a_one_line_exit_2(servers):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        command = [sys.executable, "-m", "nanoserve.cli", "frontend", "--port", str(port)]
        command += ["--api-servers", servers, "--run-id", f"held{os.getpid()}", "--no-pin-cpu"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "cannot listen" in line]
    assert lines and f"on 127.0.0.1:{port}" in lines[0], done.stderr[-2000:]
    assert "address already in use" in lines[0].lower()
