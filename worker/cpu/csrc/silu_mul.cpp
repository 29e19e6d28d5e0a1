// nanoserve::silu_mul: the MLP's silu(gate) * up from its fused gate_up output, the eager steps'
// activation (worker/model/llama.py's MLP; compiled graphs keep torch's, which inductor fuses).
//
// Eager torch runs it as two passes, silu_ over the gate half and mul_ by the up half, each
// rounding to bfloat16. This reads both halves once and rounds where torch does:
// out = bfloat16(float(bfloat16(silu(g))) * u), silu(g) = g / (1 + exp(-g)) in float32.
//
// Shapes: gate_up (T, 2I) bfloat16, rows contiguous -> out (T, I) bfloat16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>

namespace {

using nanoserve_simd::exp_neg;
using nanoserve_simd::load_bf16;
using nanoserve_simd::round_bf16;

constexpr int64_t kSerialElements = 32768;  // below this, one thread (waking another costs more)

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

void silu_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                  int64_t I) {
  int64_t k = 0;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; k + 16 <= I; k += 16) {
    __m512 g = load_bf16(gate + k);
    // Below -87 exp_neg clamps (and torch's exp(-g) overflows to inf below -88.7): that rare
    // vector goes the scalar way, as torch computes it.
    if (_mm512_cmp_ps_mask(g, _mm512_set1_ps(-87.f), _CMP_LT_OQ)) {
      for (int64_t j = k; j < k + 16; ++j) {
        float s = static_cast<float>(c10::BFloat16(silu(static_cast<float>(gate[j]))));
        out[j] = c10::BFloat16(s * static_cast<float>(up[j]));
      }
      continue;
    }
    // exp(-|g|) never overflows: silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below.
    __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 top = _mm512_mask_mul_ps(g, negative, g, e);
    __m512 s = _mm512_div_ps(top, _mm512_add_ps(one, e));
    // torch rounds silu's output to bfloat16 before the multiply: so does this.
    __m512 y = _mm512_mul_ps(nanoserve_simd::round_to_bf16(s), load_bf16(up + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), round_bf16(y));
  }
  for (; k < I; ++k) {
    float s = static_cast<float>(c10::BFloat16(silu(static_cast<float>(gate[k]))));
    out[k] = c10::BFloat16(s * static_cast<float>(up[k]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be (T, 2I) bfloat16 with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const c10::BFloat16* gp = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(I, 1));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      silu_mul_row(gp + t * stride, gp + t * stride + I, op + t * I, I);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) { lib.def("silu_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("silu_mul", &silu_mul); }
