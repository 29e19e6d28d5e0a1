// nanoserve::q4a8_linear_f32: x @ W.T for float32 rows x and a GGUF 4-bit W held as pack_q4's
// nibbles, with x quantized to 8 bits in groups of 32 columns, in AVX2: the linears of a
// float32 model that `auto` serves on a CPU without native bfloat16 (worker/linear/base.py).
//
// Such a CPU multiplies float32 at 16 multiply-adds a cycle a core (two 8-lane FMAs), and
// torch's int4 kernel is vectorized for bfloat16 rows only. vpmaddubsw multiplies 32 pairs of
// unsigned and signed bytes a cycle a core, and a 1-row step streams 4.5 bits a weight instead
// of 32. The numerics are llama.cpp's CPU dot of a Q4_1 block and a Q8_1 block
// (ggml_vec_dot_q4_1_q8_1), as in w4a8_linear.cpp: each group of 32 values of a row of x
// becomes a_k = round(x_k * 127 / amax) (int8), d = amax / 127, s = d * sum_k a_k, d and s
// rounded to float16 as block_q8_1 stores them, and for w = scale * q + low
//   sum_k x_k w_k ~= scale * d * sum_k q_k a_k + low * s
// with the integer sum exact and the rest in float32 (summed in another order than llama.cpp's,
// so not bit for bit).
//
// Layout (pack_q4a8 in worker/linear/base.py): rows in blocks of 16; per (row block, group) 256
// bytes where column 16 h + 4 k + t of row 8 r + i is nibble h of byte 32 (4 r + k) + 4 i + t.
// A 32-byte chunk (r, k) holds, per nibble, 8 rows x 4 adjacent columns: vpmaddubsw against
// those four columns of x, broadcast, gives each row's two 2-term sums in its 32-bit lane.
//
// Shapes: x (M, K) float32, contiguous; packed (N / 16, K / 32, 256) uint8; scale and low
// (N / 16, K / 32, 16) float16 (pack_q4's) -> out (M, N) float32 (N a multiple of 16: the
// caller slices off padded rows).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 4;  // rows of x sharing each load of the weights

// x rounded to the nearest float16 and back (vcvtps2ph).
inline float round_half(float x) {
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT)));
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// One row's groups of 32 as int8 (K bytes), and per group d and s (K / 32 floats each).
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + g * 32 + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float top = reduce_max(amax);
    const __m256 inverse = _mm256_set1_ps(top != 0.f ? 127.f / top : 0.f);
    // cvtps_epi32 rounds to nearest even, as llama.cpp's _mm256_round_ps(_MM_ROUND_NEAREST).
    __m256i a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    // int32 -> int8 by two saturating packs, which interleave 128-bit lanes: dword i of the
    // result holds a[i % 4]'s values 4 (i / 4) .. +3, put back in order by the permute.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]),
                                             _mm256_packs_epi32(a[2], a[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * 32),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const int sum = reduce_add(_mm256_add_epi32(_mm256_add_epi32(a[0], a[1]),
                                                _mm256_add_epi32(a[2], a[3])));
    const float scale = top / 127.f;
    d[g] = round_half(scale);
    s[g] = round_half(scale * static_cast<float>(sum));
  }
}

