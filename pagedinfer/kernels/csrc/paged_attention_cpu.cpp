// Paged decode attention for CPU: one query token per request, reading K/V straight from
// the paged cache through the block table (no gathered copy of the context).
//
// Layout: key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim];
// query [num_reqs, num_heads, head_dim]; block_table [num_reqs, max_blocks] int32;
// seq_lens [num_reqs] int32. Returns [num_reqs, num_heads, head_dim] in the query's dtype.
//
// Work items are (request, part of the context, kv heads): all the kv heads where there are
// enough items without dividing them, so that each position's K (then V) rows of every kv
// head, adjacent in the cache, are read as one stretch; each kv head's group of query heads
// (GQA) takes every K/V row it reads once for the whole group. When there are fewer
// requests than kItemsPerThread per thread (small batches, long contexts), each context is
// split into parts of >= kMinPart positions so every core has work (and no part is longer
// than a share of all the positions: one long context among short ones); each part leaves
// its running max, its sum of e^(s - max) and its unnormalised weighted sum of V, and a
// second pass combines the parts (as flash-decoding does). Within an item, kChunk positions
// at a time (online softmax): scores = q.k (float32), e^(s - running max) and their sum (the
// sums so far rescaled when the max grows), then acc += sum p * v. Blocks are walked in
// order (no division per token) and each K/V row is widened to float32 in registers once
// for every head of the group: 16 lanes with AVX-512 (intrinsics), 8 lanes elsewhere (gcc
// vector types: AVX2 ymm, NEON pairs), plain loops for other head sizes. A bfloat16 cache
// with AVX512-BF16 is never widened: the (bf16) query meets each K row in vdpbf16ps
// (scores_quads: four heads per vector, no per-head reductions; scores_bf16 for groups of 1
// or 2), the scale goes on the scores, and the weights, in bf16, meet pairs of V rows in
// vdpbf16ps (weighted_sum_pairs). The blocks lie anywhere in the cache, so the scores pass
// asks for the K rows a few KB ahead of it and for the V rows the weighted sums will read
// (Ahead): the hardware prefetchers cannot guess the next block.
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

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using pagedinfer::kVec;
#if defined(__AVX512F__)
using pagedinfer::load16;
using pagedinfer::tanh16;
#endif

// int8 caches hold rows of head_dim codes followed by the row's float32 scale (4 bytes):
// value = code * scale (attention/kv_quant.py writes them; so does paged_decode_step).
template <typename T>
constexpr bool kQ8 = std::is_same_v<T, int8_t>;
constexpr int64_t kQ8ScaleBytes = 4;

// The scale of a cache row (1 for float caches: the multiplications fold away).
template <typename cache_t>
inline float row_scale(const cache_t* row, int64_t head_dim) {
  if constexpr (kQ8<cache_t>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof s);
    return s;
  } else {
    (void)row, (void)head_dim;
    return 1.f;
  }
}

constexpr int64_t kVChunk = 32;  // positions of V a weighted sum takes at a time (see attend)
constexpr int64_t kItemsPerThread = 4;  // below this many requests per thread, contexts
                                        // are split into parts
constexpr int64_t kMinPart = 128;       // positions per part at least (the combine step
                                        // costs about one position's work per part)

// The positions one work item (request, its kv heads) attends to: [first, first + count) of the
// request's context, found through its block table. Scores are indexed from first, so the
// score of position first + t is at t (per head: scores[g * count + t]).
struct Span {
  const int32_t* table;
  int64_t first, count;
  int64_t block_size, row_stride, block_stride;
  int64_t heads;        // consecutive kv heads the item covers (their rows are adjacent)
  int64_t head_stride;  // cache elements from one kv head's row to the next one's
  int64_t row_bytes;    // the bytes of a position the item reads: its heads' rows
};

// Walks the span's positions kAheadBytes of rows ahead of the scores pass, block table and
// all, and asks for their K rows (into L1: read next) and V rows (into L2: the weighted
// sums read them after the chunk's scores and ask for nothing themselves). Without it each
// core waits on one block's DRAM lines at a time: the blocks lie anywhere, and the hardware
// prefetchers stop at each 4 KiB page. Measured (docs/benchmarks.md "Decode attention: all
// kv heads in one walk, V asked for early"): 1.15-1.6x the GB/s from DRAM, most of it from
// V. Not far ahead: each prefetch holds one of the core's few L1 miss buffers (AMD: whatever
// its hint) until its line comes, so a long run of them stalls the loads behind it; with
// the one-pass kernel 3 KB (at least 4 positions) beat 6 KB by 1.06-1.10x at SmolLM2's
// shapes and 1.01-1.03x at the 1B's, and 8 positions lost 0.86-0.93x at the 1B's
// ("Decode attention: one pass over K and V, no per-head reductions").
constexpr int64_t kAheadBytes = 3 << 10;

template <typename scalar_t>
struct Ahead {
  const char* k;
  const char* v;
  const Span& span;
  int64_t b, off, left;  // the block and offset of the next position to ask for; positions left

  Ahead(const scalar_t* key_cache, const scalar_t* value_cache, const Span& s)
      : k(reinterpret_cast<const char*>(key_cache)), v(reinterpret_cast<const char*>(value_cache)),
        span(s), b(s.first / s.block_size), off(s.first % s.block_size), left(s.count) {
    const int64_t rows = std::max<int64_t>(4, kAheadBytes / s.row_bytes);
    for (int64_t i = 0; i < rows; ++i) step();
  }

  // Asks for the next position's rows (one more each time the walk moves on by one).
  inline void step() {
    if (left <= 0) return;
    const int64_t at = (static_cast<int64_t>(span.table[b]) * span.block_stride + off * span.row_stride) *
                       static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t l = 0; l < span.row_bytes; l += 64) {
      __builtin_prefetch(k + at + l, 0, 3);
      __builtin_prefetch(v + at + l, 0, 2);
    }
    --left;
    if (++off == span.block_size) off = 0, ++b;
  }
};

// Calls row(t, ptr) for the span's positions first + t, t < count, walking the blocks in
// order from the one holding `first` (entered mid-block; ptr: that position's row of the
// cache pointer's kv head, the span's other heads follow at head_stride).
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

// Calls chunk(rows, t, n) for the span's positions in runs of n <= L consecutive ones within
// a block (block_size need not be a multiple of L, and a window's first block is entered
// mid-way): rows is position first + t's row of the cache pointer's kv head.
template <int64_t L, typename scalar_t, typename F>
void for_each_chunk(const scalar_t* cache, const Span& span, F chunk) {
  const int64_t block_size = span.block_size;
  int64_t b = span.first / block_size, first_off = span.first % block_size;
  for (int64_t t = 0; t < span.count; ++b, first_off = 0)
    for (int64_t off = first_off; off < block_size && t < span.count; off += L) {
      const int64_t n = std::min<int64_t>({L, block_size - off, span.count - t});
      chunk(cache + static_cast<int64_t>(span.table[b]) * span.block_stride + off * span.row_stride, t, n);
      t += n;
    }
}

