// AVX-512 helpers shared by nanoserve's kernels (worker/cpu/csrc/*.cpp). worker/cpu/kernels.py puts
// this file's hash into the compiler flags: cpp_extension hashes only the sources it is given,
// and a changed header must rebuild them.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace nanoserve_simd {

// 16 bfloat16 bit patterns -> 16 floats (exact: a bfloat16 is a float's high half).
inline __m512 widen_bf16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 bfloat16 -> 16 floats.
inline __m512 load_bf16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The lanes of ``mask`` of 16 bfloat16 at p, as floats; the others 0 (nothing read there).
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 mask) {
  return widen_bf16(_mm256_maskz_loadu_epi16(mask, p));
}

// 16 floats -> 16 bfloat16, rounded to nearest even as c10::BFloat16 rounds; a NaN stays NaN.
inline __m256i round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// v rounded to bfloat16 and back to floats: where eager torch rounds an intermediate result.
inline __m512 round_to_bf16(__m512 v) { return widen_bf16(round_bf16(v)); }

// exp(x) for x <= 0 (softmax after the max is subtracted): Cephes' range reduction and degree-5
// polynomial, relative error about 2e-7; anything below -87.3 gives exp(-87.3), about 1e-38.
// A NaN stays NaN (max_ps returns its second operand when one is NaN), as in torch's softmax.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}

}  // namespace nanoserve_simd
