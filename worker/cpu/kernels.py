"""nanoserve's own CPU kernels (``csrc/``), built when a CPU worker starts and loaded as torch
operators (``torch.ops.nanoserve.*``). The worker's plan (``worker.plan``) decides which run.

- AVX-512 (``SOURCES``): ``decode_attention`` (bfloat16 decodes reading their blocks in place),
  ``rms_norm``, ``silu_mul`` and ``rotary_`` (the eager bfloat16 pointwise ops in one pass each)
  and ``argmax`` (the sampler's greedy choice, vectorized).
- AVX512-BF16 (``BF16_SOURCES``): ``prefill_attention``; ``q4_linear`` (a few bfloat16 rows times
  a GGUF 4-bit matrix); ``gguf_linear`` (that, or the bigger steps' method, chosen by the rows in
  C++ so a compiled graph does not branch); with AVX512-VNNI (``VNNI_SOURCES``) ``w4a8_linear``
  (many rows quantized to 8 bits times the 4-bit integers, llama.cpp's numerics).
- AVX2, FMA and F16C (``AVX2_SOURCES``, built everywhere they exist): ``decode_attention_f32``
  and ``prefill_attention_f32`` (float32 over a float32 or float16 pool), ``q4a8_linear_f32``
  (float32 rows quantized to 8 bits times the 4-bit integers), ``rms_norm_f32`` and
  ``silu_mul_f32``.

Each source's header says what it computes and why it beats torch's operator there.

The sources compile with ``torch.utils.cpp_extension`` into nanoserve's cache directory, in a
directory named by the torch version and a hash of the sources, flags and torch's build, and
load from there afterwards without ninja: a changed source, header, flag or torch build builds
anew, and every checkout and virtual environment with the same sources and the same torch
shares one build. On a CPU without AVX-512, or where the build fails, ``available()`` is False;
on one with AVX2, FMA and F16C, ``loaded()`` may still be True (the AVX2 operators alone).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from worker.cpu.fakes import register_fakes

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    _CSRC / name
    for name in ("decode_attention.cpp", "argmax.cpp", "rms_norm.cpp", "silu_mul.cpp", "rotary.cpp")
]
# Operators that exist only where the CPU has AVX512-BF16: other builds leave them out.
BF16_SOURCES = [
    _CSRC / name for name in ("prefill_attention.cpp", "q4_linear.cpp", "gguf_linear.cpp")
]
# And where it also has AVX512-VNNI.
VNNI_SOURCES = [_CSRC / "w4a8_linear.cpp"]
# Built on every CPU with AVX2, FMA and F16C, with the others or alone.
AVX2_SOURCES = [
    _CSRC / name
    for name in (
        "decode_attention_f32.cpp",
        "prefill_attention_f32.cpp",
        "q4a8_linear_f32.cpp",
        "pointwise_f32.cpp",
    )
]
HEADERS = [_CSRC / name for name in ("simd.h", "simd_avx2.h", "decode_common.h")]  # included
# Written in a build directory once its library is built and loaded: later processes load it
# as it is.
BUILT = "nanoserve_kernels.built"
# What the kernels' instructions need, as /proc/cpuinfo names them.
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")
_CFLAGS = [
    "-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"
]  # fmt: skip
# Where the CPU lacks AVX-512: only AVX2_SOURCES are built, for these.
AVX2_FLAGS = ("avx2", "fma", "f16c")
_AVX2_CFLAGS = ["-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c"]
# at::parallel_for splits work over OpenMP threads only where the caller is built with OpenMP:
# without it the kernels ran on one thread of the worker's two (its header's pragma ignored).
# Linked against libgomp.so.1, the loader reuses the copy torch loaded (the same soname), so
# the kernels share torch's thread pool and follow torch.set_num_threads.
_OPENMP = ["-fopenmp"]
# Used where the CPU has it (the attention's scores then take vdpbf16ps), not required.
BF16_FLAG = "avx512_bf16"
VNNI_FLAG = "avx512_vnni"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's instruction sets as /proc/cpuinfo names them (Linux only; else empty)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_supports() -> bool:
    """Whether this CPU has every instruction set the AVX-512 kernels are compiled for."""
    return set(CPU_FLAGS) <= cpu_flags()


def cpu_supports_avx2() -> bool:
    """Whether this CPU has what ``AVX2_SOURCES`` are compiled for (AVX2, FMA and F16C)."""
    return set(AVX2_FLAGS) <= cpu_flags()


def uses_bf16() -> bool:
    """Whether the kernels are built with AVX512-BF16: where the CPU has it, unless
    ``NANOSERVE_KERNELS_BF16=0`` (the tests use it to cover the float32 scoring too)."""
    return BF16_FLAG in cpu_flags() and os.environ.get("NANOSERVE_KERNELS_BF16", "1") != "0"


def uses_vnni() -> bool:
    """Whether ``w4a8_linear`` is built: with AVX512-BF16 (``uses_bf16``) where the CPU also
    has AVX512-VNNI."""
    return uses_bf16() and VNNI_FLAG in cpu_flags()


def cflags() -> list[str]:
    """The compiler's flags for this CPU."""
    if not cpu_supports():
        return _AVX2_CFLAGS + _OPENMP
    bf16 = ["-mavx512bf16"] if uses_bf16() else []
    vnni = ["-mavx512vnni"] if uses_vnni() else []
    return _CFLAGS + _OPENMP + bf16 + vnni


def available() -> bool:
    """Whether ``torch.ops.nanoserve``'s AVX-512 operators can run here (all but
    ``AVX2_SOURCES``'); builds and loads them on the first call."""
    return cpu_supports() and loaded()