// Scores and weighted sum for one (request, kv head) pair with a generic head_dim (plain
// loops; gcc vectorises the inner products where it can).
template <typename scalar_t>
void scores_generic(const float* q, int64_t group, int64_t head_dim, const scalar_t* key_cache,
                    const Span& span, Ahead<scalar_t>& ahead, float* scores) {
  const int64_t count = span.count;
  for_each_position(key_cache, span, [&](int64_t t, const scalar_t* row) {
    ahead.step();
    for (int64_t hg = 0; hg < span.heads * group; ++hg) {
      const scalar_t* k = row + hg / group * span.head_stride;
      const float* qg = q + hg * head_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * static_cast<float>(k[d]);
      scores[hg * count + t] = s * row_scale(k, head_dim);
    }
  });
}

// The weighted sums below add sum over the span of p[g, t] * v_t to acc [group, head_dim],
// head g's weights at scores[g * stride + t] (attend() hands them the span in chunks).
template <typename scalar_t>
void weighted_sum_generic(const float* scores, int64_t stride, int64_t group, int64_t head_dim,
                          const scalar_t* value_cache, const Span& span, float* acc) {
  for_each_position(value_cache, span, [&](int64_t t, const scalar_t* v) {
    const float vs = row_scale(v, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * stride + t] * vs;
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
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

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
                   Ahead<scalar_t>& ahead, float* partial, float* scores) {
  constexpr int64_t D = 16 * NV;
  const int64_t count = span.count, row_stride = span.row_stride;
  for_each_chunk<16>(key_cache, span, [&](const scalar_t* kb, int64_t t, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      ahead.step();
      for (int64_t h = 0; h < span.heads; ++h) {
        const scalar_t* k = kb + i * row_stride + h * span.head_stride;
        __m512 kv[NV];
        for (int j = 0; j < NV; ++j) kv[j] = load16(k + 16 * j);
        const __m512 ks = _mm512_set1_ps(row_scale(k, D));
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          const float* qg = q + g * D;
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
          for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), kv[j], s);
          if constexpr (kQ8<scalar_t>) s = _mm512_mul_ps(s, ks);
          _mm512_storeu_ps(partial + (g * 16 + i) * 16, s);
        }
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t g = 0; g < span.heads * group; ++g)
      _mm512_mask_storeu_ps(scores + g * count + t, mask, sum_rows16(partial + g * 256));
  });
}

template <int NV, int G, typename scalar_t>
void weighted_sum_avx512_fixed(const float* scores, int64_t stride, const scalar_t* value_cache,
                               const Span& span, float* acc_out) {
  const int64_t count = span.count, block_size = span.block_size, row_stride = span.row_stride;
  // Accumulators for the whole group live in registers (G * NV <= 24).
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_loadu_ps(acc_out + g * 16 * NV + 16 * j);
  int64_t b = span.first / block_size, off = span.first % block_size;
  for (int64_t t = 0; t < count; ++b, off = 0) {
    const int64_t n = std::min(block_size - off, count - t);
    const scalar_t* vb = value_cache + static_cast<int64_t>(span.table[b]) * span.block_stride + off * row_stride;
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* v = vb + i * row_stride;
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = load16(v + 16 * j);
      const float vs = row_scale(v, 16 * NV);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * stride + t + i] * vs);
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
      }
    }
    t += n;
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc_out + g * 16 * NV + 16 * j, acc[g][j]);
}

template <int NV, typename scalar_t>
void weighted_sum_avx512(const float* scores, int64_t stride, int64_t group,
                         const scalar_t* value_cache, const Span& span, float* acc) {
  constexpr int64_t D = 16 * NV;
  if constexpr (NV >= 16) {
    // head_dim 256: one head's 16 accumulators and its V row already fill the register
    // file, so each head takes its own sweep over V.
    for (int64_t g = 0; g < group; ++g)
      weighted_sum_avx512_fixed<NV, 1>(scores + g * stride, stride, value_cache, span, acc + g * D);
  } else {
    // Up to 4 heads per sweep keep their accumulators in registers; larger groups take
    // several sweeps (each re-reads the chunk's V rows from L1).
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int64_t gn = std::min<int64_t>(4, group - g0);
      const float* s = scores + g0 * stride;
      float* a = acc + g0 * D;
      switch (gn) {
        case 1: weighted_sum_avx512_fixed<NV, 1>(s, stride, value_cache, span, a); break;
        case 2: weighted_sum_avx512_fixed<NV, 2>(s, stride, value_cache, span, a); break;
        case 3: weighted_sum_avx512_fixed<NV, 3>(s, stride, value_cache, span, a); break;
        default: weighted_sum_avx512_fixed<NV, 4>(s, stride, value_cache, span, a); break;
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// A bfloat16 cache (so a bfloat16 query: the cache is in the query's dtype) with AVX512-BF16:
// each K row meets the query in vdpbf16ps, 32 dimensions per instruction with no widening
// (the products of two bf16 values are exact in float32; only the summation order differs
// from the float32 path). The query is the unscaled bf16 one, so exact in bf16; the scores
// are scaled after the sums.
constexpr bool kDotBf16 = true;

template <int NV>
void scores_bf16(const __m512bh* qb, int64_t group, const c10::BFloat16* key_cache, const Span& span,
                 Ahead<c10::BFloat16>& ahead, float scale, float* partial, float* scores) {
  constexpr int NP = NV / 2;  // zmm of 32 bf16 per row
  const int64_t count = span.count, row_stride = span.row_stride;
  const __m512 sc = _mm512_set1_ps(scale);
  for_each_chunk<16>(key_cache, span, [&](const c10::BFloat16* kb, int64_t t, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      ahead.step();
      for (int64_t h = 0; h < span.heads; ++h) {
        const c10::BFloat16* k = kb + i * row_stride + h * span.head_stride;
        __m512bh kv[NP];
        for (int j = 0; j < NP; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(k + 32 * j);
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g * NP], kv[0]);
          for (int j = 1; j < NP; ++j) s = _mm512_dpbf16_ps(s, qb[g * NP + j], kv[j]);
          _mm512_storeu_ps(partial + (g * 16 + i) * 16, s);
        }
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t g = 0; g < span.heads * group; ++g)
      _mm512_mask_storeu_ps(scores + g * count + t, mask, _mm512_mul_ps(sum_rows16(partial + g * 256), sc));
  });
}

// Groups of 3+ query heads per kv head (the scores pass of scores_bf16 reduces 16 lanes per
// head and position: a transpose-and-add of 16 vectors per head, stored and loaded again,
// cost ~1.5x the dot products themselves). Here a vector holds four heads, one per 128-bit
// lane: qv[k] = dimensions 8k..8k+7 of heads 0-3 (a missing head's lane is zero), and each
// K row's 16-byte pieces are broadcast to the four lanes (a load, no shuffle), so the
// vdpbf16ps of a row leaves four partial sums per head; four positions' vectors reduce to
// one (6 shuffles, 3 adds) and four of those to a vector of 16 positions per head (8
// shuffles): ~2 shuffles per position and head quad instead of ~30 per position and head.
// The lanes of a group of 3 are a quarter idle; below 3 scores_bf16 keeps its reduction.
constexpr int64_t kQuadMinGroup = 3;

// lane l of the result: the sum of the four floats of 128-bit lane l of a[0..3]: a[m] lane l
// -> element m of lane l.
inline __m512 sum_lanes4(const __m512 a[4]) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512d x = _mm512_castps_pd(s01), y = _mm512_castps_pd(s23);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// The query heads of an item packed for scores_quads from their bf16 rows qb (NV / 2
// vectors of 32 per head): for kv head h, quad u (heads 4u..4u+3 of its group), piece k:
// qv[(h * quads + u) * 2 * NV + k].
template <int NV>
void pack_query_quads(const __m512bh* qb, int64_t heads, int64_t group, __m512i* qv) {
  constexpr int KC = 2 * NV;  // 8-dimension (16-byte) pieces per head
  const int64_t quads = (group + 3) / 4;
  const char* rows = reinterpret_cast<const char*>(qb);
  char* out = reinterpret_cast<char*>(qv);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t u = 0; u < quads; ++u)
      for (int k = 0; k < KC; ++k)
        for (int64_t l = 0; l < 4; ++l) {
          char* dst = out + (((h * quads + u) * KC + k) * 4 + l) * 16;
          if (4 * u + l < group) std::memcpy(dst, rows + ((h * group + 4 * u + l) * KC + k) * 16, 16);
          else std::memset(dst, 0, 16);
        }
}

