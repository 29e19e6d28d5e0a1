// nanoserve::w4a8_linear: x @ W.T for many rows of bfloat16 x and a GGUF 4-bit W, with x
// quantized to 8 bits in groups of 32 columns: the big steps' linears (prefills, decode steps
// of more than a few rows; worker/linear/base.py), eager and compiled.
//
// A big step is bound by multiplies, not by reading the weights, and VNNI's vpdpbusd does 64
// 8-bit multiply-adds per instruction where vdpbf16ps does 32 bfloat16 ones, at the same rate
// here. The numerics are llama.cpp's CPU dot of a Q4_1 block and a Q8_1 block
// (ggml_vec_dot_q4_1_q8_1): each group of 32 values of a row of x becomes
//   a_k = round(x_k * 127 / amax) (int8), d = amax / 127, s = d * sum_k a_k,
// d and s rounded to float16 as block_q8_1 stores them, and for w = scale * q + low
//   sum_k x_k w_k ~= scale * d * sum_k q_k a_k + low * s
// with the integer sum exact in int32 and the rest in float32 (summed in another order than
// llama.cpp's, so not bit for bit).
//
// Layout (pack_w4a8 in worker/linear/base.py): rows in blocks of 16, and per (row block, group) 512
// bytes, one q per byte: byte 4j + t of chunk c (c < 8) is row j's q at column 4c + t. A chunk
// is one vpdpbusd operand: 16 rows x 4 columns, against those 4 columns of a broadcast.
//
// Shapes: x (M, K) bfloat16; packed (N / 16, K / 32, 512) uint8; scale and low
// (N / 16, K / 32, 16) float16 (pack_q4's) -> out (M, N) bfloat16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRowsPerTile = 4;  // rows of x sharing each weight load
constexpr int64_t kBlocksPerTile = 2;  // blocks of 16 outputs sharing each broadcast of x

// x rounded to the nearest float16 and back (vcvtps2ph, not c10::Half's bit twiddling).
inline float round_half(float x) {
  const __m256i half = _mm512_cvtps_ph(_mm512_set1_ps(x), _MM_FROUND_TO_NEAREST_INT);
  return _mm512_cvtss_f32(_mm512_cvtph_ps(half));
}

// One row's groups of 32 as int8 (K bytes), and per group d and s (G floats each).
void quantize_row(const c10::BFloat16* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 v0 = nanoserve_simd::load_bf16(x + g * 32);
    __m512 v1 = nanoserve_simd::load_bf16(x + g * 32 + 16);
    float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float scale = amax / 127.f;
    const __m512 inverse = _mm512_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
    // cvtps_epi32 rounds to nearest even, as llama.cpp's _mm256_round_ps(_MM_ROUND_NEAREST).
    __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));
    __m512i a1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * 32), _mm512_cvtsepi32_epi8(a0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * 32 + 16), _mm512_cvtsepi32_epi8(a1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
    d[g] = round_half(scale);
    s[g] = round_half(scale * static_cast<float>(sum));
  }
}

// out[m, 16 rb ...] for rows [m0, m0 + MB) of x and row blocks [rb0, rb0 + NB) of W.
template <int MB, int NB>
void tile(const int8_t* xq, const float* d, const float* s, int64_t K, const uint8_t* packed,
          const c10::Half* scale, const c10::Half* low, c10::BFloat16* out, int64_t N,
          int64_t m0, int64_t rb0, bool ahead, int64_t share, int64_t shares) {
  // ahead: prefetch the groups g of the next NB row blocks with g % shares == share.
  const int64_t G = K / 32;
  __m512 total[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) total[m][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (ahead && g % shares == share) {
      // Group g of the next NB row blocks (adjacent, G x 512 bytes each): 16 lines of weights,
      // and a line of each scale.
      const char* next = reinterpret_cast<const char*>(packed + (rb0 + NB) * G * 512);
      for (int line = 0; line < 16; ++line) _mm_prefetch(next + g * 1024 + 64 * line, _MM_HINT_T0);
      const int64_t at = (rb0 + NB) * G * 16;  // in float16s
      _mm_prefetch(reinterpret_cast<const char*>(scale + at) + 64 * g, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(low + at) + 64 * g, _MM_HINT_T0);
    }
    __m512i sums[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) sums[m][n] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      __m512i w[NB];
      for (int n = 0; n < NB; ++n)
        w[n] = _mm512_loadu_si512(packed + ((rb0 + n) * G + g) * 512 + 64 * c);
      for (int m = 0; m < MB; ++m) {
        int32_t four;  // columns 4c .. 4c + 3 of row m0 + m's group g
        __builtin_memcpy(&four, xq + (m0 + m) * K + g * 32 + 4 * c, 4);
        const __m512i a = _mm512_set1_epi32(four);
        for (int n = 0; n < NB; ++n) sums[m][n] = _mm512_dpbusd_epi32(sums[m][n], w[n], a);
      }
    }
    __m512 ws[NB], wl[NB];
    for (int n = 0; n < NB; ++n) {
      const int64_t at = ((rb0 + n) * G + g) * 16;
      ws[n] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at)));
      wl[n] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + at)));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 dm = _mm512_set1_ps(d[(m0 + m) * G + g]);
      const __m512 sm = _mm512_set1_ps(s[(m0 + m) * G + g]);
      for (int n = 0; n < NB; ++n) {
        __m512 dot = _mm512_cvtepi32_ps(sums[m][n]);
        total[m][n] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws[n], dm), total[m][n]);
        total[m][n] = _mm512_fmadd_ps(wl[n], sm, total[m][n]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + m) * N + (rb0 + n) * 16),
                          nanoserve_simd::round_bf16(total[m][n]));
}

