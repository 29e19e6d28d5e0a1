// nanoserve::q4_linear: x @ W.T for a few rows of bfloat16 x and a GGUF 4-bit W, the small
// steps' linears (worker/linear/base.py), eager and compiled.
//
// A decode step at batch 1 does little but stream the weights. torch's int4 kernel
// (_weight_int4pack_mm_for_cpu) streams them at 14-19 GB/s here, where a plain read reaches
// 32-41. This one makes vdpbf16ps do the multiply: a 4-bit q becomes the bfloat16 value 128 + q
// by setting its high byte to 0x43 (128 + q, q < 16, needs 8 significant bits: exact), so
//   sum_k x_k w_k = scale * sum_k x_k (128 + q_k) + (low - 128 scale) * sum_k x_k
// per row and group of 32 columns, for w = scale * q + low (a GGUF Q4_1 block's d and m). The
// products are exact in float32 and the sums add in float32. scale and low stay float16, as
// the GGUF stores them (torch's kernel takes them rounded to bfloat16): 20 bytes a group.
//
// Layout (pack_q4_weight in worker/linear/base.py): rows in blocks of 16, and per (row block, group)
// 256 bytes. Byte 2j + t of chunk c (c < 8) holds row j's q at column 2c + t in its low nibble
// and at column 2c + 16 + t in its high nibble. Widened to 32 words, either nibble is one
// vdpbf16ps operand: 16 rows x one pair of columns, against that pair of x broadcast.
//
// Shapes: x (M, K) bfloat16, M <= 8; packed (N / 16, K / 32, 256) uint8; scale and low
// (N / 16, K / 32, 16) float16 -> out (M, N) bfloat16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kSerialBytes = 32768;  // weight bytes a thread's share must reach

#ifdef __AVX512BF16__
template <int M>
void q4_rows(const c10::BFloat16* x, int64_t K, const uint8_t* packed, const c10::Half* scale,
             const c10::Half* low, const float* xsum, c10::BFloat16* out, int64_t N,
             int64_t rb_begin, int64_t rb_end) {
  const int64_t G = K / 32;
  // x as 32-bit pairs: x32[m * K / 2 + k / 2] holds columns k and k + 1 of row m.
  const int32_t* x32 = reinterpret_cast<const int32_t*>(x);
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const __m512i exponent = _mm512_set1_epi16(0x4300);  // bfloat16 128.0
  for (int64_t rb = rb_begin; rb < rb_end; ++rb) {
    __m512 total[M];
    for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
    const uint8_t* w = packed + rb * G * 256;
    for (int64_t g = 0; g < G; ++g, w += 256) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 128, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 192, _MM_HINT_T0);
      __m512 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      for (int c = 0; c < 8; ++c) {
        __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
        // (bytes & 0x0F) | 0x4300: ternary-logic table 0xEA is (A & B) | C.
        __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(bytes, low_nibble, exponent, 0xEA);
        __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent);
        for (int m = 0; m < M; ++m) {
          const int32_t* pairs = x32 + m * (K / 2) + g * 16;
          acc[m] = _mm512_dpbf16_ps(acc[m], lo, (__m512bh)_mm512_set1_epi32(pairs[c]));
          acc[m] = _mm512_dpbf16_ps(acc[m], hi, (__m512bh)_mm512_set1_epi32(pairs[c + 8]));
        }
      }
      __m512 s = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + (rb * G + g) * 16)));
      __m512 b = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + (rb * G + g) * 16)));
      b = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, b);  // low - 128 scale
      for (int m = 0; m < M; ++m) {
        total[m] = _mm512_fmadd_ps(acc[m], s, total[m]);
        total[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * G + g]), b, total[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256i packed_out = (__m256i)_mm512_cvtneps_pbh(total[m]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + rb * 16), packed_out);
    }
  }
}

using RowsFn = void (*)(const c10::BFloat16*, int64_t, const uint8_t*, const c10::Half*,
                        const c10::Half*, const float*, c10::BFloat16*, int64_t, int64_t, int64_t);

RowsFn rows_fn(int64_t M) {
  static constexpr RowsFn table[kMaxRows] = {q4_rows<1>, q4_rows<2>, q4_rows<3>, q4_rows<4>,
                                             q4_rows<5>, q4_rows<6>, q4_rows<7>, q4_rows<8>};
  return table[M - 1];
}
#endif

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& low) {
#ifndef __AVX512BF16__
  TORCH_CHECK(false, "q4_linear: built without AVX512-BF16");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "q4_linear: x must be contiguous (M, K) bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.size(2) == 256 && packed.is_contiguous(),
              "q4_linear: packed must be contiguous (N / 16, K / 32, 256) uint8");
  const int64_t M = x.size(0), K = x.size(1), RB = packed.size(0), G = packed.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "q4_linear: 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(K == G * 32, "q4_linear: x has ", K, " columns, the weight ", G * 32);
  for (const at::Tensor* t : {&scale, &low})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == RB && t->size(1) == G && t->size(2) == 16,
                "q4_linear: scale and low must be contiguous (N / 16, K / 32, 16) float16");
  const int64_t N = RB * 16;
  at::Tensor out = at::empty({M, N}, x.options());
  // Each row's sum per group of 32 columns, of the bfloat16 values the products use.
  std::vector<float> xsum(M * G);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = 0; k < 32; ++k) sum += static_cast<float>(xp[m * K + g * 32 + k]);
      xsum[m * G + g] = sum;
    }
  RowsFn fn = rows_fn(M);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const c10::Half* s = scale.data_ptr<c10::Half>();
  const c10::Half* b = low.data_ptr<c10::Half>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kSerialBytes / (G * 256));
  at::parallel_for(0, RB, grain, [&](int64_t begin, int64_t end) {
    fn(xp, K, w, s, b, xsum.data(), o, N, begin, end);
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("q4_linear(Tensor x, Tensor packed, Tensor scale, Tensor low) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("q4_linear", &q4_linear); }