// rq: [heads * quads][4] vectors of the chunk's sums (see below), from the caller: on the
// stack for up to 16 kv heads' quads.
template <int NV>
void scores_quads(const __m512i* qv, int64_t group, const c10::BFloat16* key_cache, const Span& span,
                  Ahead<c10::BFloat16>& ahead, float scale, float* scores, __m512* rq) {
  constexpr int KC = 2 * NV;
  const int64_t count = span.count, row_stride = span.row_stride;
  const int64_t quads = (group + 3) / 4;
  const __m512 sc = _mm512_set1_ps(scale);
  for_each_chunk<16>(key_cache, span, [&](const c10::BFloat16* kb, int64_t t, int64_t n) {
    // Four positions at a time, every kv head of each (their rows are adjacent): rq[(h *
    // quads + u) * 4 + Q] lane l = head 4u + l of kv head h at positions 4Q..4Q+3.
    for (int64_t Q = 0; Q < 4; ++Q) {
      if (4 * Q >= n) {
        for (int64_t i = 0; i < span.heads * quads; ++i) rq[4 * i + Q] = _mm512_setzero_ps();
        continue;
      }
      for (int64_t i = 4 * Q; i < std::min<int64_t>(4 * Q + 4, n); ++i) ahead.step();
      // Quads outermost: with them inside, gcc hoists the rows' loads out of the quad loop
      // and spills them.
      for (int64_t u = 0; u < quads; ++u)
        for (int64_t h = 0; h < span.heads; ++h) {
          const c10::BFloat16* k = kb + h * span.head_stride;
          const __m512i* qq = qv + (h * quads + u) * KC;
          __m512 a[4], a2[4];
          for (int m = 0; m < 4; ++m) {
            // Positions past the chunk's end repeat its last row (their lanes are not stored).
            const c10::BFloat16* row = k + std::min<int64_t>(4 * Q + m, n - 1) * row_stride;
            a[m] = a2[m] = _mm512_setzero_ps();
            for (int c = 0; c < KC; c += 2) {
              const __m512i x = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * c)));
              const __m512i y = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * c + 8)));
              a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)x, (__m512bh)qq[c]);
              a2[m] = _mm512_dpbf16_ps(a2[m], (__m512bh)y, (__m512bh)qq[c + 1]);
            }
            a[m] = _mm512_add_ps(a[m], a2[m]);
          }
          rq[(h * quads + u) * 4 + Q] = sum_lanes4(a);
        }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t h = 0; h < span.heads; ++h)
      for (int64_t u = 0; u < quads; ++u) {
        // 128-bit lane l of r[0..3] -> head 4u + l's 16 positions in order.
        const __m512* r = rq + (h * quads + u) * 4;
        const __m512 v0 = _mm512_shuffle_f32x4(r[0], r[1], 0x44), v1 = _mm512_shuffle_f32x4(r[0], r[1], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(r[2], r[3], 0x44), v3 = _mm512_shuffle_f32x4(r[2], r[3], 0xEE);
        const __m512 out[4] = {_mm512_shuffle_f32x4(v0, v2, 0x88), _mm512_shuffle_f32x4(v0, v2, 0xDD),
                               _mm512_shuffle_f32x4(v1, v3, 0x88), _mm512_shuffle_f32x4(v1, v3, 0xDD)};
        const int64_t live = std::min<int64_t>(4, group - 4 * u);
        for (int64_t l = 0; l < live; ++l)
          _mm512_mask_storeu_ps(scores + (h * group + 4 * u + l) * count + t, mask, _mm512_mul_ps(out[l], sc));
      }
  });
}

// The weights of a bfloat16 cache's weighted sums in bf16, as torch's own CPU flash
// attention and Hugging Face's eager attention take them for a bf16 model (the product with
// V in bf16, summed in float32): a head's row of n float weights becomes n bf16 ones in
// place (the row's first half; position t's at index t), with a 0 after an odd n so that
// positions pair up.
inline void weights_to_bf16_inplace(float* s, int64_t n) {
  auto* d = reinterpret_cast<uint16_t*>(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)  // writes bytes [2i, 2i + 32): below the next read at 4i + 64
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i)));
  for (; i < n; ++i) {
    const c10::BFloat16 x(s[i]);
    std::memcpy(d + i, &x, 2);
  }
  if (n % 2) d[n] = 0;
}

// V weighted sums with vdpbf16ps: two positions at a time, their V rows interleaved 16 bits
// at a time (unpacklo/hi_epi16: dimension d of both rows in one 32-bit lane) meet the pair of
// weights (w_t, w_t+1) broadcast, so one instruction adds 16 dimensions of both positions:
// half the multiply-adds of widening V to float32, and no widening. The accumulators hold
// each 32 dimensions as [lo 16][hi 16] (lo: 128-bit lane L's dimensions 8L..8L+3, hi:
// 8L+4..8L+7; `interleave_pairs_acc` puts them in order). `pairs`: head g's weights for the
// span's positions 2i, 2i + 1 at pairs[g * stride + i] (weights_to_bf16_inplace's rows,
// stride in 32-bit words); the chunk starts at an even position of the span.
template <int NV, int G>
void weighted_sum_pairs_fixed(const uint32_t* pairs, int64_t stride, const c10::BFloat16* value_cache,
                              const Span& span, float* acc_out) {
  constexpr int NP = NV / 2;  // zmm of 32 bf16 per row
  const int64_t count = span.count, block_size = span.block_size, row_stride = span.row_stride;
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_loadu_ps(acc_out + g * 16 * NV + 16 * j);
  int64_t b = span.first / block_size, off = span.first % block_size;
  auto row_at = [&]() {
    return value_cache + static_cast<int64_t>(span.table[b]) * span.block_stride + off * row_stride;
  };
  for (int64_t t = 0; t < count; t += 2) {
    const c10::BFloat16* v0 = row_at();
    if (++off == block_size) off = 0, ++b;
    // An odd count's last position pairs with itself under a zero weight.
    const c10::BFloat16* v1 = v0;
    if (t + 1 < count) {
      v1 = row_at();
      if (++off == block_size) off = 0, ++b;
    }
    __m512bh lo[NP], hi[NP];
    for (int j = 0; j < NP; ++j) {
      const __m512i x0 = _mm512_loadu_si512(v0 + 32 * j), x1 = _mm512_loadu_si512(v1 + 32 * j);
      lo[j] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
      hi[j] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pairs[g * stride + t / 2]));
      for (int j = 0; j < NP; ++j) {
        acc[g][2 * j] = _mm512_dpbf16_ps(acc[g][2 * j], lo[j], w);
        acc[g][2 * j + 1] = _mm512_dpbf16_ps(acc[g][2 * j + 1], hi[j], w);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc_out + g * 16 * NV + 16 * j, acc[g][j]);
}

