// AVX2 helpers shared by nanoserve's AVX2 kernels (worker/cpu/csrc/*_f32.cpp), which run on CPUs
// without AVX-512 too (simd.h holds the AVX-512 ones). worker/cpu/kernels.py hashes it with the
// sources: a changed header rebuilds them.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

namespace nanoserve_avx2 {

// Eight values of a row as float32: float32 as they are, float16 widened exactly (vcvtph2ps).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The sum of v's eight lanes.
inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The sums of a, b, c and d, in that order.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  // [a01 a23 b01 b23 | a45 a67 b45 b67], and the same of c and d
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7]
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// exp(x) for x <= 0 (softmax after the max is subtracted): Cephes' range reduction and degree-5
// polynomial, relative error about 2e-7, as simd.h's AVX-512 exp_neg; anything below -87.3
// gives exp(-87.3), about 1e-38. A NaN stays NaN (max_ps returns its second operand when one is
// NaN), as in torch's softmax.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n in the exponent's bits: n >= -126 here (x >= -87.3), so 2^n is a normal float.
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace nanoserve_avx2
