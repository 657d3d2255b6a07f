// Paged decode attention for CPU: one query token per request, reading K/V straight from
// the paged cache through the block table (no gathered copy of the context).
//
// Layout: key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim];
// query [num_reqs, num_heads, head_dim]; block_table [num_reqs, max_blocks] int32;
// seq_lens [num_reqs] int32. Returns [num_reqs, num_heads, head_dim] in the query's dtype.
//
// Work is split over (request, kv head) pairs; each pair handles its group of query heads
// (GQA) so every K/V row is read once for the whole group. Two passes over the context:
// scores = q.k for every position (float32), a softmax per head, then out = sum p * v.
// Blocks are walked in order (no division per token) and, where the CPU has AVX-512, each
// K/V row is widened to float32 in registers (16 lanes at a time) -- the loop is bound by
// reading the cache, so the row is loaded once and used by every head of the group.
//
// Two per-layer options (Mistral, Phi-3, Gemma 2/3):
// - sliding_window w > 0: the query at p = seq_len - 1 sees only positions j with
//   p - w < j <= p (Hugging Face's sliding-window mask). Both passes start at the window's
//   first position instead of masking, so a long context costs only w rows of K and V.
// - soft_cap c > 0: each scaled score s becomes c * tanh(s / c) before the softmax (Gemma 2's
//   attn_logit_softcapping), one vectorised pass over the scores.
// With both 0 the hot loops are the same as without the options.
// Reference: attention/torch_ref.py (tests/unit/attention compare the two within 1e-4;
// test_decode_kernel_options.py checks the window and the cap against plain torch).
#include <torch/types.h>  // not torch/extension.h: pybind11 and the autograd API cost ~40 s of compile per file
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using pagedinfer::kVec;
#if defined(__AVX512F__)
using pagedinfer::load16;
using pagedinfer::tanh16;
#endif

// The positions one (request, kv head) pair attends to: [first, first + count) of the
// request's context, found through its block table. Scores are indexed from first, so the
// score of position first + t is at t (per head: scores[g * count + t]).
struct Span {
  const int32_t* table;
  int64_t first, count;
  int64_t block_size, row_stride, block_stride;
};

// Calls row(t, ptr) for the span's positions first + t, t < count, of one kv head, walking
// the blocks in order from the one holding `first` (entered mid-block; ptr: that position's
// head_dim values in the cache).
template <typename scalar_t, typename F>
void for_each_position(const scalar_t* cache, const Span& span, F row) {
  const int64_t block_size = span.block_size, row_stride = span.row_stride;
  int64_t b = span.first / block_size, off = span.first % block_size;
  for (int64_t t = 0; t < span.count; ++b, off = 0) {
    const int64_t n = std::min(block_size - off, span.count - t);
    const scalar_t* base = cache + static_cast<int64_t>(span.table[b]) * span.block_stride + off * row_stride;
    for (int64_t i = 0; i < n; ++i) row(t + i, base + i * row_stride);
    t += n;
  }
}

// Scores and weighted sum for one (request, kv head) pair with a generic head_dim (plain
// loops; gcc vectorises the inner products where it can).
template <typename scalar_t>
void scores_generic(const float* q, int64_t group, int64_t head_dim, const scalar_t* key_cache,
                    const Span& span, float* scores) {
  const int64_t count = span.count;
  for_each_position(key_cache, span, [&](int64_t t, const scalar_t* k) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * static_cast<float>(k[d]);
      scores[g * count + t] = s;
    }
  });
}

template <typename scalar_t>
void weighted_sum_generic(const float* scores, int64_t group, int64_t head_dim,
                          const scalar_t* value_cache, const Span& span, float* acc) {
  const int64_t count = span.count;
  std::fill(acc, acc + group * head_dim, 0.f);
  for_each_position(value_cache, span, [&](int64_t t, const scalar_t* v) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * count + t];
      float* ag = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(v[d]);
    }
  });
}

// In place: s = cap * tanh(s / cap) over n scores, in float32 as Hugging Face's Gemma 2 does
// it (a division, not a multiplication by 1 / cap, to round the same way).
inline void soft_cap_inplace(float* s, int64_t n, float cap) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vcap = _mm512_set1_ps(cap);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, _mm512_mul_ps(vcap, tanh16(_mm512_div_ps(_mm512_loadu_ps(s + i), vcap))));
#endif
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