@functools.cache
def loaded() -> bool:
    """Whether ``torch.ops.nanoserve`` is built and loaded here, with every operator or, on a CPU
    with AVX2 but not AVX-512, with ``AVX2_SOURCES``' operators alone; builds and loads it on the
    first call. ``NANOSERVE_KERNELS=0`` turns it off."""
    if os.environ.get("NANOSERVE_KERNELS", "1") == "0":
        return False
    if not cpu_supports_avx2():
        log.info("kernels: this CPU lacks AVX2; the worker keeps torch's code")
        return False
    if not cpu_supports():
        log.info("kernels: this CPU lacks AVX-512; only its AVX2 kernels are built")
    try:
        _load()
    except Exception as exc:  # a missing compiler must not stop the worker, only slow it
        log.warning("kernels: could not build csrc/ (%s); the worker keeps torch's code", exc)
        return False
    return True


def put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package's binary need not be on it."""
    import ninja

    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache  # once per process: a second library registering ``nanoserve`` would abort
def _load() -> Path:
    """Build (or find built) and load the kernels; the directory they live in."""
    sources, flags = _sources(), cflags()
    build = _build_dir(sources, flags)
    build.mkdir(parents=True, exist_ok=True)
    # Held while loading too, so a build in progress is never loaded half-written.
    with open(build / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        library = build / "nanoserve_kernels.so"
        if (build / BUILT).exists() and library.exists():
            # Built whole by an earlier process (maybe another venv's: its ninja file names
            # that venv's torch, and ninja would rebuild for that alone). The library names
            # torch's libraries by soname only, and this process has them loaded already.
            torch.ops.load_library(str(library))
        else:
            _build(build, sources, flags)
    register_fakes(cpu_supports(), uses_bf16(), uses_vnni())
    return build


def _build(build: Path, sources: list[Path], flags: list[str]) -> None:
    """Compile and load the kernels in ``build``, then mark it built. The caller holds the
    directory's flock."""
    from torch.utils import cpp_extension

    put_ninja_on_path()
    # cpp_extension serializes builders with a ``lock`` file that a killed build leaves behind,
    # and every later process then waits on it forever. An flock is released by the kernel when
    # its holder dies: holding it, no other nanoserve process is building, so a ``lock`` found
    # here is stale.
    if (build / "lock").exists():
        log.warning("removed a kernel build's stale lock (a build was killed): %s", build)
        (build / "lock").unlink()
    copies = _copy_sources(build / "src", sources)
    _copy_sources(build / "src", HEADERS)  # included by the sources, not listed
    # A first start spends a minute here (two cores): say so, or the worker looks hung.
    log.info("kernels: building %d C++ sources for this CPU in %s", len(sources), build)
    began = time.perf_counter()
    cpp_extension.load(
        name="nanoserve_kernels",
        sources=[str(copy) for copy in copies],
        extra_cflags=flags,
        extra_ldflags=list(_OPENMP),  # a copy: load() appends torch's libraries to it
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    (build / BUILT).write_text(f"built against {torch_dir()}\n")
    log.info("kernels: built in %.1f s", time.perf_counter() - began)


def build_dir() -> Path:
    """The directory this process's kernels are built in: one per set of sources, flags and
    torch build, holding copies of the sources. Ninja rebuilds when a source's path changes,
    not only its bytes, and when a command changes, and the commands name torch's include and
    library directories: two checkouts, or two virtual environments, taking turns on one
    directory rebuilt it at every start (a CI run from a clone, then ``make serve``: 35.9 s to
    /health). So the sources are copies, and a finished build (``BUILT``) loads without ninja:
    a fresh clone's new venv with the same torch finds it (it rebuilt for 48 s of its first
    52.6 s start while the key named torch's directory). Resolved, because the tests reach the
    shared directory through a link from a cache directory of their own."""
    return _build_dir(_sources(), cflags())


def _build_dir(sources: list[Path], flags: list[str]) -> Path:
    from models.files import cache_root

    flavour = "-bf16" if uses_bf16() else ("" if cpu_supports() else "-avx2")
    digest = _digest([*sources, *HEADERS], flags, torch_build())
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    return kernels.resolve() / f"torch-{torch.__version__}{flavour}-{digest}"


def torch_dir() -> Path:
    """Where this process's torch is installed (its headers and libraries)."""
    return Path(torch.__file__).resolve().parent


def torch_build() -> str:
    """Which torch build the kernels compile against: its version, commit and C++ ABI. Two
    installations that agree on these have the same headers and libraries."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return f"{torch.__version__} {torch.version.git_version} abi{abi}"


def _sources() -> list[Path]:
    if not cpu_supports():
        return list(AVX2_SOURCES)
    bf16 = BF16_SOURCES if uses_bf16() else []
    return SOURCES + bf16 + (VNNI_SOURCES if uses_vnni() else []) + AVX2_SOURCES


def _digest(paths: list[Path], flags: list[str], torch_built: str) -> str:
    """What a build depends on, hashed: each file's name and bytes (the sources and the header),
    the flags and torch's build (``torch_build``)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join(flags).encode())
    digest.update(b"\0" + torch_built.encode())
    return digest.hexdigest()[:16]


def _copy_sources(directory: Path, paths: list[Path]) -> list[Path]:
    """Copies of ``paths`` in ``directory``, each written once: a copy that exists has the same
    bytes (the build directory is named by them) and keeps its time, so ninja sees nothing new.
    Written whole and then renamed, so a killed process leaves no half file behind."""
    directory.mkdir(exist_ok=True)
    copies = []
    for path in paths:
        copy = directory / path.name
        if not copy.exists():
            partial = directory / f".{path.name}.partial"
            shutil.copyfile(path, partial)
            partial.replace(copy)
        copies.append(copy)
    return copies