template <int NV>
void weighted_sum_pairs(const uint32_t* pairs, int64_t stride, int64_t group,
                        const c10::BFloat16* value_cache, const Span& span, float* acc) {
  constexpr int64_t D = 16 * NV;
  // Heads per sweep: their accumulators (G x NV vectors) and the pair's 2 x NV / 2 rows in
  // the 32 registers.
  constexpr int64_t kMaxG = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
  for (int64_t g0 = 0; g0 < group; g0 += kMaxG) {
    const int64_t gn = std::min<int64_t>(kMaxG, group - g0);
    const uint32_t* p = pairs + g0 * stride;
    float* a = acc + g0 * D;
    switch (gn) {
      case 1: weighted_sum_pairs_fixed<NV, 1>(p, stride, value_cache, span, a); break;
      case 2: if constexpr (kMaxG >= 2) weighted_sum_pairs_fixed<NV, 2>(p, stride, value_cache, span, a); break;
      case 3: if constexpr (kMaxG >= 3) weighted_sum_pairs_fixed<NV, 3>(p, stride, value_cache, span, a); break;
      default: if constexpr (kMaxG >= 4) weighted_sum_pairs_fixed<NV, 4>(p, stride, value_cache, span, a); break;
    }
  }
}

// [lo 16][hi 16] per 32 dimensions (weighted_sum_pairs) -> the dimensions in order.
inline void interleave_pairs_acc(float* acc, int64_t rows, int64_t D) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t at = 0; at < rows * D; at += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + at), hi = _mm512_loadu_ps(acc + at + 16);
    _mm512_storeu_ps(acc + at, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(acc + at + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#else
constexpr bool kDotBf16 = false;
#endif

#if !defined(__AVX512F__)
// 8 float lanes in gcc vector types (AVX2: one ymm; NEON: two q registers).
using V8 = pagedinfer::F8v;
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline V8 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  U16x8 raw;
  std::memcpy(&raw, p, sizeof raw);
  return reinterpret_cast<V8>(__builtin_convertvector(raw, U32x8) << 16);
}
inline V8 load8(const c10::Half* p) {
#if defined(__F16C__)
  return reinterpret_cast<V8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  V8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline V8 load8(const int8_t* p) {
#if defined(__AVX2__)
  return reinterpret_cast<V8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  typedef int8_t I8x8 __attribute__((vector_size(8)));
  I8x8 raw;
  std::memcpy(&raw, p, sizeof raw);
  return __builtin_convertvector(raw, V8);
#endif
}

// out[i] = sum of the 8 lanes of rows[i], i < 8 (rows: 8 x 8 floats).
inline void sum_rows8(const float* rows, float* out) {
#if defined(__AVX__)
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + 8 * i);
  // hadd pairs: lanes of t0 = (r0 01, r0 23, r1 01, r1 23 | r0 45, r0 67, r1 45, r1 67) ...
  const __m256 t0 = _mm256_hadd_ps(r[0], r[1]), t1 = _mm256_hadd_ps(r[2], r[3]);
  const __m256 t2 = _mm256_hadd_ps(r[4], r[5]), t3 = _mm256_hadd_ps(r[6], r[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = (r0 lo, r1 lo, r2 lo, r3 lo | r0 hi, r1 hi, r2 hi, r3 hi): add the 128-bit halves.
  const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
#else
  for (int i = 0; i < 8; ++i) {
    float total = 0.f;
    for (int l = 0; l < 8; ++l) total += rows[8 * i + l];
    out[i] = total;
  }
#endif
}

// head_dim = 8 * NV. Each K row is widened once and used by every head of the group; the 8
// partial-sum vectors of a chunk of positions are reduced together.
template <int NV, typename scalar_t>
void scores_vec8(const float* q, int64_t group, const scalar_t* key_cache, const Span& span,
                 Ahead<scalar_t>& ahead, float* partial, float* scores) {
  constexpr int64_t D = 8 * NV;
  const int64_t count = span.count, row_stride = span.row_stride;
  float sums[8];
  for_each_chunk<8>(key_cache, span, [&](const scalar_t* kb, int64_t t, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      ahead.step();
      for (int64_t h = 0; h < span.heads; ++h) {
        const scalar_t* k = kb + i * row_stride + h * span.head_stride;
        V8 kv[NV];
        for (int j = 0; j < NV; ++j) kv[j] = load8(k + 8 * j);
        const float ks = row_scale(k, D);
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          const float* qg = q + g * D;
          V8 s0 = load8(qg) * kv[0], s1{};
          for (int j = 1; j < NV; ++j) {
            if (j & 1) s1 += load8(qg + 8 * j) * kv[j];
            else s0 += load8(qg + 8 * j) * kv[j];
          }
          V8 s = s0 + s1;
          if constexpr (kQ8<scalar_t>) s *= ks;
          std::memcpy(partial + (g * 8 + i) * 8, &s, sizeof s);
        }
      }
    }
    for (int64_t g = 0; g < span.heads * group; ++g) {
      if (n == 8) {  // sum straight into place (a variable-length copy is a slow rep movs)
        sum_rows8(partial + g * 64, scores + g * count + t);
      } else {
        sum_rows8(partial + g * 64, sums);
        std::memcpy(scores + g * count + t, sums, n * sizeof(float));
      }
    }
  });
}

// acc[g] = sum over the span of p[g, t] * v_t. float32 caches: head by head, 8 vectors of
// accumulators in registers at a time and the V rows read as FMA memory operands (the other
// heads find them in L1/L2): ~9 instructions per head and position instead of ~25 with the
// accumulators in memory. 16-bit caches: one sweep, each row widened once for the group.
// int8 rows: G heads' accumulators for C of the row's NV vectors stay in registers, each
// row's C vectors widened once for all G heads; one sweep per C vectors (the rows, 68 bytes
// for head_dim 64, come back from L1/L2).
template <int NV, int G, int C>
void weighted_sum_q8(const float* scores, int64_t stride, const int8_t* value_cache,
                     const Span& span, float* acc) {
  constexpr int64_t D = 8 * NV;
  for (int j0 = 0; j0 < NV; j0 += C) {
    V8 a[G][C];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < C; ++j) a[g][j] = load8(acc + g * D + 8 * (j0 + j));
    for_each_position(value_cache, span, [&](int64_t t, const int8_t* v) {
      const float vs = row_scale(v, D);
      V8 vv[C];
      for (int j = 0; j < C; ++j) vv[j] = load8(v + 8 * (j0 + j));
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * stride + t] * vs;
        for (int j = 0; j < C; ++j) a[g][j] += p * vv[j];
      }
    });
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < C; ++j) std::memcpy(acc + g * D + 8 * (j0 + j), &a[g][j], sizeof(V8));
  }
}

