"""Compiled decode steps without a compile wall: the worker serves eagerly from its first
second, builds the compiled graphs beside it, and switches to them when they are ready.

Building the graphs cold takes minutes of CPU. It runs in a child process at the lowest CPU
priority (``nice 19``, with the worker's thread count), so serving meets it as a polite
neighbour, not as a Python thread fighting for the worker's GIL and cores; the child only fills
inductor's on-disk cache and writes a marker. The worker then loads the graphs from that cache
in a thread of its own (a few seconds of tracing; its steps go on meanwhile) and publishes them
with one assignment. A restarted worker, or the next start, finds the marker and only loads.

The cache lives under ``<cache_root>/inductor/<key>``, the key naming everything that changes
the graphs: torch's version and install directory, the model, the dtype and the K/V's, the 4-bit
limit, the block size, the thread count and the source of the code that is traced.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from models.files import cache_root
from worker.config import WorkerConfig
from worker.plan import Plan

log = logging.getLogger("nanoserve.worker")

# The modules whose code the compiled graph traces (parallel/group.py: the one rank's
# all_reduce; the linear methods the plan gives the layers): a change to any invalidates the
# cache. tests/worker/test_compiled.py checks that no traced worker file is missing.
_TRACED = (
    "compiled/decode.py",
    "model/llama.py",
    "model/ops.py",
    "model/rope.py",
    "linear/base.py",
    "linear/dense.py",
    "linear/four_bit.py",
    "parallel/group.py",
    "attention/base.py",
    "attention/metadata.py",
    "attention/torch_backend.py",
    "attention/cpu_kernel.py",
    "attention/cpu_bf16.py",
    "attention/cpu_f32.py",
)
_MARKER = "compiled.ok"
WORKER = Path(__file__).resolve().parents[1]  # the worker package, where _TRACED lie
# The switch interval while a step runs beside the graphs' loading (see ``step_first``).
STEP_SWITCH_INTERVAL = 50e-6


def compile_dir(config: WorkerConfig, plan: Plan, model_id: str) -> Path:
    """Where the compiled graphs of a worker running ``plan`` are cached (see the module
    docstring). The plan names the dtypes, every linear's method and the thread count (the
    worker's full count, not the one of the moment: beside a neighbour it runs the same graphs
    on one thread)."""
    source = hashlib.sha256()
    for name in _TRACED:
        source.update((WORKER / name).read_bytes())
    parts = (
        torch.__version__,
        # Where torch is installed: inductor keys its C++ builds by their command line, which
        # names torch's include directory, so another venv (a fresh clone's) rebuilt every C++
        # kernel in the worker's own thread (136 s) behind a marker that said "warm".
        str(Path(torch.__file__).resolve().parent),
        model_id,
        # Every choice the graph traces, the thread count among them (inductor splits loops
        # for it when it generates kernels).
        plan.to_json(),
        config.kv_cache_dtype,
        str(config.q4_max_tokens),
        str(config.w4a8),
        str(config.block_size),
        source.hexdigest()[:12],
    )
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return cache_root() / "inductor" / f"{model_id}-{plan.dtype}-{key}"


class BackgroundCompile:
    """Builds a worker's compiled decode graphs while it serves. ``state`` is "compiling",
    "ready" or "failed"; ``result`` holds the ``CompiledDecode`` once ready."""

    def __init__(self, worker, directory: Path) -> None:
        self.worker = worker
        self.directory = directory
        self.state = "compiling"
        self.error: str | None = None
        self.result = None
        self.seconds = 0.0  # until ready (or failed), from start()
        self.cold = not (directory / _MARKER).exists()
        self.loading = False  # this process traces the graphs now (holding the GIL)
        self._thread = threading.Thread(target=self._run, name="compile", daemon=True)

    def start(self) -> None:
        """Begin; returns at once."""
        self._began = time.perf_counter()
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ready or failed (tests); True when ready."""
        self._thread.join(timeout)
        return self.state == "ready"

    def _run(self) -> None:
        try:
            if self.cold:
                self._fill_cache()
            from worker.compiled.decode import CompiledDecode

            worker = self.worker
            self.loading = True
            compiled = CompiledDecode(worker.model, worker.cache, worker.attention)
            compiled.warm_up()  # a cache hit: tracing and loading, not compiling
            self.result = compiled
            state = "ready"
        except Exception as exc:  # the worker serves eagerly on; say why, once
            self.error = f"{type(exc).__name__}: {exc}"
            state = "failed"
            log.error("compiled decode steps failed to build (%s); steps stay eager", self.error)
        self.loading = False
        self.seconds = time.perf_counter() - self._began
        self.state = state  # last: the worker's thread reads the rest once it sees this
        if state == "ready":
            # Said here too: the worker switches (and logs it) at its next step, which an idle
            # server may not take for a long time.
            log.info(
                "compiled decode steps ready (%s in %.1f s), used from the next step",
                self.how,
                self.seconds,
            )

    @property
    def how(self) -> str:
        """How the graphs came: compiled by this job, or loaded from a filled cache."""
        return "compiled" if self.cold else "loaded from the cache"

    def _fill_cache(self) -> None:
        """Compile in a child process at the lowest priority, filling the on-disk cache."""
        # The child runs the worker's thread count: inductor splits loops for it when it
        # generates kernels and keys its cache by it, so graphs compiled on another count miss
        # the cache and the worker would compile them all over again, in its own process.
        threads = self.worker.plan.threads
        config = dataclasses.replace(
            self.worker.config,
            num_blocks=64,  # the graphs do not depend on the pool's size
            kv_cache_memory=None,
            num_slots=4,
            num_threads=threads,
            compile=True,
        )
        # The child runs this worker's plan, not one it resolves for itself.
        settings = json.dumps([dataclasses.asdict(config), self.worker.plan.to_json()])
        env = dict(
            os.environ, TORCHINDUCTOR_CACHE_DIR=str(self.directory), OMP_NUM_THREADS=str(threads)
        )
        command = [sys.executable, "-m", "worker.compiled.background", settings]
        done = subprocess.run(
            command, env=env, preexec_fn=_polite_child, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")
        mark_compiled(self.directory)


@contextlib.contextmanager
def step_first(job: BackgroundCompile | None) -> Iterator[None]:
    """Run a step (the ``with`` body) ahead of the job's loading thread.

    Loading the graphs is seconds of dynamo's tracing: pure Python, holding the GIL. A step
    gives the GIL up around each of its operators' kernels and then waits for the loader to
    give it back, which a holder does only when the switch interval (5 ms) runs out: some 400
    such waits an eager step, and 16-token replies took up to 11 s while the graphs loaded.
    During a step the interval is 50 µs, so each wait is short; between steps the loader runs
    on the usual interval, at full speed."""
    if job is None or not job.loading:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(STEP_SWITCH_INTERVAL)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def start_compile(worker, background: bool) -> tuple[object | None, BackgroundCompile | None]:
    """The worker's compiled decode step now (``background`` False: compiled or loaded before
    this returns), or a started ``BackgroundCompile`` that builds it while the worker serves:
    (compiled, job), one of them None."""
    from worker.compiled.decode import CompiledDecode

    directory = compile_dir(worker.config, worker.plan, worker.files.model_id)
    use_cache_dir(directory)
    if background:
        job = BackgroundCompile(worker, directory)
        job.start()
        return None, job
    compiled = CompiledDecode(worker.model, worker.cache, worker.attention)
    compiled.warm_up()
    mark_compiled(directory)
    return compiled, None


def _polite_child() -> None:
    """In the compiling child before it runs: the lowest CPU priority, and death with the worker
    (Linux), so a killed worker leaves no compiler behind to race its successor's."""
    os.nice(19)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1


def mark_compiled(directory: Path) -> None:
    """Record that ``directory`` holds every graph, so later workers only load them."""
    (directory / _MARKER).write_text(f"{time.time()}\n")


def use_cache_dir(directory: Path) -> None:
    """Point inductor at ``directory`` for this process (before anything compiles)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)


def _compile_only(settings: str) -> int:
    """The child: build a worker with the given config, compile its graphs, exit."""
    from worker.worker import Worker

    config, plan = json.loads(settings)
    # The plan's compile is "inductor": warm_up runs in the constructor.
    Worker(WorkerConfig(**config), progress=False, plan=Plan.from_json(plan))
    return 0


if __name__ == "__main__":
    sys.exit(_compile_only(sys.argv[1]))
