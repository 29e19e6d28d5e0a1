// nanoserve::prefill_attention: one prefill span's causal attention over its paged bfloat16 K/V,
// the prefills of the CPU-kernel attention backend (worker/attention/cpu_kernel.py).
//
// SDPA's CPU flash kernel reaches about 60 GFLOP/s on this model's heads (64 wide, 9 query and
// 3 KV heads): 5.2 ms a layer for a 512-token prompt, 30% of the prefill. Here the span's keys
// are first repacked per KV head into pairs of dimensions, 16 positions to a 512-bit vector, so
// that one vdpbf16ps per pair of dimensions scores 16 positions at once with no horizontal sum;
// the values are widened to float32 once. Then every query passes twice over the positions it
// may see, in float32, each KV head's G query heads sharing every load: the scores and their
// maximum, then the weights and the weighted values (an online softmax, as flash attention,
// rescaled its sums at every tile; two passes ran 1.35x faster here).
//
// Shapes: q (n, nq, hd) the span's queries (a strided view of the qkv matmul's output; its last
// dimension contiguous), layer (2, n_kv, S, hd) one layer of the pool with the span's own K/V
// already written, blocks (M,) the sequence's block ids for positions [0, start + n),
// start the first query's position -> out (n, nq, hd). Query i sees positions [0, start + i].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

namespace {

using nanoserve_simd::exp_neg;
using nanoserve_simd::load_bf16;
using nanoserve_simd::round_bf16;

constexpr int64_t kTile = 16;  // positions per repacked key vector
constexpr int64_t kSerialTiles = 512;  // (query, KV head, tile) triples below which one thread

#ifdef __AVX512BF16__

struct Span {
  const c10::BFloat16* q;
  int64_t q_row, q_head;            // strides, in elements
  const uint32_t* keys;             // (n_kv, tiles, hd / 2, 16): dimension pairs of 16 positions
  const float* values;              // (n_kv, tiles * 16, hd)
  c10::BFloat16* out;               // (n, nq, hd)
  int64_t nq, n_kv, tiles, start;
};

// Query i's G heads of KV head `head`, head_dim = 16 * C. `scores` holds G * 16 * tiles floats.
// Two passes over the positions it sees: the scores (kept) and their maximum, then the
// weights and the weighted values. An online softmax would rescale the sums at every tile,
// with a horizontal max, a horizontal sum and an exp on one lane per head per tile: the sums
// here are vector lanes, reduced once.
template <int G, int C>
void attend(const Span& s, int64_t i, int64_t head, float* scores) {
  constexpr int P = 8 * C;  // dimension pairs
  const int64_t last = s.start + i;  // the last position this query sees
  const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(static_cast<float>(16 * C)));
  // The queries as pairs of bfloat16, each broadcast by vdpbf16ps's memory operand.
  uint32_t q[G][P];
  for (int g = 0; g < G; ++g)
    std::memcpy(q[g], s.q + i * s.q_row + (head * G + g) * s.q_head, sizeof(q[g]));
  const uint32_t* keys = s.keys + head * s.tiles * P * kTile;
  const float* values = s.values + head * s.tiles * kTile * 16 * C;
  const int64_t tiles = last / kTile + 1;
  // Positions past this query's own in its last tile (the causal mask; also the tile's
  // padding) weigh nothing.
  const __mmask16 live =
      static_cast<__mmask16>((1u << (last - (tiles - 1) * kTile + 1)) - 1u);
  __m512 high[G];
  for (int g = 0; g < G; ++g) high[g] = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < tiles; ++j) {
    const uint32_t* k = keys + j * P * kTile;
    // Four partial sums per head: one chain of P dependent vdpbf16ps would wait on each
    // instruction's latency.
    __m512 part[G][4];
    for (int g = 0; g < G; ++g)
      for (int a = 0; a < 4; ++a) part[g][a] = _mm512_setzero_ps();
    for (int p = 0; p < P; p += 4) {  // P is a multiple of 16
#pragma GCC unroll 4
      for (int a = 0; a < 4; ++a) {
        const __m512bh kp = (__m512bh)_mm512_loadu_si512(k + (p + a) * kTile);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
          part[g][a] = _mm512_dpbf16_ps(part[g][a], (__m512bh)_mm512_set1_epi32(q[g][p + a]), kp);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m512 sc = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(part[g][0], part[g][1]),
                                              _mm512_add_ps(part[g][2], part[g][3])),
                                scale);
      if (j == tiles - 1) sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, sc);
      high[g] = _mm512_max_ps(high[g], sc);
      _mm512_storeu_ps(scores + (g * tiles + j) * kTile, sc);
    }
  }
  __m512 o[G][C], total[G];
  for (int g = 0; g < G; ++g) {
    high[g] = _mm512_set1_ps(_mm512_reduce_max_ps(high[g]));
    total[g] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) o[g][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < tiles; ++j) {
    // The tile's weights, back in `scores`: each FMA below broadcasts one from memory.
    float* weight[G];
    for (int g = 0; g < G; ++g) {
      weight[g] = scores + (g * tiles + j) * kTile;
      __m512 w = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(weight[g]), high[g]));
      if (j == tiles - 1) w = _mm512_maskz_mov_ps(live, w);  // exactly 0, whatever V holds
      total[g] = _mm512_add_ps(total[g], w);
      _mm512_storeu_ps(weight[g], w);
    }
    const float* v = values + j * kTile * 16 * C;