using TileFn = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
                        const c10::Half*, const c10::Half*, c10::BFloat16*, int64_t, int64_t,
                        int64_t, bool, int64_t, int64_t);

TileFn tile_fn(int64_t rows, int64_t blocks) {
  static constexpr TileFn one[kRowsPerTile] = {tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>};
  static constexpr TileFn two[kRowsPerTile] = {tile<1, 2>, tile<2, 2>, tile<3, 2>, tile<4, 2>};
  return (blocks == 2 ? two : one)[rows - 1];
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& low) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "w4a8_linear: x must be contiguous (M, K) bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.size(2) == 512 && packed.is_contiguous(),
              "w4a8_linear: packed must be contiguous (N / 16, K / 32, 512) uint8");
  const int64_t M = x.size(0), K = x.size(1), RB = packed.size(0), G = packed.size(1);
  TORCH_CHECK(M >= 1, "w4a8_linear: x has no rows");
  TORCH_CHECK(K == G * 32, "w4a8_linear: x has ", K, " columns, the weight ", G * 32);
  for (const at::Tensor* t : {&scale, &low})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == RB && t->size(1) == G && t->size(2) == 16,
                "w4a8_linear: scale and low must be contiguous (N / 16, K / 32, 16) float16");
  const int64_t N = RB * 16;
  at::Tensor out = at::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M * G), s(M * G);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * K, K, xq.data() + m * K, d.data() + m * G, s.data() + m * G);
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const c10::Half* ws = scale.data_ptr<c10::Half>();
  const c10::Half* wl = low.data_ptr<c10::Half>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  // Threads take pairs of row blocks; each pair's weights (G x 1 KiB) stay in cache while
  // every tile of rows of x passes over them. The tiles also prefetch the next pair's, each
  // its share of the groups: a decode step's weights come from memory (30 layers' do not fit in
  // cache), and the hardware prefetcher stops while the tiles compute from cache. 30 layers'
  // gate_up and down at 32 rows, cold (ad hoc): 8.2 -> 6.9 ms with the first tile prefetching
  // everything, alternating in one process; 6.3 -> 4.8-5.3 ms spread over the tiles, three
  // runs each, as fast as with the weights in cache. 16 rows: 3.9 -> 2.9-3.1; 128: 18.3 -> 17.0.
  const int64_t pairs = (RB + kBlocksPerTile - 1) / kBlocksPerTile;
  const int64_t tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t rb = kBlocksPerTile * pair;
      const int64_t blocks = std::min<int64_t>(kBlocksPerTile, RB - rb);
      const bool ahead = rb + 2 * kBlocksPerTile <= RB;  // a whole pair follows
      for (int64_t m = 0; m < M; m += kRowsPerTile) {
        const int64_t rows = std::min<int64_t>(kRowsPerTile, M - m);
        tile_fn(rows, blocks)(xq.data(), d.data(), s.data(), K, w, ws, wl, o, N, m, rb, ahead,
                              m / kRowsPerTile, tiles);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("w4a8_linear(Tensor x, Tensor packed, Tensor scale, Tensor low) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("w4a8_linear", &w4a8_linear); }
