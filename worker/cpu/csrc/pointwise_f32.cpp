// nanoserve::rms_norm_f32 and nanoserve::silu_mul_f32: the eager float32 steps' norms and SwiGLU
// activation in AVX2, where `auto` serves float32 (worker/model/llama.py's RMSNorm and MLP; compiled
// graphs keep torch's, which inductor fuses).
//
// Eager torch composes F.rms_norm of five operators (pow, mean, add, rsqrt, two multiplies),
// each a pass over the tensor and an allocation: about 77 us for a 128-token prefill's
// (128, 576) on a 2-core Zen 3, 61 times a step. silu_ and mul_ are two more passes over the
// MLP's (128, 1536) halves, about 100 and 25 us. Here each row is read once for its sum of
// squares and once to write it, and silu(g) * u is one pass. Not bit for bit torch's (sums in
// another order, exp by polynomial): `auto`'s float32, whose linears already take 8-bit
// activations, uses them; an explicit float32, the exact path, keeps torch's.
//
// Shapes: rms_norm_f32: x (T, H) float32, rows contiguous (a row stride is allowed), weight (H,)
// float32 -> (T, H) float32, x * (1 / sqrt(mean(x^2) + eps)) * weight. silu_mul_f32: gate_up
// (T, 2I) float32, rows contiguous -> (T, I) float32, silu(gate) * up.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd_avx2.h"

#include <cmath>

namespace {

using nanoserve_avx2::exp_neg;
using nanoserve_avx2::reduce_add;

constexpr int64_t kSerialElements = 32768;  // below this, one thread (waking another costs more)

void norm_row(const float* x, const float* w, float* out, int64_t H, float eps) {
  int64_t k = 0;
  __m256 squares[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // two chains: FMA latency
  for (; k + 16 <= H; k += 16) {
    const __m256 a = _mm256_loadu_ps(x + k), b = _mm256_loadu_ps(x + k + 8);
    squares[0] = _mm256_fmadd_ps(a, a, squares[0]);
    squares[1] = _mm256_fmadd_ps(b, b, squares[1]);
  }
  float sum = reduce_add(_mm256_add_ps(squares[0], squares[1]));
  for (; k < H; ++k) sum += x[k] * x[k];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (k = 0; k + 8 <= H; k += 8)
    _mm256_storeu_ps(out + k,
                     _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), rv), _mm256_loadu_ps(w + k)));
  for (; k < H; ++k) out[k] = x[k] * r * w[k];
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

void silu_mul_row(const float* gate, const float* up, float* out, int64_t I) {
  int64_t k = 0;
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; k + 8 <= I; k += 8) {
    const __m256 g = _mm256_loadu_ps(gate + k);
    // Below -87 exp_neg clamps: that rare vector goes the scalar way (silu is then ~0, or 0).
    if (_mm256_movemask_ps(_mm256_cmp_ps(g, _mm256_set1_ps(-87.f), _CMP_LT_OQ))) {
      for (int64_t j = k; j < k + 8; ++j) out[j] = silu(gate[j]) * up[j];
      continue;
    }
    // exp(-|g|) never overflows: silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below.
    const __m256 e = exp_neg(_mm256_or_ps(g, sign));  // -|g|
    const __m256 top = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
    const __m256 s = _mm256_div_ps(top, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + k, _mm256_mul_ps(s, _mm256_loadu_ps(up + k)));
  }
  for (; k < I; ++k) out[k] = silu(gate[k]) * up[k];
}

// Rows [0, T) over the threads, ``row`` per row, one thread for small tensors.
template <typename F>
void for_rows(int64_t T, int64_t width, F&& row) {
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(width, 1));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) row(t);
  });
}

at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "rms_norm_f32: x must be (T, H) float32 with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == x.size(1),
              "rms_norm_f32: weight must be contiguous (H,) float32, H = ", x.size(1));
  const int64_t T = x.size(0), H = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(T, H, [&](int64_t t) { norm_row(xp + t * stride, wp, op + t * H, H, e); });
  return out;
}

at::Tensor silu_mul_f32(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul_f32: gate_up must be (T, 2I) float32 with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(T, I, [&](int64_t t) {
    silu_mul_row(gp + t * stride, gp + t * stride + I, op + t * I, I);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("rms_norm_f32(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("silu_mul_f32(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("rms_norm_f32", &rms_norm_f32);
  lib.impl("silu_mul_f32", &silu_mul_f32);
}