template <int NV, typename scalar_t>
void weighted_sum_vec8(const float* scores, int64_t stride, int64_t group,
                       const scalar_t* value_cache, const Span& span, float* acc) {
  constexpr int64_t D = 8 * NV;
  if constexpr (kQ8<scalar_t>) {
    // Up to 3 heads a sweep: 3 x 2 accumulators + 2 rows (+ the weights) fit 16 ymm
    // registers; 1-2 heads take 4 vectors a sweep.
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
      const float* s = scores + g0 * stride;
      float* a = acc + g0 * D;
      switch (std::min<int64_t>(3, group - g0)) {
        case 1: weighted_sum_q8<NV, 1, 4>(s, stride, value_cache, span, a); break;
        case 2: weighted_sum_q8<NV, 2, 4>(s, stride, value_cache, span, a); break;
        default: weighted_sum_q8<NV, 3, 2>(s, stride, value_cache, span, a); break;
      }
    }
    return;
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    constexpr int C = NV < 8 ? NV : 8;  // accumulator vectors per pass
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * stride;
      for (int j0 = 0; j0 < NV; j0 += C) {
        V8 a[C];
        for (int j = 0; j < C; ++j) a[j] = load8(acc + g * D + 8 * (j0 + j));
        for_each_position(value_cache, span, [&](int64_t t, const float* v) {
          const float pt = p[t];
          for (int j = 0; j < C; ++j) a[j] += pt * load8(v + 8 * (j0 + j));
        });
        for (int j = 0; j < C; ++j) std::memcpy(acc + g * D + 8 * (j0 + j), &a[j], sizeof(V8));
      }
    }
    return;
  }
  for_each_position(value_cache, span, [&](int64_t t, const scalar_t* v) {
    V8 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load8(v + 8 * j);
    const float vs = row_scale(v, D);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * stride + t] * vs;
      float* ag = acc + g * D;
      for (int j = 0; j < NV; ++j) {
        V8 a = load8(ag + 8 * j);
        a += p * vv[j];
        std::memcpy(ag + 8 * j, &a, sizeof a);
      }
    }
  });
}
#endif

// The causal (and window) limits of a query tile's rows within one work item's span: row r
// sees the span's positions t in [lo[r], hi[r]) (a decode: the whole span).
struct RowLimits {
  const int64_t* lo;
  const int64_t* hi;
  int64_t rows;  // nullptr limits: every row sees the whole span
};

// Whether a cache of cache_t with this head_dim takes the vdpbf16ps paths (scores_bf16):
// then the query comes unscaled and `attend` scales the scores.
template <typename cache_t>
inline bool dot_bf16(int64_t head_dim) {
  return kDotBf16 && std::is_same_v<cache_t, c10::BFloat16> &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

// One work item: the unnormalised weighted sum of V into acc [span.heads * group, head_dim]
// with, per head row, the max of its scores (m) and the sum of e^(s - m) (l). `group` counts
// the query heads of one kv head times the tile's rows (row-major: row r's heads are r *
// heads_per_row ...); the span's kv heads follow one another (kv head h's head rows start at
// h * group). NV = head_dim / lanes takes the vector loops (16 lanes with AVX-512, else 8),
// NV = 0 the generic ones. score_scale: what the vdpbf16ps path (`dot_bf16`) multiplies its
// scores by; the other paths get a scaled query.
//
// The span is taken kChunk positions at a time (online softmax, as flash-decoding does within
// a part): the chunk's scores, soft cap and the tile's masks, e^(s - m) against the running
// max (the sums so far rescaled when it grows), then the chunk's weighted sums. K and V of a
// chunk are read close together, so the reads Ahead asks for keep coming while the weighted
// sums run (with the whole span's scores first and its weighted sums after, reading V back
// from L2, the memory waited through the second pass), and the scores stay in L1
// (docs/benchmarks.md "Decode attention: one pass over K and V, no per-head reductions").
constexpr int64_t kChunk = 128;

template <int NV, typename scalar_t>
void attend(const float* q, int64_t group, int64_t head_dim, const scalar_t* key_cache,
            const scalar_t* value_cache, const Span& span, float soft_cap, const RowLimits& limits,
            float score_scale, float* partial, float* scores, float* acc, float* m, float* l) {
  constexpr bool kDot = kDotBf16 && NV > 0 && std::is_same_v<scalar_t, c10::BFloat16>;
  const int64_t rows = span.heads * group;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  // The query rows in bf16 (exact: they were bf16), and for scores_quads packed by four
  // heads; on the stack up to 256 vectors each (32 heads of 256, or 8 kv heads' quads of
  // 128).
  constexpr int NP = NV / 2;
  const bool quads = group >= kQuadMinGroup;
  const int64_t packed = quads ? span.heads * ((group + 3) / 4) * 2 * NV : 0;
  __m512bh stack[kDot ? 32 * 8 : 1];
  __m512i stack_qv[kDot ? 32 * 8 : 1];
  __m512 stack_rq[kDot ? 16 * 4 : 1];
  std::vector<__m512bh> heap;
  std::vector<__m512i> heap_qv;
  std::vector<__m512> heap_rq;
  __m512bh* qb = stack;
  __m512i* qv = stack_qv;
  __m512* rq = stack_rq;
  if constexpr (kDot) {
    if (rows * NP > 32 * 8) heap.resize(rows * NP), qb = heap.data();
    if (packed > 32 * 8) heap_qv.resize(packed), qv = heap_qv.data();
    if (packed / (2 * NV) > 16) heap_rq.resize(packed / (2 * NV) * 4), rq = heap_rq.data();
    for (int64_t g = 0; g < rows; ++g)
      for (int j = 0; j < NP; ++j) {
        const float* qg = q + g * head_dim + 32 * j;
        qb[g * NP + j] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + 16), _mm512_loadu_ps(qg));
      }
    if (quads) pack_query_quads<NV>(qb, span.heads, group, qv);
  }
