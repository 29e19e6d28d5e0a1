// nanoserve::argmax: each row's greedy token, as torch.argmax(x, dim=-1) gives it (the first
// index of the maximum; a row with a NaN gives its first NaN), for the sampler.
//
// torch's CPU argmax does not vectorize, where amax does. Here each row is one pass of 16-float
// vectors that keep, per lane, the largest value so far and its first index.
//
// Shapes: x (S, V) float32, rows contiguous -> (S,) int64.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>

namespace {

int64_t row_argmax(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  if (n >= 16) {
    __m512 top = _mm512_loadu_ps(x);
    __m512i where = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i index = where;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 value = _mm512_loadu_ps(x + i);
      // Strictly greater: a lane keeps its first index among equals. NaN compares false, so
      // NaNs are found apart (below).
      const __mmask16 greater = _mm512_cmp_ps_mask(value, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, greater, value);
      where = _mm512_mask_mov_epi32(where, greater, index);
      nan |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    }
    if (nan) {
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(x[j])) return j;
    }
    alignas(64) float tops[16];
    alignas(64) int32_t wheres[16];
    _mm512_store_ps(tops, top);
    _mm512_store_si512(wheres, where);
    best = wheres[0];
    for (int lane = 1; lane < 16; ++lane)
      if (tops[lane] > x[best] || (tops[lane] == x[best] && wheres[lane] < best))
        best = wheres[lane];
  }
  for (; i < n; ++i) {  // the tail, or a row shorter than a vector
    if (std::isnan(x[i])) {
      for (int64_t j = 0; j <= i; ++j)
        if (std::isnan(x[j])) return j;
    }
    if (x[i] > x[best]) best = i;
  }
  return best;
}

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax: x must be float32 (S, V) with contiguous rows");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) <= INT32_MAX, "argmax: rows of 1 to 2^31 - 1 values");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  // A row is too little work to split: split rows over threads, never a row.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) result[row] = row_argmax(data + row * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) { lib.def("argmax(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("argmax", &argmax); }
