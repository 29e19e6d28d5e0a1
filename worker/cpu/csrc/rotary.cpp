// nanoserve::rotary_: rotary position embeddings applied in place to bfloat16 q and k, the eager
// steps' rotation (worker/model/rope.py's apply_rotary; compiled graphs keep torch's operators, which
// inductor fuses).
//
// Eager torch runs x * cos + x.roll(hd / 2) * sin as a roll (itself a narrow and a cat), two
// multiplies and an add: five passes and four allocations, about 90 us a layer in a 128-token
// prefill (docs/performance.md). This reads each head's row once and rounds where torch does:
//   out = bfloat16(bfloat16(x * cos) + bfloat16(rolled * sin)),
// rolled[i] = x[i + hd / 2] below hd / 2 and x[i - hd / 2] above; sin carries the sign of
// "rotate half" (rope.py's rotary_cos_sin negates its first half).
//
// Shapes: x (T, heads, hd) bfloat16, heads and hd strided as a view of the fused qkv allows
// (hd contiguous); cos and sin (T, 1, hd) bfloat16, hd contiguous; hd even.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

namespace {

using nanoserve_simd::load_bf16;
using nanoserve_simd::round_bf16;
using nanoserve_simd::round_to_bf16;

constexpr int64_t kSerialElements = 32768;  // below this, one thread (waking another costs more)

// One head's row of hd values, in place: both halves are read before either is written.
void rotate_row(c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin,
                int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t k = 0; k < half; k += 16) {
    const __mmask16 m = half - k >= 16 ? 0xFFFF : (1u << (half - k)) - 1;
    const __m512 lo = load_bf16(x + k, m), hi = load_bf16(x + half + k, m);
    const __m512 lo_cos = round_to_bf16(_mm512_mul_ps(lo, load_bf16(cos + k, m)));
    const __m512 hi_sin = round_to_bf16(_mm512_mul_ps(hi, load_bf16(sin + k, m)));
    const __m512 hi_cos = round_to_bf16(_mm512_mul_ps(hi, load_bf16(cos + half + k, m)));
    const __m512 lo_sin = round_to_bf16(_mm512_mul_ps(lo, load_bf16(sin + half + k, m)));
    const __m512 new_lo = _mm512_add_ps(lo_cos, hi_sin), new_hi = _mm512_add_ps(hi_cos, lo_sin);
    _mm256_mask_storeu_epi16(x + k, m, round_bf16(new_lo));
    _mm256_mask_storeu_epi16(x + half + k, m, round_bf16(new_hi));
  }
}

void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 &&
                  x.size(2) % 2 == 0,
              "rotary_: x must be (T, heads, hd) bfloat16, hd contiguous and even");
  const int64_t T = x.size(0), heads = x.size(1), hd = x.size(2);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->size(0) == T &&
                    t->size(1) == 1 && t->size(2) == hd && t->stride(2) == 1,
                "rotary_: cos and sin must be (", T, ", 1, ", hd, ") bfloat16, hd contiguous");
  c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* cp = cos.data_ptr<c10::BFloat16>();
  const c10::BFloat16* sp = sin.data_ptr<c10::BFloat16>();
  const int64_t xt = x.stride(0), xh = x.stride(1), ct = cos.stride(0), st = sin.stride(0);
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(heads * hd, 1));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rotate_row(xp + t * xt + h * xh, cp + t * ct, sp + t * st, hd);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("rotary_", &rotary_); }