#endif
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  std::fill(acc, acc + rows * head_dim, 0.f);
  std::fill(m, m + rows, kMasked);
  std::fill(l, l + rows, 0.f);
  const int64_t per_row = limits.lo == nullptr ? group : group / limits.rows;
  Ahead<scalar_t> ahead(key_cache, value_cache, span);
  for (int64_t c0 = 0; c0 < span.count; c0 += kChunk) {
    Span chunk = span;
    chunk.first += c0;
    const int64_t count = chunk.count = std::min(kChunk, span.count - c0);
    // Scores [rows, count] of the chunk.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (kDot) {
      if (quads) scores_quads<NV>(qv, group, key_cache, chunk, ahead, score_scale, scores, rq);
      else scores_bf16<NV>(qb, group, key_cache, chunk, ahead, score_scale, partial, scores);
    } else
#endif
#if defined(__AVX512F__)
    if constexpr (NV > 0)
      scores_avx512<NV>(q, group, key_cache, chunk, ahead, partial, scores);
    else
#else
    if constexpr (NV > 0)
      scores_vec8<NV>(q, group, key_cache, chunk, ahead, partial, scores);
    else
#endif
      scores_generic(q, group, head_dim, key_cache, chunk, ahead, scores);
    // The heads' score rows are contiguous: one pass caps them all.
    if (soft_cap > 0.f) soft_cap_inplace(scores, rows * count, soft_cap);
    for (int64_t g = 0; g < rows; ++g) {
      float* s = scores + g * count;
      if (limits.lo != nullptr) {
        const int64_t r = g % group / per_row;
        const int64_t lo = std::clamp<int64_t>(limits.lo[r] - c0, 0, count);
        const int64_t hi = std::clamp<int64_t>(limits.hi[r] - c0, 0, count);
        if (hi <= lo) {  // this row sees none of the chunk (before its window or after it)
          std::fill(s, s + count, 0.f);
          continue;
        }
        std::fill(s, s + lo, kMasked);
        std::fill(s + hi, s + count, kMasked);
      }
      const float before = m[g];
      const float sum = pagedinfer::exp_shifted_inplace(s, count, m + g);
      if (m[g] > before && l[g] > 0.f) {  // the max grew: rescale what the row has so far
        const float shrink = std::exp(before - m[g]);
        l[g] *= shrink;
        float* a = acc + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= shrink;
      }
      l[g] += sum;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (kDot) weights_to_bf16_inplace(s, count);
#endif
    }
    // The weighted sums sweep V once per kv head and few query heads, kVChunk positions at
    // a time, which stay in L1 while every head takes its turn.
    for (int64_t v0 = 0; v0 < count; v0 += kVChunk) {
      Span piece = chunk;
      piece.first += v0;
      piece.count = std::min(kVChunk, count - v0);
      for (int64_t h = 0; h < span.heads; ++h) {
        const float* sh = scores + h * group * count + v0;
        const scalar_t* vh = value_cache + h * span.head_stride;
        float* ah = acc + h * group * head_dim;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if constexpr (kDot)
          weighted_sum_pairs<NV>(reinterpret_cast<const uint32_t*>(scores + h * group * count) + v0 / 2, count,
                                 group, vh, piece, ah);
        else
#endif
#if defined(__AVX512F__)
        if constexpr (NV > 0)
          weighted_sum_avx512<NV>(sh, count, group, vh, piece, ah);
        else
#else
        if constexpr (NV > 0)
          weighted_sum_vec8<NV>(sh, count, group, vh, piece, ah);
        else
#endif
          weighted_sum_generic(sh, count, group, head_dim, vh, piece, ah);
      }
    }
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (kDot) interleave_pairs_acc(acc, rows, head_dim);
#endif
}

template <typename cache_t>
void attend_any(const float* q, int64_t group, int64_t head_dim, const cache_t* kc,
                const cache_t* vc, const Span& span, float soft_cap, const RowLimits& limits,
                float score_scale, float* partial, float* scores, float* acc, float* m, float* l) {
#if defined(__AVX512F__)
  if constexpr (kVec<cache_t> || kQ8<cache_t>) {
    switch (head_dim) {
      case 64: return attend<4>(q, group, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial, scores, acc, m, l);
      case 128: return attend<8>(q, group, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial, scores, acc, m, l);
      case 256: return attend<16>(q, group, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial, scores, acc, m, l);
      default: break;
    }
  }
#else
  if constexpr (pagedinfer::kVecType<cache_t> || kQ8<cache_t>) {
    switch (head_dim) {
      case 64: return attend<8>(q, group, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial, scores, acc, m, l);
      case 128: return attend<16>(q, group, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial, scores, acc, m, l);
      case 256: return attend<32>(q, group, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial, scores, acc, m, l);
      default: break;
    }
  }
#endif
  attend<0>(q, group, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial, scores, acc, m, l);
}

// Query rows of one request attended together: every K/V row read is used by each of the
// tile's rows and heads. A decode is a tile of one row.
struct Tile {
  int64_t req;    // its row of the block table
  int64_t row0;   // first query row (of the flattened batch)
  int64_t rows;   // query rows
  int64_t pos0;   // position of the first row in its sequence
  int64_t first;  // first position any row of the tile sees
  int64_t count;  // positions from first to the last row's own
};

// Rows per prefill tile: enough query heads per kv head (rows x group) to reuse each
// widened K/V row many times, few enough that the tile's scores stay in L2.
inline int64_t tile_rows(int64_t group) { return std::max<int64_t>(1, 16 / group); }

