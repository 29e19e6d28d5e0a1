// nanoserve::decode_attention: one decode query per row over its paged bfloat16 K/V, the decodes
// of the cpu-bf16 attention backend (worker/attention/cpu_bf16.py), eager and compiled.
//
// The torch backend builds this attention from a gather of every cached K/V into a copy, two
// batched matmuls and a softmax, mostly fixed costs at small batches. Here each (row, KV head)
// pair reads its blocks in place once, in float32 arithmetic: scores, an exact softmax (the
// max subtracted, the new token included), then the weighted sum of the values.
//
// Shapes: q (B, nq, hd), kv (B, 2, n_kv, hd) the new token's k and v, layer (2, n_kv, S, hd)
// one layer of the pool, blocks (B, M) each row's block ids, cached (B,) how many positions
// each row has cached, first (B,) or none each row's group's first row (a request's draft
// tokens: decode_common.h) -> out (B, nq, hd). q and kv may be strided views (of the qkv matmul's
// output); their last dimension must be contiguous.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "decode_common.h"
#include "simd.h"

#include <cmath>
#include <vector>

namespace {

using nanoserve_simd::exp_neg;
using nanoserve_simd::load_bf16;
using nanoserve_simd::round_bf16;

using nanoserve_decode::for_each_position;
using nanoserve_decode::prefetch_row;
using nanoserve_decode::Later;

#ifdef __AVX512BF16__
// 32 bfloat16 values as 16 pairs for vdpbf16ps; head_dim 16 (C = 1) fills the upper half with
// zeros, which add nothing.
template <int C>
inline __m512bh load_pairs(const c10::BFloat16* p) {
  if constexpr (C == 1)
    return (__m512bh)_mm512_zextsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else
    return (__m512bh)_mm512_loadu_si512(p);
}
#endif

struct Views {
  const c10::BFloat16 *q, *kv, *layer;
  const int64_t *blocks, *cached;
  const int64_t* first;  // each row's group's first row, or null (see decode_common.h)
  c10::BFloat16* out;
  int64_t q_row, q_head, kv_row, kv_part, kv_head;  // strides, in elements
  int64_t layer_part, layer_head, blocks_row;
  int64_t nq, n_kv, hd, block_size;
};

// The sums of a, b, c and d, in that order: 13 instructions instead of 4 full reductions.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3], and the same of c and d.
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per 128-bit lane: [a, b, c, d] summed over the lane.
  __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Lane l of the result: op over every lane of v congruent to l modulo W (W = 4, 8 or 16).
template <int W, typename Op>
inline __m512 fold(__m512 v, Op op) {
  if constexpr (W <= 8) v = op(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  if constexpr (W <= 4) v = op(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return v;
}

// One row's G query heads of one KV head, head_dim = 16 * C.
//
// Scores are kept position-major, W floats per position (G rounded up to 4, 8 or 16; the
// spare heads score 0 and are never read): a 16-float vector then holds whole positions, so
// the softmax of all G heads runs on full vectors. scratch: W * (cached + 1) rounded up.
template <int G, int C>
void attend(const Views& v, int64_t row, int64_t head, std::vector<float>& scratch,
            const Later<c10::BFloat16>& later) {
  constexpr int W = G <= 4 ? 4 : (G <= 8 ? 8 : 16);
  constexpr int64_t kPerVector = 16 / W;  // positions per 16-float vector
  const int64_t cached = v.cached[row];
  const int64_t earlier = nanoserve_decode::earlier_in_group(v, row);
  const int64_t length = cached + earlier + 1;  // the group's new tokens last, the row's own last
  const int64_t padded = (length + kPerVector - 1) / kPerVector * kPerVector;
  const float scale = 1.f / std::sqrt(static_cast<float>(C * 16));
  scratch.resize(W * padded);
  float* s = scratch.data();
  const c10::BFloat16* keys = v.layer + head * v.layer_head;
  const c10::BFloat16* values = keys + v.layer_part;
  const c10::BFloat16* k_new = v.kv + (row - earlier) * v.kv_row + head * v.kv_head;
  const c10::BFloat16* v_new = k_new + v.kv_part;
  const int64_t* table = v.blocks + row * v.blocks_row;
  if (cached > 0)  // the first block: for_each_position prefetches the others
    for (int64_t i = 0; i < std::min(v.block_size, cached); ++i)
      prefetch_row(keys + table[0] * v.block_size * v.hd + i * v.hd, v.hd);
  // Scores: one dot product per (position, query head); the group shares each key's load.
#ifdef __AVX512BF16__
  // q and k are bfloat16 already: vdpbf16ps multiplies 32 pairs exactly and adds them into 16
  // float32 lanes, with no conversion of k.
  constexpr int P = (C + 1) / 2;  // 32-value chunks of the head dimension (16 for head_dim 16)
  __m512bh q[G][P];
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < P; ++p)
      q[g][p] = load_pairs<C>(v.q + row * v.q_row + (head * G + g) * v.q_head + p * 32);
  const __m128 scale4 = _mm_set1_ps(scale);
  for_each_position(v, table, cached, keys, values, 0, k_new, earlier + 1, v.kv_row, later,
                    [&](int64_t t, const c10::BFloat16* key) {
    __m512 acc[W];
    for (int g = 0; g < W; ++g) acc[g] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      const __m512bh k = load_pairs<C>(key + p * 32);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], q[g][p], k);
    }
    for (int g = 0; g < W; g += 4)
      _mm_storeu_ps(s + t * W + g,
                    _mm_mul_ps(sum4(acc[g], acc[g + 1], acc[g + 2], acc[g + 3]), scale4));
  });
