// nanoserve::rms_norm: F.rms_norm over the rows of a bfloat16 tensor, the eager steps' norms
// (worker/model/llama.py's RMSNorm; compiled graphs keep F.rms_norm, which inductor fuses).
//
// In eager mode torch composes it of separate operators (a float32 copy, pow, mean, rsqrt, two
// multiplies, a copy back), each a pass over the tensor and an allocation: about 160 us for a
// 128-token prefill's (128, 576), 61 times a step. Here each row is read twice (the sum of
// squares, then the scaled write) and written once, in float32 arithmetic with the result
// rounded once, as torch rounds: out = bfloat16((x * rsqrt(mean(x^2) + eps)) * weight).
//
// Shapes: x (T, H) bfloat16, rows contiguous (a row stride is allowed); weight (H,) bfloat16
// -> out (T, H) bfloat16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>

namespace {

using nanoserve_simd::load_bf16;
using nanoserve_simd::round_bf16;

constexpr int64_t kSerialElements = 32768;  // below this, one thread (waking another costs more)

void norm_row(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* out, int64_t H,
              float eps) {
  int64_t k = 0;
  __m512 squares = _mm512_setzero_ps();
  for (; k + 16 <= H; k += 16) {
    __m512 v = load_bf16(x + k);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  float sum = _mm512_reduce_add_ps(squares);
  for (; k < H; ++k) sum += static_cast<float>(x[k]) * static_cast<float>(x[k]);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (k = 0; k + 16 <= H; k += 16) {
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(load_bf16(x + k), rv), load_bf16(w + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), round_bf16(y));
  }
  for (; k < H; ++k)
    out[k] = c10::BFloat16(static_cast<float>(x[k]) * r * static_cast<float>(w[k]));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "rms_norm: x must be (T, H) bfloat16 with contiguous rows");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16,
              "rms_norm: weight must be a contiguous (", H, ",) bfloat16");
  at::Tensor out = at::empty({T, H}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t stride = x.stride(0);
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(H, 1));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * stride, wp, op + t * H, H, e);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("rms_norm", &rms_norm); }
