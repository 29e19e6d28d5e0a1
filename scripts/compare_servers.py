"""The servers ``scripts/compare.py`` measures: nanoserve's three processes and llama.cpp's
``llama-server``, each started on a free loopback port, waited for, and ended by PID.

llama.cpp comes from a package registry only: the ``llama-cpp-python`` sdist on PyPI vendors
llama.cpp's whole source tree, ``tools/server`` included, and cmake builds just the
``llama-server`` target from it (no git clone, no other download).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
ROLES = ("scheduler", "worker", "frontend")
REPO = Path(__file__).resolve().parent.parent


def bench_serve(url: str, flags: list[str], out: Path, timeout: float) -> dict | None:
    """One ``nanoserve bench serve --base-url url ...flags --json out`` run, its full report
    kept beside ``out`` (``.log``): the JSON report, or None when it took over ``timeout``
    seconds (a server that collapsed: the caller says so, and goes on)."""
    command = [sys.executable, "-m", "nanoserve.cli", "bench", "serve", "--base-url", url]
    command += [*flags, "--json", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        try:
            subprocess.run(
                command, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return None
    return json.loads(out.read_text())


def markdown_row(row: dict, columns: tuple) -> str:
    """One row as a Markdown table row of ``columns`` ((title, key, format) each); cells the
    row lacks read ``-``."""
    cells = []
    for _, key, fmt in columns:
        value = row.get(key)
        cells.append("-" if value is None else fmt.format(value))
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: list[dict], columns: tuple) -> str:
    """The rows as one Markdown table of ``columns``."""
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    return "\n".join([head, "|" + "---|" * len(columns), *(markdown_row(r, columns) for r in rows)])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A set of started processes answering HTTP on ``url``; ``stop`` ends them by PID."""

    def __init__(self, name: str, port: int, log_dir: Path) -> None:
        self.name, self.port, self.log_dir = name, port, log_dir
        self.processes: list[subprocess.Popen] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, label: str, command: list[str], env: dict[str, str]) -> None:
        """Start one process, its output going to <log_dir>/<label>.log."""
        with open(self.log_dir / f"{label}.log", "ab") as log:
            self.processes.append(
                # A session of its own, as if started from its own terminal: with autogroup,
                # sessions share the CPU first (scripts/noisy_neighbour.py).
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def wait_ready(self, path: str, timeout: float) -> None:
        """Block until ``path`` answers 200; raise with the log directory if a process died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p for p in self.processes if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{self.name}: a process exited; see {self.log_dir}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2.0) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass  # not listening, or still loading (llama-server answers 503)
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_dir}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process, then SIGKILL what is still alive."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()


def start_nanoserve(
    dtype: str,
    log_dir: Path,
    threads: int | None,
    compile: bool = False,
    extra_env: dict[str, str] | None = None,
) -> Server:
    """Scheduler, worker and frontend, configured through NANOSERVE_* variables (``extra_env``
    adds more). A compiled worker's first start compiles for minutes (later ones read
    inductor's cache)."""
    server = Server(f"nanoserve {dtype}", free_port(), log_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    env.update(
        NANOSERVE_RUN_ID=f"cmp{os.getpid()}-{uuid.uuid4().hex[:6]}",
        NANOSERVE_PORT=str(server.port),
        NANOSERVE_DTYPE=dtype,
    )
    if threads is not None:
        env["NANOSERVE_THREADS"] = str(threads)
    if compile:
        env["NANOSERVE_COMPILE"] = "1"
    try:
        for role in ROLES:
            server.spawn(role, [sys.executable, "-m", "nanoserve.cli", role], env)
        server.wait_ready("/health", timeout=900 if compile else 300)
    except BaseException:
        server.stop()
        raise
    return server


class ReadmeServer(Server):
    """``make serve`` in the repository root, exactly as the README starts it (its ``.env``, its
    port): one process group, ended together."""

    def spawn(self, label: str, command: list[str], env: dict[str, str]) -> None:
        with open(self.log_dir / f"{label}.log", "ab") as log:
            self.processes.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # honcho and its children: one group to end
                )
            )

    def stop(self, timeout: float = 20.0) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever honcho left behind
            except ProcessLookupError:
                pass
            process.wait()


def start_as_readme(log_dir: Path, port: int = 8000) -> ReadmeServer:
    """The README's server command (``make serve``, no flags, the committed ``.env``); returns
    once the process group is started, not once it answers (the caller times that)."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is taken: the README's server needs it")
    server = ReadmeServer("nanoserve (README)", port, log_dir)
    server.spawn("make-serve", ["make", "serve"], dict(os.environ, PYTHONUNBUFFERED="1"))
    return server


def start_llama_server(
    binary: Path,
    gguf: Path,
    log_dir: Path,
    slots: int,
    threads: int,
    slot_context: int = 512,
    extra: Sequence[str] = (),
):
    """llama-server on the same GGUF: ``slots`` parallel slots, continuous batching, each slot
    with room for ``slot_context`` tokens, and its defaults otherwise (``cache_prompt`` on: a
    slot reuses the K/V of its previous prompt); ``extra`` flags after those (``--spec-type
    ngram-simple``)."""
    server = Server("llama.cpp", free_port(), log_dir)
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(server.port)]
    command += ["-np", str(slots), "-c", str(slot_context * slots), "-cb", "-t", str(threads)]
    # Enough HTTP threads for every client: with the default (about one per slot) connections
    # beyond them are refused, which is failure, not queueing.
    command += ["--threads-http", "64", *extra]
    try:
        server.spawn("llama-server", command, dict(os.environ))
        server.wait_ready("/health", timeout=120)
    except BaseException:
        server.stop()
        raise
    return server


def build_llama_server(cache_dir: Path) -> tuple[Path, float]:
    """Build (or reuse) ``llama-server`` from the llama-cpp-python sdist; returns the binary
    and the seconds the build took (0 when it was already built)."""
    binary = cache_dir / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary, 0.0
    began = time.monotonic()
    cache_dir.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*download, LLAMA_CPP_PYTHON, "-d", str(cache_dir)], check=True)
    sdist = next(cache_dir.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        archive.extractall(cache_dir, filter="data")
    source = next(cache_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF"]
    build = cache_dir / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, *flags], check=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    return binary, time.monotonic() - began