#if defined(__AVX512F__)
// r[i] = sum of the 16 lanes of rows[i], i < 16 (rows: 16 x 16 floats): a transpose-and-add
// tree, 45 instructions for 16 sums instead of 16 horizontal reductions.
inline __m512 sum_rows16(const float* rows) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // pairs, within 128-bit lanes
    const __m512 x = _mm512_loadu_ps(rows + 32 * i), y = _mm512_loadu_ps(rows + 32 * i + 16);
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // quads: lane L of b[i] = partial sums of rows 4i..4i+3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // across 128-bit lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// head_dim = 16 * NV (64 -> NV = 4, 128 -> NV = 8, 256 -> NV = 16). Each K row is widened
// once and used by every head of the group; the 16 partial-sum vectors of a chunk are
// reduced together.
template <int NV, typename scalar_t>
void scores_avx512(const float* q, int64_t group, const scalar_t* key_cache, const Span& span,
                   float* partial, float* scores) {
  constexpr int64_t D = 16 * NV;
  const int64_t count = span.count, block_size = span.block_size, row_stride = span.row_stride;
  int64_t b = span.first / block_size, first_off = span.first % block_size;
  for (int64_t t = 0; t < count; ++b, first_off = 0) {
    const scalar_t* kb = key_cache + static_cast<int64_t>(span.table[b]) * span.block_stride;
    // Chunks of <= 16 positions within the block (block_size need not be 16, and the
    // window's first block is entered at first_off).
    for (int64_t off = first_off; off < block_size && t < count; off += 16) {
      const int64_t n = std::min<int64_t>({16, block_size - off, count - t});
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t* k = kb + (off + i) * row_stride;
        __m512 kv[NV];
        for (int j = 0; j < NV; ++j) kv[j] = load16(k + 16 * j);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q + g * D;
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
          for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), kv[j], s);
          _mm512_storeu_ps(partial + (g * 16 + i) * 16, s);
        }
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t g = 0; g < group; ++g)
        _mm512_mask_storeu_ps(scores + g * count + t, mask, sum_rows16(partial + g * 256));
      t += n;
    }
  }
}

template <int NV, int G, typename scalar_t>
void weighted_sum_avx512_fixed(const float* scores, const scalar_t* value_cache,
                               const Span& span, float* acc_out) {
  const int64_t count = span.count, block_size = span.block_size, row_stride = span.row_stride;
  // Accumulators for the whole group live in registers (G * NV <= 24).
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
  int64_t b = span.first / block_size, off = span.first % block_size;
  for (int64_t t = 0; t < count; ++b, off = 0) {
    const int64_t n = std::min(block_size - off, count - t);
    const scalar_t* vb = value_cache + static_cast<int64_t>(span.table[b]) * span.block_stride + off * row_stride;
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* v = vb + i * row_stride;
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = load16(v + 16 * j);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * count + t + i]);
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
      }
    }
    t += n;
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc_out + g * 16 * NV + 16 * j, acc[g][j]);
}

template <int NV, typename scalar_t>
void weighted_sum_avx512(const float* scores, int64_t group, const scalar_t* value_cache,
                         const Span& span, float* acc) {
  constexpr int64_t D = 16 * NV;
  const int64_t count = span.count;
  if constexpr (NV >= 16) {
    // head_dim 256: one head's 16 accumulators and its V row already fill the register
    // file, so each head takes its own sweep over V.
    for (int64_t g = 0; g < group; ++g)
      weighted_sum_avx512_fixed<NV, 1>(scores + g * count, value_cache, span, acc + g * D);
  } else {
    // Up to 4 heads per sweep keep their accumulators in registers; larger groups take
    // several sweeps (each re-reads V, which is still cheap next to the score pass).
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int64_t gn = std::min<int64_t>(4, group - g0);
      const float* s = scores + g0 * count;
      float* a = acc + g0 * D;
      switch (gn) {
        case 1: weighted_sum_avx512_fixed<NV, 1>(s, value_cache, span, a); break;
        case 2: weighted_sum_avx512_fixed<NV, 2>(s, value_cache, span, a); break;
        case 3: weighted_sum_avx512_fixed<NV, 3>(s, value_cache, span, a); break;
        default: weighted_sum_avx512_fixed<NV, 4>(s, value_cache, span, a); break;
      }
    }
  }
}
#endif