#else
  __m512 q[G][C];  // the group's queries in float32, scaled
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      q[g][c] = _mm512_mul_ps(load_bf16(v.q + row * v.q_row + (head * G + g) * v.q_head + c * 16),
                              _mm512_set1_ps(scale));
  for_each_position(v, table, cached, keys, values, 0, k_new, earlier + 1, v.kv_row, later,
                    [&](int64_t t, const c10::BFloat16* key) {
    __m512 acc[W];
    for (int g = 0; g < W; ++g) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      __m512 k = load_bf16(key + c * 16);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(q[g][c], k, acc[g]);
    }
    for (int g = 0; g < W; g += 4)
      _mm_storeu_ps(s + t * W + g, sum4(acc[g], acc[g + 1], acc[g + 2], acc[g + 3]));
  });
#endif
  for (int64_t i = length * W; i < padded * W; ++i) s[i] = -INFINITY;  // never weighed
  // Softmax of every head at once: lane l of a vector is head l % W.
  const int64_t vectors = padded * W / 16;
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < vectors; ++i) top = _mm512_max_ps(top, _mm512_loadu_ps(s + i * 16));
  top = fold<W>(top, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < vectors; ++i) {
    __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + i * 16), top));
    _mm512_storeu_ps(s + i * 16, e);
    total = _mm512_add_ps(total, e);
  }
  total = fold<W>(total, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), total);
  for (int64_t i = 0; i < vectors; ++i)
    _mm512_storeu_ps(s + i * 16, _mm512_mul_ps(_mm512_loadu_ps(s + i * 16), inv));
  // Weighted sum of the values.
  __m512 out[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) out[g][c] = _mm512_setzero_ps();
  for_each_position(v, table, cached, keys, values, 1, v_new, earlier + 1, v.kv_row, later,
                    [&](int64_t t, const c10::BFloat16* value) {
    for (int c = 0; c < C; ++c) {
      __m512 val = load_bf16(value + c * 16);
      for (int g = 0; g < G; ++g)
        out[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[t * W + g]), val, out[g][c]);
    }
  });
  // Rounded to nearest even as c10::BFloat16 rounds, 16 at a time: converting one value at a
  // time took about 10% of the kernel (ad hoc: 30 layers at 32 rows x 200 positions, in
  // cache, 74 -> 66-71 us a layer).
  for (int g = 0; g < G; ++g) {
    c10::BFloat16* dst = v.out + (row * v.nq + head * G + g) * (C * 16);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16), round_bf16(out[g][c]));
  }
}

using AttendFn = void (*)(const Views&, int64_t, int64_t, std::vector<float>&,
                          const Later<c10::BFloat16>&);

template <int C>
AttendFn pick_group(int64_t group) {
  switch (group) {
    case 1: return attend<1, C>;
    case 2: return attend<2, C>;
    case 3: return attend<3, C>;
    case 4: return attend<4, C>;
    case 5: return attend<5, C>;
    case 6: return attend<6, C>;
    case 7: return attend<7, C>;
    case 8: return attend<8, C>;
    default: return nullptr;
  }
}

// The instance for this head_dim (16, 32, 64 or 128) and query heads per KV head (1 to 8), or
// null.
AttendFn pick(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 16: return pick_group<1>(group);
    case 32: return pick_group<2>(group);
    case 64: return pick_group<4>(group);
    case 128: return pick_group<8>(group);
    default: return nullptr;
  }
}

bool supported(int64_t head_dim, int64_t group) { return pick(head_dim, group) != nullptr; }

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& layer,
                            const at::Tensor& blocks, const at::Tensor& cached,
                            int64_t block_size, const std::optional<at::Tensor>& first) {
  nanoserve_decode::check_ranks("decode_attention", q, kv, layer, blocks, cached);
  const int64_t* groups = nanoserve_decode::check_groups("decode_attention", first, q.size(0));
  const int64_t batch = q.size(0), nq = q.size(1), hd = q.size(2), n_kv = layer.size(1);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16 &&
                  layer.scalar_type() == at::kBFloat16,
              "decode_attention: q, kv and layer must be bfloat16");
  const int64_t work = nanoserve_decode::check_tables("decode_attention", q, kv, layer, blocks,
                                                      cached, block_size, &supported, groups);
  at::Tensor out = at::empty({batch, nq, hd}, q.options());
  Views v{q.data_ptr<c10::BFloat16>(), kv.data_ptr<c10::BFloat16>(),
          layer.data_ptr<c10::BFloat16>(), blocks.data_ptr<int64_t>(),
          cached.data_ptr<int64_t>(), groups, out.data_ptr<c10::BFloat16>(),
          q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
          layer.stride(0), layer.stride(1), blocks.stride(0),
          nq, n_kv, hd, block_size};
  nanoserve_decode::run_tasks<c10::BFloat16>(v, batch, work, pick(hd, nq / n_kv));
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoserve, lib) {
  lib.def(
      "decode_attention(Tensor q, Tensor kv, Tensor layer, Tensor blocks, Tensor cached, "
      "int block_size, Tensor? first=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("decode_attention", &decode_attention); }

// Whether decode_attention takes this head_dim and number of query heads per KV head.
TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("decode_attention_supports(int head_dim, int group) -> bool", &supported);
}