template <typename scalar_t, typename cache_t>
void attention_kernel(const scalar_t* __restrict__ query, const cache_t* __restrict__ key_cache,
                      const cache_t* __restrict__ value_cache, const int32_t* __restrict__ block_table,
                      const int32_t* __restrict__ q_start, const int32_t* __restrict__ q_end,
                      const int32_t* __restrict__ seq_lens,
                      scalar_t* __restrict__ out, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                      float scale, int64_t sliding_window, float soft_cap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_dim = head_dim + (kQ8<cache_t> ? kQ8ScaleBytes : 0);  // cache_t per row
  // The scale goes on the query, or with vdpbf16ps on the scores (the query stays bf16).
  const bool dot = dot_bf16<cache_t>(head_dim);
  const float q_scale = dot ? 1.f : scale, score_scale = dot ? scale : 1.f;
  const int64_t row_stride = num_kv_heads * row_dim;     // next position, same kv head
  const int64_t block_stride = block_size * row_stride;  // next block
  // The tiles, with the positions each sees: [first, first + count).
  std::vector<Tile> tiles;
  int64_t longest = 1, max_rows = 1, total = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q0 = q_start[r], q_len = q_end[r] - q0;
    const int64_t start_pos = seq_lens[r] - q_len;  // position of the request's first row
    const int64_t step = q_len == 1 ? 1 : tile_rows(group);
    for (int64_t i = 0; i < q_len; i += step) {
      const int64_t rows = std::min(step, q_len - i), pos0 = start_pos + i;
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos0 - sliding_window + 1) : 0;
      tiles.push_back({r, q0 + i, rows, pos0, first, pos0 + rows - first});
      longest = std::max(longest, tiles.back().count);
      total += tiles.back().count;
      max_rows = std::max(max_rows, rows);
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t pairs = num_tiles * num_kv_heads;
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  // Parts: enough of them for every thread (few tiles: long contexts split), and none longer
  // than 1 / wanted of all the positions, so that one long context among many short ones
  // does not hold one thread after the others are done (the threads take contiguous ranges
  // of items). (Parts were also capped at 256 KB of V so that the V rows the scores pass
  // asked for stayed in L2 until the weighted sums; with a chunk's weighted sums right after
  // its scores that cap cost 1.1x at 1B shapes, 200 x 300.)
  int64_t part_len = longest;
  if (num_tiles < wanted) {
    const int64_t parts = (wanted + num_tiles - 1) / num_tiles;
    part_len = std::max(kMinPart, ((longest + parts - 1) / parts + 15) / 16 * 16);
  }
  part_len = std::min(part_len, std::max(kMinPart, (total / wanted + 15) / 16 * 16));
  // Parts of tile i: part_start[i] .. part_start[i + 1] - 1 (global part ids).
  std::vector<int64_t> part_start(num_tiles + 1, 0), part_tile;
  for (int64_t i = 0; i < num_tiles; ++i) {
    const int64_t n = std::max<int64_t>(1, (tiles[i].count + part_len - 1) / part_len);
    part_start[i + 1] = part_start[i] + n;
    part_tile.insert(part_tile.end(), n, i);
  }
  const int64_t total_parts = part_start[num_tiles];
  const bool split = total_parts > num_tiles;
  // kv heads per work item: all of them where the parts alone give every thread enough
  // items, so that an item reads each position's rows of all kv heads, adjacent in the
  // cache, as one stretch (one kv head's rows alone are a strided walk, and Ahead then asks
  // for whole positions); fewer (a divisor) where more items are needed.
  int64_t item_heads = num_kv_heads;
  while (item_heads > 1 && total_parts * (num_kv_heads / item_heads) < wanted) {
    do --item_heads;
    while (num_kv_heads % item_heads != 0);
  }
  const int64_t head_groups = num_kv_heads / item_heads;
  const int64_t width = max_rows * group;  // head rows of the widest tile, per kv head
  // Split tiles' partial results: [part, kv head, width] maxes and sums, and
  // [part, kv head, width, head_dim] unnormalised sums.
  std::vector<float> part_m, part_l, part_acc;
  if (split) {
    part_m.resize(total_parts * num_kv_heads * width);
    part_l.resize(part_m.size());
    part_acc.resize(part_m.size() * head_dim);
  }
  // Head row h of tile `tile`, kv head kvh: query row row0 + h / group, head kvh * group + h % group.
  auto head_offset = [&](const Tile& tile, int64_t kvh, int64_t h) {
    return ((tile.row0 + h / group) * num_heads + kvh * group + h % group) * head_dim;
  };
  auto write_out = [&](const Tile& tile, int64_t kvh, int64_t h, const float* acc, float inv_l) {
    scalar_t* dst = out + head_offset(tile, kvh, h);
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv_l);
  };
  // Work items in zigzag order (0, N-1, 1, N-2, ...): a thread's contiguous range then mixes
  // early and late items, whose lengths differ most (causal rows, sorted contexts).
  const int64_t num_items = total_parts * head_groups;
  auto item = [num_items](int64_t i) { return i % 2 == 0 ? i / 2 : num_items - 1 - i / 2; };
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_max = item_heads * width;
    std::vector<float> q(rows_max * head_dim), acc(rows_max * head_dim), m(rows_max), l(rows_max);
    std::vector<float> scores;
    std::vector<float> partial(rows_max * 16 * 16);  // per-chunk partial dot products
    std::vector<int64_t> lo(max_rows), hi(max_rows);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t work = item(i);
      const int64_t part = work / head_groups, kvh0 = work % head_groups * item_heads;
      const Tile& tile = tiles[part_tile[part]];
      const int64_t index = part - part_start[part_tile[part]];
      const int64_t start = index * part_len, n = tile.rows * group;
      const Span span{block_table + tile.req * max_blocks, tile.first + start,
                      std::min(part_len, tile.count - start), block_size, row_stride, block_stride,
                      item_heads, row_dim,
                      item_heads * row_dim * static_cast<int64_t>(sizeof(cache_t))};
      RowLimits limits{nullptr, nullptr, tile.rows};
      if (tile.rows > 1) {
        // Row r (position pos0 + r) sees [max(pos - window + 1, 0), pos], as span indices.
        for (int64_t r = 0; r < tile.rows; ++r) {
          const int64_t pos = tile.pos0 + r;
          const int64_t from = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
          lo[r] = std::clamp<int64_t>(from - span.first, 0, span.count);
          hi[r] = std::clamp<int64_t>(pos + 1 - span.first, 0, span.count);
        }
        limits = {lo.data(), hi.data(), tile.rows};
      }
      const cache_t* kc = key_cache + kvh0 * row_dim;
      const cache_t* vc = value_cache + kvh0 * row_dim;
      for (int64_t kh = 0; kh < item_heads; ++kh) {
        for (int64_t h = 0; h < n; ++h) {
          const scalar_t* src = query + head_offset(tile, kvh0 + kh, h);
          float* dst = q.data() + (kh * n + h) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * q_scale;
        }
      }
      const int64_t score_floats = item_heads * n * std::min(kChunk, span.count);
      if (static_cast<int64_t>(scores.size()) < score_floats) scores.resize(score_floats);
      attend_any(q.data(), n, head_dim, kc, vc, span, soft_cap, limits, score_scale, partial.data(),
                 scores.data(), acc.data(), m.data(), l.data());
      const int64_t t = part_tile[part];
      for (int64_t kh = 0; kh < item_heads; ++kh) {
        const int64_t kvh = kvh0 + kh;
        const float* acc_h = acc.data() + kh * n * head_dim;
        if (part_start[t + 1] - part_start[t] == 1) {
          for (int64_t h = 0; h < n; ++h)
            write_out(tile, kvh, h, acc_h + h * head_dim, 1.f / l[kh * n + h]);
        } else {
          const int64_t at = (part * num_kv_heads + kvh) * width;
          std::copy(m.begin() + kh * n, m.begin() + (kh + 1) * n, part_m.begin() + at);
          std::copy(l.begin() + kh * n, l.begin() + (kh + 1) * n, part_l.begin() + at);
          std::copy(acc_h, acc_h + n * head_dim, part_acc.begin() + at * head_dim);
        }
      }
    }
  });
  if (!split) return;
  // Combine the parts: with M the largest part max, weights e^(m_p - M) scale each part's
  // sum and its share of the normaliser (a part a row does not see has m = -inf, weight 0).
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t = pair / num_kv_heads, kvh = pair % num_kv_heads;
      const int64_t p0 = part_start[t], p1 = part_start[t + 1];
      if (p1 - p0 == 1) continue;
      const Tile& tile = tiles[t];
      for (int64_t h = 0; h < tile.rows * group; ++h) {
        float top = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t p = p0; p < p1; ++p) top = std::max(top, part_m[(p * num_kv_heads + kvh) * width + h]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t at = (p * num_kv_heads + kvh) * width + h;
          if (part_l[at] == 0.f) continue;  // a part this row does not see
          const float w = std::exp(part_m[at] - top);
          total += part_l[at] * w;
          const float* src = part_acc.data() + at * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * src[d];
        }
        write_out(tile, kvh, h, acc.data(), 1.f / total);
      }
    }
  });
}