// One (request, kv head) pair: scores, soft cap, softmax, weighted sum into acc
// [group, head_dim]. NV = head_dim / 16 takes the AVX-512 loops, NV = 0 the generic ones.
template <int NV, typename scalar_t>
void attend(const float* q, int64_t group, int64_t head_dim, const scalar_t* key_cache,
            const scalar_t* value_cache, const Span& span, float soft_cap, float* partial,
            float* scores, float* acc) {
#if defined(__AVX512F__)
  if constexpr (NV > 0)
    scores_avx512<NV>(q, group, key_cache, span, partial, scores);
  else
#endif
    scores_generic(q, group, head_dim, key_cache, span, scores);
  // The heads' score rows are contiguous: one pass caps them all.
  if (soft_cap > 0.f) soft_cap_inplace(scores, group * span.count, soft_cap);
  for (int64_t g = 0; g < group; ++g) pagedinfer::softmax_inplace(scores + g * span.count, span.count);
#if defined(__AVX512F__)
  if constexpr (NV > 0)
    weighted_sum_avx512<NV>(scores, group, value_cache, span, acc);
  else
#endif
    weighted_sum_generic(scores, group, head_dim, value_cache, span, acc);
}

template <typename scalar_t>
void decode_kernel(const scalar_t* __restrict__ query, const scalar_t* __restrict__ key_cache,
                   const scalar_t* __restrict__ value_cache, const int32_t* __restrict__ block_table,
                   const int32_t* __restrict__ seq_lens, scalar_t* __restrict__ out,
                   int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                   float soft_cap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;    // next position, same kv head
  const int64_t block_stride = block_size * row_stride;  // next block
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim);
    std::vector<float> acc(group * head_dim);
    std::vector<float> scores;
    std::vector<float> partial(group * 16 * 16);  // per-chunk partial dot products
    for (int64_t work = begin; work < end; ++work) {
      const int64_t r = work / num_kv_heads;
      const int64_t kvh = work % num_kv_heads;
      const int64_t seq_len = seq_lens[r];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const Span span{block_table + r * max_blocks, first, seq_len - first,
                      block_size, row_stride, block_stride};
      const scalar_t* kc = key_cache + kvh * head_dim;
      const scalar_t* vc = value_cache + kvh * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = query + (r * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * scale;
      }
      if (static_cast<int64_t>(scores.size()) < group * span.count) scores.resize(group * span.count);
      bool done = false;
#if defined(__AVX512F__)
      if constexpr (kVec<scalar_t>) {
        done = true;
        switch (head_dim) {
          case 64: attend<4>(q.data(), group, head_dim, kc, vc, span, soft_cap, partial.data(), scores.data(), acc.data()); break;
          case 128: attend<8>(q.data(), group, head_dim, kc, vc, span, soft_cap, partial.data(), scores.data(), acc.data()); break;
          case 256: attend<16>(q.data(), group, head_dim, kc, vc, span, soft_cap, partial.data(), scores.data(), acc.data()); break;
          default: done = false;
        }
      }
#endif
      if (!done)
        attend<0>(q.data(), group, head_dim, kc, vc, span, soft_cap, partial.data(), scores.data(), acc.data());
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out + (r * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

// sliding_window: 0 = the whole context; soft_cap: 0 = no cap (see the top of the file).
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale, int64_t sliding_window,
                                     double soft_cap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "query and cache dtypes differ");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  TORCH_CHECK(soft_cap >= 0, "soft_cap must be >= 0 (0: no cap)");
  auto table = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t num_reqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(key_cache.size(3) == head_dim, "head_dim of query and cache differ");
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                            value_cache.data_ptr<scalar_t>(), table.data_ptr<int32_t>(),
                            lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_reqs, num_heads,
                            num_kv_heads, head_dim, block_size, table.size(1),
                            static_cast<float>(scale), sliding_window,
                            static_cast<float>(soft_cap));
  });
  return out;
}