#pragma GCC unroll 16
    for (int t = 0; t < kTile; ++t) {
      for (int c = 0; c < C; ++c) {
        const __m512 val = _mm512_loadu_ps(v + t * 16 * C + c * 16);
        for (int g = 0; g < G; ++g)
          o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g][t]), val, o[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    c10::BFloat16* dst = s.out + (i * s.nq + head * G + g) * (16 * C);
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total[g]));
    for (int c = 0; c < C; ++c)  // nearest even, as c10::BFloat16 rounds, 16 at a time
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16),
                          round_bf16(_mm512_mul_ps(o[g][c], inv)));
  }
}

using AttendFn = void (*)(const Span&, int64_t, int64_t, float*);

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

// head_dim 32, 64 or 128 (whole pairs of 16-float chunks) and 1 to 8 query heads per KV head.
AttendFn pick(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 32: return pick_group<2>(group);
    case 64: return pick_group<4>(group);
    case 128: return pick_group<8>(group);
    default: return nullptr;
  }
}

bool supported(int64_t head_dim, int64_t group) { return pick(head_dim, group) != nullptr; }

#else  // without AVX512-BF16 the backend keeps SDPA for prefills

using AttendFn = void (*)();
bool supported(int64_t, int64_t) { return false; }

#endif

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& layer,
                             const at::Tensor& blocks, int64_t start, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && layer.dim() == 4 && blocks.dim() == 1,
              "prefill_attention: q (n, nq, hd), layer (2, n_kv, S, hd), blocks (M,)");
  const int64_t n = q.size(0), nq = q.size(1), hd = q.size(2), n_kv = layer.size(1);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && layer.scalar_type() == at::kBFloat16,
              "prefill_attention: q and layer must be bfloat16");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.stride(0) == 1,
              "prefill_attention: blocks must be contiguous int64");
  TORCH_CHECK(layer.size(0) == 2 && layer.size(3) == hd && n_kv > 0 && nq % n_kv == 0 &&
                  supported(hd, nq / n_kv),
              "prefill_attention: needs head_dim 32, 64 or 128 and 1 to 8 query heads per KV "
              "head, got ", hd, " and ", nq, " / ", n_kv);
  TORCH_CHECK(q.stride(2) == 1 && layer.stride(3) == 1 && layer.stride(2) == hd,
              "prefill_attention: the head dimension must be contiguous, and the pool's rows");
  // Every block the span reads must lie in the pool: the worker must not die of its input.
  TORCH_CHECK(block_size > 0 && layer.size(2) % block_size == 0,
              "prefill_attention: block_size must divide the pool's ", layer.size(2), " slots");
  const int64_t length = start + n, pool_blocks = layer.size(2) / block_size;
  TORCH_CHECK(start >= 0 && n > 0 && (length + block_size - 1) / block_size <= blocks.size(0),
              "prefill_attention: positions [0, ", length, ") need more than the table's ",
              blocks.size(0), " blocks");
  const int64_t* ids = blocks.data_ptr<int64_t>();
  const int64_t used = (length + block_size - 1) / block_size;
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < pool_blocks, "prefill_attention: block ", ids[j],
                " is outside the pool of ", pool_blocks);
  at::Tensor out = at::empty({n, nq, hd}, q.options());