// Quantises one row of head_dim values to int8 codes and its scale (see attention/kv_quant.py,
// whose arithmetic this repeats exactly: scale = amax / 127, code = round(x * (127 / amax)),
// halves to even; an all-zero row: codes 0, scale 0).
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t head_dim, int8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < head_dim; ++d)
    dst[d] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[d]) * inv));
  const float row_scale = amax / 127.f;
  std::memcpy(dst + head_dim, &row_scale, sizeof row_scale);
}

}  // namespace

// Attention of query rows over their request's paged context, written into `out` [rows,
// heads, head_dim] (the query's shape and dtype): request r's rows are [q_start[r], q_end[r])
// and attend causally to its first seq_lens[r] positions (its rows are the last of them).
// key_cache / value_cache [num_blocks, block_size, num_kv_heads, row]: in the query's dtype
// (row = head_dim), or int8 rows (row = head_dim + 4: codes, then the float32 scale).
// sliding_window: 0 = the whole context; soft_cap: 0 = no cap (see the top of the file).
// Rows of `out` no request owns are left as they are.
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                     torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor q_start,
                     torch::Tensor q_end, torch::Tensor seq_lens, double scale,
                     int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  out.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must have the query's shape and dtype");
  for (const auto& t : {block_table, q_start, q_end, seq_lens})
    TORCH_CHECK(t.scalar_type() == at::kInt, "block_table, q_start, q_end and seq_lens must be int32");
  const bool q8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                  (q8 || query.scalar_type() == key_cache.scalar_type()),
              "the cache must be int8 or in the query's dtype");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  TORCH_CHECK(soft_cap >= 0, "soft_cap must be >= 0 (0: no cap)");
  auto table = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = q_start.contiguous(), ends = q_end.contiguous();
  const int64_t num_reqs = lens.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(starts.numel() == num_reqs && ends.numel() == num_reqs && table.size(0) == num_reqs,
              "q_start, q_end, seq_lens and block_table must have one entry per request");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(key_cache.size(3) == head_dim + (q8 ? kQ8ScaleBytes : 0),
              "head_dim of query and cache differ");
  const int32_t *qs = starts.data_ptr<int32_t>(), *qe = ends.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  const int64_t capacity = table.size(1) * block_size;
  for (int64_t r = 0; r < num_reqs; ++r)
    TORCH_CHECK(0 <= qs[r] && qs[r] < qe[r] && qe[r] <= query.size(0) && sl[r] >= qe[r] - qs[r] &&
                    sl[r] <= capacity,
                "request ", r, ": bad query rows or context length");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto* cache_type) {
      using cache_t = std::remove_pointer_t<decltype(cache_type)>;
      attention_kernel<scalar_t, cache_t>(
          query.data_ptr<scalar_t>(), static_cast<const cache_t*>(key_cache.data_ptr()),
          static_cast<const cache_t*>(value_cache.data_ptr()), table.data_ptr<int32_t>(), qs, qe, sl,
          out.data_ptr<scalar_t>(), num_reqs, num_heads, num_kv_heads, head_dim, block_size,
          table.size(1), static_cast<float>(scale), sliding_window, static_cast<float>(soft_cap));
    };
    if (q8) run(static_cast<int8_t*>(nullptr));
    else run(static_cast<scalar_t*>(nullptr));
  });
}

// paged_attention with one query row per request, request r's at row r.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale, int64_t sliding_window,
                                     double soft_cap) {
  TORCH_CHECK(query.dim() == 3 && query.size(0) == seq_lens.numel(), "one query row per request");
  auto starts = torch::arange(query.size(0), torch::dtype(torch::kInt));
  auto out = torch::empty_like(query);
  paged_attention(out, query, key_cache, value_cache, block_table, starts, starts + 1, seq_lens,
                  scale, sliding_window, soft_cap);
  return out;
}

// Writes the rows' new key/value [n, kv_heads, head_dim] (row-strided views of the fused
// qkv projection may come in) into their slots of kv_cache [2, blocks, block_size, kv_heads,
// row]: copied for a float cache in their dtype, quantised for an int8 one.
void write_kv(torch::Tensor kv_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, row] tensor");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(),
              "key and value must be [n, kv_heads, head_dim]");
  const bool q8 = kv_cache.scalar_type() == at::kChar;
  const int64_t n = key.size(0), heads = key.size(1), head_dim = key.size(2);
  const int64_t row_dim = head_dim + (q8 ? kQ8ScaleBytes : 0);
  TORCH_CHECK(heads == kv_cache.size(3) && row_dim == kv_cache.size(4),
              "key heads or head_dim differ from the cache's");
  for (const auto& t : {key, value})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "key/value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && (q8 || key.scalar_type() == kv_cache.scalar_type()),
              "key/value and cache dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == n,
              "slot_mapping must be int64 [n]");
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t i = 0; i < n; ++i)  // every slot checked before any row is written
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " outside the cache");
  const int64_t slot_bytes = heads * row_dim * kv_cache.element_size();
  auto* kc = static_cast<uint8_t*>(kv_cache.data_ptr());
  auto* vc = kc + num_slots * slot_bytes;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv", [&] {
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    auto write = [&](int64_t i) {
      uint8_t* kdst = kc + sp[i] * slot_bytes;
      uint8_t* vdst = vc + sp[i] * slot_bytes;
      const scalar_t* ksrc = kp + i * key.stride(0);
      const scalar_t* vsrc = vp + i * value.stride(0);
      if (!q8) {
        std::memcpy(kdst, ksrc, slot_bytes);
        std::memcpy(vdst, vsrc, slot_bytes);
        return;
      }
      for (int64_t h = 0; h < heads; ++h) {
        quantize_row(ksrc + h * head_dim, head_dim, reinterpret_cast<int8_t*>(kdst) + h * row_dim);
        quantize_row(vsrc + h * head_dim, head_dim, reinterpret_cast<int8_t*>(vdst) + h * row_dim);
      }
    };
    if (q8 && n >= 64) {
      at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) write(i);
      });
    } else {
      for (int64_t i = 0; i < n; ++i) write(i);
    }
  });
}

// One decode step of a layer in one call (the steady decode batch, every row a decode):
// write_kv, then paged_decode_attention. Saves the per-layer Python and dispatch of
// index_copy_ and the cache views (~25 us per layer at batch 1).
torch::Tensor paged_decode_step(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor key,
                                torch::Tensor value, torch::Tensor slot_mapping,
                                torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                int64_t sliding_window, double soft_cap) {
  write_kv(kv_cache, key, value, slot_mapping);
  return paged_decode_attention(query.contiguous(), kv_cache[0], kv_cache[1], block_table, seq_lens,
                                scale, sliding_window, soft_cap);
}
