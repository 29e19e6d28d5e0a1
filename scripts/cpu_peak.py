"""This CPU's bfloat16 matmul ceiling: how many GFLOP/s a loop of independent 512-bit
``vdpbf16ps`` instructions (AVX512-BF16, 32 multiply-adds each) reaches on 1 and 2 threads.

No matmul can beat it, so it bounds any bfloat16 server's tokens/s here: ``scripts/compare.py``'s
concurrency-32 load needs about 3,930 GFLOP of matmuls (docs/performance.md, "Where the bars
stand"). Built with plain g++ into a shared library called through ctypes (no torch headers, so
it builds in about a second); prints one line per thread count:

    python scripts/cpu_peak.py

On a CPU without AVX512-BF16 but with AVX2 (where ``auto`` serves float32 on 4-bit weights times
8-bit activations), it measures the two instructions that path multiplies with instead: 256-bit
``vfmadd`` (8 float32 multiply-adds) and ``vpmaddubsw`` (32 byte multiplies, summed in pairs),
and prints both per thread count.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # worker.cpu.kernels

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <thread>
#include <vector>

// 12 independent accumulators: enough to cover the instruction's latency, so the loop runs at
// its throughput.
static void spin(long iters, float* sink) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    asm volatile("" : "+v"(a));  // keeps the compiler from folding the loop away
  }
  float s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(acc[i]);
  *sink = s;
}

// The seconds `threads` threads take to run `iters` rounds each.
extern "C" double seconds(long iters, long threads) {
  std::vector<float> sinks(threads);
  auto began = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (long t = 0; t < threads; ++t) pool.emplace_back(spin, iters, &sinks[t]);
  for (auto& t : pool) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}
"""

FLOPS_PER_ROUND = 12 * 32 * 2  # 12 instructions of 32 multiply-adds

AVX2_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <thread>
#include <vector>

// 12 independent accumulators each, as above. kind 0: vfmadd231ps on 8 floats; kind 1:
// vpmaddubsw on 32 bytes (its 16-bit results summed into the accumulators, as the 4-bit x 8-bit
// kernel sums them).
static void spin(long iters, long kind, float* sink) {
  if (kind == 0) {
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
    __m256 a = _mm256_set1_ps(1.f), b = _mm256_set1_ps(1e-9f);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
      asm volatile("" : "+x"(a));
    }
    float s = 0;
    for (int i = 0; i < 12; ++i) s += _mm256_cvtss_f32(acc[i]);
    *sink = s;
  } else {
    __m256i acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_si256();
    __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(1);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(a, b));
      asm volatile("" : "+x"(a));
    }
    int s = 0;
    for (int i = 0; i < 12; ++i) s += _mm256_extract_epi16(acc[i], 0);
    *sink = static_cast<float>(s);
  }
}

extern "C" double seconds(long iters, long threads, long kind) {
  std::vector<float> sinks(threads);
  auto began = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (long t = 0; t < threads; ++t) pool.emplace_back(spin, iters, kind, &sinks[t]);
  for (auto& t : pool) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}
"""
# Multiply-adds per round: 12 instructions of 8 (vfmadd on float32) or 32 (vpmaddubsw).
AVX2_KINDS = ((0, "float32 vfmadd", 12 * 8), (1, "int8 vpmaddubsw", 12 * 32))


def _avx2_peaks(compiler: str, rounds: int, thread_counts: list[int]) -> None:
    """One line per thread count: float32 FMA and int8 vpmaddubsw peaks, G multiply-adds/s."""
    with tempfile.TemporaryDirectory() as build:
        source, library = Path(build) / "cpu_peak.cpp", Path(build) / "cpu_peak.so"
        source.write_text(AVX2_SOURCE)
        flags = ["-O2", "-shared", "-fPIC", "-pthread", "-mavx2", "-mfma"]
        subprocess.run([compiler, *flags, str(source), "-o", str(library)], check=True)
        module = ctypes.CDLL(str(library))
        module.seconds.restype = ctypes.c_double
        module.seconds.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_long)
        for threads in thread_counts:
            parts = []
            for kind, name, per_round in AVX2_KINDS:
                module.seconds(rounds // 10, threads, kind)  # warm up: clocks settle
                elapsed = module.seconds(rounds, threads, kind)
                rate = per_round * rounds * threads / elapsed / 1e9
                parts.append(f"{rate:.0f} G multiply-adds/s {name}")
            print(f"{threads} thread(s): " + ", ".join(parts) + " (AVX2 peaks)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000_000, help="rounds per thread")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = parser.parse_args()
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print("cpu_peak: needs a C++ compiler (g++)", file=sys.stderr)
        return 2
    from worker.cpu.kernels import cpu_flags

    flags = cpu_flags()
    if "avx512_bf16" not in flags:
        if not {"avx2", "fma"} <= flags:
            print("cpu_peak: needs AVX512-BF16, or AVX2 and FMA", file=sys.stderr)
            return 2
        _avx2_peaks(compiler, args.rounds, [int(t) for t in args.threads.split(",")])
        return 0
    with tempfile.TemporaryDirectory() as build:
        source, library = Path(build) / "cpu_peak.cpp", Path(build) / "cpu_peak.so"
        source.write_text(SOURCE)
        flags = ["-O2", "-shared", "-fPIC", "-pthread", "-mavx512f", "-mavx512bw", "-mavx512bf16"]
        subprocess.run([compiler, *flags, str(source), "-o", str(library)], check=True)
        module = ctypes.CDLL(str(library))
        module.seconds.restype = ctypes.c_double
        module.seconds.argtypes = (ctypes.c_long, ctypes.c_long)
        for threads in (int(t) for t in args.threads.split(",")):
            module.seconds(args.rounds // 10, threads)  # warm up: clocks settle
            elapsed = module.seconds(args.rounds, threads)
            gflops = FLOPS_PER_ROUND * args.rounds * threads / elapsed / 1e9
            rate = 12 * args.rounds / elapsed / 1e9
            print(
                f"{threads} thread(s): {gflops:.0f} GFLOP/s bfloat16 peak "
                f"({rate:.2f} vdpbf16ps per ns per thread)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