#ifdef __AVX512BF16__
  const int64_t tiles = (length + kTile - 1) / kTile, pairs = hd / 2;
  at::Tensor keys = at::empty({n_kv, tiles, pairs, kTile}, q.options().dtype(at::kInt));
  at::Tensor values = at::empty({n_kv, tiles * kTile, hd}, q.options().dtype(at::kFloat));
  const c10::BFloat16* pool = layer.data_ptr<c10::BFloat16>();
  uint32_t* kp = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
  float* vf = values.data_ptr<float>();
  // Repack: position t of head h, dimensions (2p, 2p + 1) -> keys[h][t / 16][p][t % 16], and the
  // values widened; positions past the span's end are zeros (masked out by every query).
  // A few queries over a short prefix are less work than waking the other OpenMP threads
  // (about 0.2 us a tile of 16 positions, per query and KV head, on one thread).
  const bool serial = n * n_kv * ((start + (n + 1) / 2 + kTile - 1) / kTile) < kSerialTiles;
  auto split = [serial](int64_t count, const std::function<void(int64_t, int64_t)>& f) {
    if (serial)
      f(0, count);
    else
      at::parallel_for(0, count, 1, f);
  };
  split(n_kv * tiles, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles, j = task % tiles;
      uint32_t* kt = kp + (h * tiles + j) * pairs * kTile;
      float* vt = vf + (h * tiles + j) * kTile * hd;
      for (int64_t t = 0; t < kTile; ++t) {
        const int64_t pos = j * kTile + t;
        if (pos >= length) {
          for (int64_t p = 0; p < pairs; ++p) kt[p * kTile + t] = 0;
          std::memset(vt + t * hd, 0, hd * sizeof(float));
          continue;
        }
        const int64_t slot = ids[pos / block_size] * block_size + pos % block_size;
        const c10::BFloat16* key = pool + h * layer.stride(1) + slot * hd;
        const c10::BFloat16* value = key + layer.stride(0);
        const uint32_t* pair = reinterpret_cast<const uint32_t*>(key);
        for (int64_t p = 0; p < pairs; ++p) kt[p * kTile + t] = pair[p];
        for (int64_t c = 0; c < hd; c += 16)
          _mm512_storeu_ps(vt + t * hd + c, load_bf16(value + c));
      }
    }
  });
  Span s{q.data_ptr<c10::BFloat16>(), q.stride(0), q.stride(1), kp, vf,
         out.data_ptr<c10::BFloat16>(), nq, n_kv, tiles, start};
  const AttendFn fn = pick(hd, nq / n_kv);
  // Query i costs about start + i positions: task k takes queries k and n - 1 - k, so every
  // task (and each thread's even share of them) costs the same.
  const int64_t halves = (n + 1) / 2;
  const int64_t group = nq / n_kv;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * tiles * kTile);  // one query's, reused by the next
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % n_kv, k = task / n_kv;
      fn(s, k, h, scores.data());
      if (n - 1 - k != k) fn(s, n - 1 - k, h, scores.data());
    }
  };
  split(n_kv * halves, run);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def(
      "prefill_attention(Tensor q, Tensor layer, Tensor blocks, int start, int block_size) -> "
      "Tensor");
  // Whether prefill_attention takes this head_dim and number of query heads per KV head here.
  lib.def("prefill_attention_supports(int head_dim, int group) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("prefill_attention", &prefill_attention); }