// out[m, 16 rb + 0..15] for rows [m0, m0 + MB) of x and row block rb of W.
template <int MB>
void tile(const int8_t* xq, const float* d, const float* s, int64_t K, const uint8_t* packed,
          const c10::Half* scale, const c10::Half* low, float* out, int64_t N, int64_t m0,
          int64_t rb) {
  const int64_t G = K / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 total[MB][2];  // rows 0-7 and 8-15 of the block
  for (int m = 0; m < MB; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* w = packed + (rb * G + g) * 256;
    // Per row of x and half of the block, 16-bit sums over the group: lane 2i + j holds row
    // i's products of columns 4k + 2j, 4k + 2j + 1 (and 16 more), summed over k. Each of the
    // 8 vpmaddubsw added is at most 2 * 15 * 127, so they stay within 30480.
    __m256i acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    auto step = [&](int k) {
      __m256i wl[2], wh[2];
      for (int r = 0; r < 2; ++r) {
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * (4 * r + k)));
        wl[r] = _mm256_and_si256(raw, nibble);
        wh[r] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
      }
      for (int m = 0; m < MB; ++m) {
        // Columns 4k .. 4k + 3 and 16 + 4k .. 19 + 4k of x, broadcast: a 32-bit broadcast from
        // memory is a plain load, where a 16-bit one also takes a shuffle.
        const int8_t* a = xq + (m0 + m) * K + g * 32;
        int32_t four_lo, four_hi;
        std::memcpy(&four_lo, a + 4 * k, 4);
        std::memcpy(&four_hi, a + 16 + 4 * k, 4);
        const __m256i xl = _mm256_set1_epi32(four_lo), xh = _mm256_set1_epi32(four_hi);
        for (int r = 0; r < 2; ++r)
          acc[m][r] = _mm256_add_epi16(
              acc[m][r], _mm256_add_epi16(_mm256_maddubs_epi16(wl[r], xl),
                                          _mm256_maddubs_epi16(wh[r], xh)));
      }
    };
    // Several rows: one k at a time. Unrolled over k, GCC unpacked all four k's weights up front
    // and spilled a third of the registers to the stack in every group (119 stack moves in
    // tile<4>): 17% slower at 128 rows, 11% at 32. One row keeps the unrolled loop (12%
    // faster there).
    if constexpr (MB == 1) {
      for (int k = 0; k < 4; ++k) step(k);
    } else {
#pragma GCC unroll 1
      for (int k = 0; k < 4; ++k) step(k);
    }
    const int64_t at = (rb * G + g) * 16;  // in float16s
    __m256 ws[2], wlow[2];
    for (int r = 0; r < 2; ++r) {
      ws[r] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + at + 8 * r)));
      wlow[r] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + at + 8 * r)));
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 dm = _mm256_set1_ps(d[(m0 + m) * G + g]);
      const __m256 sm = _mm256_set1_ps(s[(m0 + m) * G + g]);
      for (int r = 0; r < 2; ++r) {
        // Each row's two 16-bit sums added in 32 bits: lane i is row 8r + i.
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][r], ones));
        total[m][r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ws[r], dm), total[m][r]);
        total[m][r] = _mm256_fmadd_ps(wlow[r], sm, total[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(out + (m0 + m) * N + rb * 16, total[m][0]);
    _mm256_storeu_ps(out + (m0 + m) * N + rb * 16 + 8, total[m][1]);
  }
}

using TileFn = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
                        const c10::Half*, const c10::Half*, float*, int64_t, int64_t, int64_t);

constexpr TileFn kTiles[kRowsPerTile] = {tile<1>, tile<2>, tile<3>, tile<4>};

at::Tensor q4a8_linear_f32(const at::Tensor& x, const at::Tensor& packed,
                           const at::Tensor& scale, const at::Tensor& low) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q4a8_linear_f32: x must be contiguous (M, K) float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.size(2) == 256 && packed.is_contiguous(),
              "q4a8_linear_f32: packed must be contiguous (N / 16, K / 32, 256) uint8");
  const int64_t M = x.size(0), K = x.size(1), RB = packed.size(0), G = packed.size(1);
  TORCH_CHECK(K == G * 32, "q4a8_linear_f32: x has ", K, " columns, the weight ", G * 32);
  for (const at::Tensor* t : {&scale, &low})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == RB && t->size(1) == G && t->size(2) == 16,
                "q4a8_linear_f32: scale and low must be contiguous (N / 16, K / 32, 16) float16");
  const int64_t N = RB * 16;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M * G), s(M * G);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * K, K, xq.data() + m * K, d.data() + m * G, s.data() + m * G);
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const c10::Half* ws = scale.data_ptr<c10::Half>();
  const c10::Half* wl = low.data_ptr<c10::Half>();
  float* o = out.data_ptr<float>();
  // Threads take row blocks; each block's weights (G x 256 bytes) stay in L1 or L2 while every
  // tile of rows of x passes over them. A thread's blocks are adjacent in memory, so a 1-row
  // step streams them in order.
  at::parallel_for(0, RB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rb = begin; rb < end; ++rb)
      for (int64_t m = 0; m < M; m += kRowsPerTile) {
        const int64_t rows = std::min<int64_t>(kRowsPerTile, M - m);
        kTiles[rows - 1](xq.data(), d.data(), s.data(), K, w, ws, wl, o, N, m, rb);
      }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("q4a8_linear_f32(Tensor x, Tensor packed, Tensor scale, Tensor low) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("q4a8_linear_f32", &q4a8_linear_f32); }
