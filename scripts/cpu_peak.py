"""This CPU's bfloat16 matmul ceiling: how many GFLOP/s a loop of independent 512-bit
``vdpbf16ps`` instructions (AVX512-BF16, 32 multiply-adds each) reaches on 1 and 2 threads.

No matmul can beat it, so it bounds any bfloat16 server's tokens/s here: ``scripts/compare.py``'s
concurrency-32 load needs about 3,930 GFLOP of matmuls (docs/performance.md, "Side by side").
Built with plain g++ into a shared library called through ctypes (no torch headers, so it
builds in about a second); prints one line per thread count:

    python scripts/cpu_peak.py
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000_000, help="rounds per thread")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = parser.parse_args()
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print("cpu_peak: needs a C++ compiler (g++)", file=sys.stderr)
        return 2
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
