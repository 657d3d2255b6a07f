// Paged prefill attention for CPU in bfloat16, on AMX tiles or, without them, on AVX-512-BF16
// (vdpbf16ps: Cooper Lake, Zen 4/5): the query rows of prefills and of prefill chunks over a
// cached prefix attend, causally, to their request's context read
// in place from the paged cache through the block table (no gathered copy, no mask tensor).
//
// Layout as in paged_attention_cpu.cpp: key_cache / value_cache [num_blocks, block_size,
// num_kv_heads, head_dim]; query and out [num_tokens, num_heads, head_dim] (the whole
// step's batch, any stride between tokens; only the rows of the listed requests are read
// and written). Request i owns rows [q_start[i], q_end[i]) and attends to its first
// seq_lens[i] cached positions; its row t sits at position seq_lens[i] - (q_end[i] -
// q_start[i]) + t. This step's K/V must already be in the cache (the backend writes them
// first).
//
// Method (flash attention, one pass): for one kv head, the query heads of its GQA group are
// folded into rows (row = token * group + member), so one K/V read serves the whole group,
// and cut into tiles of 16 rows. Keys go 32 at a time: they are copied out of their blocks
// and laid out as AMX wants its second operand (K transposed by pairs of dims, V by pairs
// of keys), once for all the tiles of a work item; per tile, S = Q K^T on the tiles
// (float32), then an online softmax in AVX-512 (masking keys past each row's position),
// P rounded to bfloat16, and O += P V on the tiles, O kept in float32 and rescaled only
// when a row's running maximum moves. Work items are (request, kv head, up to 8 row tiles),
// the longest first, handed out dynamically (causal items differ in length).
// Without AMX the two products run on vdpbf16ps over the same staged layouts (one K^T or V
// row against a broadcast pair of Q dims or of P; see scores_avx512): the same products
// summed in a different order. Measured on Zen 5 (docs/benchmarks.md "Paged prefill
// without AMX"): a fresh 512-token SmolLM2 layer 1.53 -> 0.58 ms against the paged
// kernel (paged_attention_cpu.cpp), ~520 GFLOP/s (the bf16 GEMM ceiling there: ~930).
// The rounding of P to bfloat16 is the same one torch's fused CPU kernel makes for
// bfloat16 inputs. Reference: attention/torch_ref.py (tests/unit/attention).
#include <torch/types.h>  // not torch/extension.h: pybind11 and the autograd API cost ~40 s of compile per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDINFER_BF16_PREFILL 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PAGEDINFER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

#if defined(PAGEDINFER_BF16_PREFILL)

constexpr int kRows = 16;        // query rows per tile
constexpr int kKeys = 32;        // keys per step (two 16-column score tiles)
constexpr int kMaxTiles = 8;     // row tiles per work item

#if defined(PAGEDINFER_AMX)
// Linux hands out the AMX register state only on request (once per process).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile is 16 rows of 64 bytes: 16x32 bf16 operands, 16x16 float32 accumulators.
void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif  // PAGEDINFER_AMX

struct Args {
  const c10::BFloat16* query;
  c10::BFloat16* out;
  const c10::BFloat16* key_cache;
  const c10::BFloat16* value_cache;
  const int32_t* block_table;
  const int32_t* q_start;
  const int32_t* q_end;
  const int32_t* seq_lens;
  int64_t table_stride, block_size, block_stride, row_stride, q_token_stride, out_token_stride;
  int64_t group;
  float scale;
};

struct Item {
  int64_t req, head, tile_begin, tile_end, cost;
};

template <int D>
struct Buffers {
  static constexpr int kHalves = D / 32;  // 32-dim slices of Q / K (first product)
  static constexpr int kSlices = D / 16;  // 16-dim slices of V / O (second product)
  alignas(64) c10::BFloat16 q[kMaxTiles * kRows * D];
  alignas(64) float o[kMaxTiles * kRows * D];
  alignas(64) float m[kMaxTiles * kRows];
  alignas(64) float l[kMaxTiles * kRows];
  alignas(64) int32_t pos[kMaxTiles * kRows];
  alignas(64) c10::BFloat16 k_stage[kKeys * D];
  alignas(64) c10::BFloat16 v_stage[kKeys * D];
  alignas(64) uint32_t kt[2 * kHalves * 16 * 16];  // [key group][half][dim pair][key]
  alignas(64) uint32_t vt[kSlices * 16 * 16];      // [slice][key pair][dim] (bf16 pairs)
  alignas(64) float s[kRows * kKeys];
  alignas(64) c10::BFloat16 p[kRows * kKeys];
};

// 2^x for x <= 0 (16 lanes; -inf and anything below -126 give 0 or a denormal-free tiny
// value, which the callers mask where it matters): 2^x = 2^n * 2^f, n = round(x),
// |f| <= 1/2, 2^f from a degree-5 polynomial (relative error ~2e-7, far below bfloat16's).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

enum class Reduce { kMax, kAdd };

inline __m512 combine(__m512 a, __m512 b, Reduce op) {
  return op == Reduce::kMax ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
}

// Lane j of the result = the max (or sum) of the 16 lanes of v[j]: a transpose-and-combine
// network (15 combines and 30 shuffles instead of 16 horizontal reductions). The network
// leaves the rows in a fixed shuffled order, undone by one permute (kRowOrder, computed once
// by running the network on v[j] = j).
inline __attribute__((always_inline)) __m512 reduce_rows_unordered(const __m512* v, Reduce op) {
  __m512 w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i) {
    w[i] = combine(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                   _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]), op);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(w[2 * i]), y = _mm512_castps_pd(w[2 * i + 1]);
    u[i] = combine(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                   _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)), op);
  }
  for (int i = 0; i < 2; ++i) {
    z[i] = combine(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                   _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD), op);
  }
  return combine(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD),
                 op);
}

const __m512i kRowOrder = [] {
  // With v[j] = j in every lane, a max leaves lane k holding the row that lands there.
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = _mm512_set1_ps(static_cast<float>(j));
  alignas(64) float landed[16];
  _mm512_store_ps(landed, reduce_rows_unordered(v, Reduce::kMax));
  alignas(64) int32_t index[16];
  for (int k = 0; k < 16; ++k) index[static_cast<int>(landed[k])] = k;
  return _mm512_load_si512(index);
}();

inline __m512 reduce_rows(const __m512* v, Reduce op) {
  return _mm512_permutexvar_ps(kRowOrder, reduce_rows_unordered(v, op));
}

// Copies keys [s0, s0 + nk) of `head` out of their blocks (zeros after nk) and lays them out
// for the tiles: kt by pairs of dims (B operand of Q K^T), vt by pairs of keys (of P V).
// The rows of the next step are prefetched (they come from scattered blocks, which the
// hardware prefetcher does not follow).
template <int D>
void stage_keys(const Args& a, const int32_t* table, int64_t head, int64_t s0, int64_t nk,
                int64_t kv_end, Buffers<D>& b) {
  constexpr int kHalves = Buffers<D>::kHalves;
  constexpr int kSlices = Buffers<D>::kSlices;
  for (int64_t p = s0 + kKeys; p < std::min(s0 + 2 * kKeys, kv_end); ++p) {
    const int64_t off = static_cast<int64_t>(table[p / a.block_size]) * a.block_stride +
                        (p % a.block_size) * a.row_stride + head * D;
    for (int64_t byte = 0; byte < D * 2; byte += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(a.key_cache + off) + byte, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.value_cache + off) + byte, _MM_HINT_T0);
    }
  }
  for (int64_t n = 0; n < kKeys; ++n) {
    c10::BFloat16* kd = b.k_stage + n * D;
    c10::BFloat16* vd = b.v_stage + n * D;
    if (n < nk) {
      const int64_t p = s0 + n;
      const int64_t off = static_cast<int64_t>(table[p / a.block_size]) * a.block_stride +
                          (p % a.block_size) * a.row_stride + head * D;
      std::memcpy(kd, a.key_cache + off, D * sizeof(c10::BFloat16));
      std::memcpy(vd, a.value_cache + off, D * sizeof(c10::BFloat16));
    } else {
      std::memset(kd, 0, D * sizeof(c10::BFloat16));
      std::memset(vd, 0, D * sizeof(c10::BFloat16));
    }
  }
  // kt[g][h][r][n] = dims (2(16h + r), +1) of key 16g + n, as one 32-bit pair.
  const __m512i key_rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(D / 2));
  const int groups = nk > 16 ? 2 : 1;
  for (int g = 0; g < groups; ++g) {
    const int* base = reinterpret_cast<const int*>(b.k_stage + g * 16 * D);
    for (int h = 0; h < kHalves; ++h) {
      for (int r = 0; r < 16; ++r) {
        const __m512i col = _mm512_i32gather_epi32(key_rows, base + h * 16 + r, 4);
        _mm512_store_si512(b.kt + ((g * kHalves + h) * 16 + r) * 16, col);
      }
    }
  }
  // vt[s][r] = dims 16s..16s+15 of keys 2r and 2r+1, interleaved.
  alignas(64) static constexpr int16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
      12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const int pairs = static_cast<int>((nk + 1) / 2);
  for (int s = 0; s < kSlices; ++s) {
    for (int r = 0; r < 16; ++r) {
      uint32_t* dst = b.vt + (s * 16 + r) * 16;
      if (r >= pairs) {
        _mm512_store_si512(dst, _mm512_setzero_si512());
        continue;
      }
      const __m256i even =
          _mm256_load_si256(reinterpret_cast<const __m256i*>(b.v_stage + 2 * r * D + 16 * s));
      const __m256i odd = _mm256_load_si256(
          reinterpret_cast<const __m256i*>(b.v_stage + (2 * r + 1) * D + 16 * s));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
      _mm512_store_si512(dst, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

#if defined(PAGEDINFER_AMX)
// S = Q K^T for one tile on AMX: two 16x16 float32 tiles (keys 0-15 and 16-31) stored to
// b.s. Tile registers: S in 0-1, Q halves in 2 and 6, K^T in 3, 4, 5, 7 -- distinct
// registers, so that the products overlap instead of each waiting for the previous one's
// operand register.
template <int D>
void scores_amx(const c10::BFloat16* q, int64_t nk, Buffers<D>& b) {
  constexpr int kHalves = Buffers<D>::kHalves;
  _tile_zero(0);
  _tile_zero(1);
  for (int h = 0; h < kHalves; h += 2) {
    _tile_loadd(2, q + h * 32, D * sizeof(c10::BFloat16));
    _tile_loadd(6, q + (h + 1) * 32, D * sizeof(c10::BFloat16));
    _tile_loadd(3, b.kt + (0 * kHalves + h) * 256, 64);
    _tile_loadd(5, b.kt + (0 * kHalves + h + 1) * 256, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (nk > 16) {
      _tile_loadd(4, b.kt + (1 * kHalves + h) * 256, 64);
      _tile_loadd(7, b.kt + (1 * kHalves + h + 1) * 256, 64);
      _tile_dpbf16ps(1, 2, 4);
      _tile_dpbf16ps(1, 6, 7);
    }
    _tile_dpbf16ps(0, 6, 5);
  }
  _tile_stored(0, b.s, kKeys * sizeof(float));
  _tile_stored(1, b.s + 16, kKeys * sizeof(float));
}

// O += P V for one tile on AMX: one 16x16 float32 tile per 16 dims, four at a time (O in
// 0, 1, 4, 5; V in 2, 3, 7; P in 6).
template <int D>
void weighted_sum_amx(float* o, Buffers<D>& b) {
  constexpr int kSlices = Buffers<D>::kSlices;
  _tile_loadd(6, b.p, kKeys * sizeof(c10::BFloat16));
  constexpr int64_t kOStride = D * sizeof(float);
  for (int s = 0; s < kSlices; s += 4) {
    float* os = o + s * 16;
    const uint32_t* vs = b.vt + s * 256;
    _tile_loadd(0, os, kOStride);
    _tile_loadd(1, os + 16, kOStride);
    _tile_loadd(4, os + 32, kOStride);
    _tile_loadd(5, os + 48, kOStride);
    _tile_loadd(2, vs, 64);
    _tile_loadd(3, vs + 256, 64);
    _tile_loadd(7, vs + 512, 64);
    _tile_dpbf16ps(0, 6, 2);
    _tile_dpbf16ps(1, 6, 3);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(2, vs + 768, 64);
    _tile_dpbf16ps(5, 6, 2);
    _tile_stored(0, os, kOStride);
    _tile_stored(1, os + 16, kOStride);
    _tile_stored(4, os + 32, kOStride);
    _tile_stored(5, os + 48, kOStride);
  }
}
#endif  // PAGEDINFER_AMX

// The same two products without tiles, on AVX-512-BF16 (Ice Lake's successors without AMX,
// Zen 4/5): vdpbf16ps multiplies 16 lanes of bf16 pairs and adds both products to float32
// lanes, so the staged layouts serve as they are: a K^T row of kt (one dim pair, 16 keys)
// against a query row's dim pair broadcast, and a vt row (one key pair, 16 dims) against a
// row's pair of P. Rows go RB at a time with their accumulators in registers.
template <int D, int RB, bool kTwo>
inline void scores_rows_avx512(const c10::BFloat16* q, const uint32_t* kt, float* s) {
  constexpr int kPairs = D / 2;
  const int32_t* qp = reinterpret_cast<const int32_t*>(q);
  __m512 acc0[RB], acc1[RB];
  for (int j = 0; j < RB; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
  for (int dp = 0; dp < kPairs; ++dp) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + dp * 16);
    __m512bh k1;
    if constexpr (kTwo) k1 = (__m512bh)_mm512_load_si512(kt + (kPairs + dp) * 16);
    for (int j = 0; j < RB; ++j) {
      const __m512bh qj = (__m512bh)_mm512_set1_epi32(qp[j * kPairs + dp]);
      acc0[j] = _mm512_dpbf16_ps(acc0[j], qj, k0);
      if constexpr (kTwo) acc1[j] = _mm512_dpbf16_ps(acc1[j], qj, k1);
    }
  }
  for (int j = 0; j < RB; ++j) {
    _mm512_store_ps(s + j * kKeys, acc0[j]);
    _mm512_store_ps(s + j * kKeys + 16, kTwo ? acc1[j] : _mm512_setzero_ps());
  }
}

template <int D>
void scores_avx512(const c10::BFloat16* q, int64_t nk, Buffers<D>& b) {
  constexpr int kRB = 8;  // 8 rows x 2 key groups: 16 accumulators
  for (int j = 0; j < kRows; j += kRB) {
    if (nk > 16) {
      scores_rows_avx512<D, kRB, true>(q + j * D, b.kt, b.s + j * kKeys);
    } else {
      scores_rows_avx512<D, kRB, false>(q + j * D, b.kt, b.s + j * kKeys);
    }
  }
}

template <int D, int RB>
inline void weighted_sum_rows_avx512(const c10::BFloat16* p, const uint32_t* vt, int pairs,
                                     float* o) {
  constexpr int kSlices = D / 16;
  const int32_t* pp = reinterpret_cast<const int32_t*>(p);
  __m512 acc[RB][kSlices];
  for (int j = 0; j < RB; ++j)
    for (int s = 0; s < kSlices; ++s) acc[j][s] = _mm512_load_ps(o + j * D + s * 16);
  for (int r = 0; r < pairs; ++r) {
    __m512bh v[kSlices];
    for (int s = 0; s < kSlices; ++s) v[s] = (__m512bh)_mm512_load_si512(vt + (s * 16 + r) * 16);
    for (int j = 0; j < RB; ++j) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(pp[j * (kKeys / 2) + r]);
      for (int s = 0; s < kSlices; ++s) acc[j][s] = _mm512_dpbf16_ps(acc[j][s], pj, v[s]);
    }
  }
  for (int j = 0; j < RB; ++j)
    for (int s = 0; s < kSlices; ++s) _mm512_store_ps(o + j * D + s * 16, acc[j][s]);
}

template <int D>
void weighted_sum_avx512(float* o, int64_t nk, Buffers<D>& b) {
  constexpr int kRB = D == 64 ? 4 : 2;  // 4 rows x 4 slices (head_dim 64), 2 x 8 (128)
  const int pairs = static_cast<int>((nk + 1) / 2);
  for (int j = 0; j < kRows; j += kRB)
    weighted_sum_rows_avx512<D, kRB>(b.p + j * kKeys, b.vt, pairs, o + j * D);
}

// One step (the staged keys [s0, s0 + nk)) for one tile of 16 rows.
template <int D, bool kAmx>
void attend_tile(int64_t tile, int64_t s0, int64_t nk, float scale2, Buffers<D>& b) {
  const c10::BFloat16* q = b.q + tile * kRows * D;
#if defined(PAGEDINFER_AMX)
  if constexpr (kAmx) scores_amx<D>(q, nk, b);
  else
#endif
    scores_avx512<D>(q, nk, b);

  // Online softmax over the 16 rows at once. Scores are kept in base 2 (scale * log2 e is
  // folded into the scaling), so p = 2^(s - m) and no natural exponential is needed.
  float* o = b.o + tile * kRows * D;
  float* m = b.m + tile * kRows;
  float* l = b.l + tile * kRows;
  const int32_t* pos = b.pos + tile * kRows;
  const __m512 vscale = _mm512_set1_ps(scale2);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 lo[kRows], hi[kRows], row_max[kRows];
  __mmask16 lo_mask[kRows], hi_mask[kRows];
  if (nk == kKeys && s0 + kKeys <= pos[0] + 1) {
    // Every row sees every key of the step (the common case): no masks.
    for (int j = 0; j < kRows; ++j) {
      lo_mask[j] = hi_mask[j] = 0xFFFF;
      lo[j] = _mm512_mul_ps(_mm512_load_ps(b.s + j * kKeys), vscale);
      hi[j] = _mm512_mul_ps(_mm512_load_ps(b.s + j * kKeys + 16), vscale);
      row_max[j] = _mm512_max_ps(lo[j], hi[j]);
    }
  } else {
    for (int j = 0; j < kRows; ++j) {
      // Keys past the row's position (or past the staged ones) are masked to -inf.
      const int64_t lim = std::clamp<int64_t>(static_cast<int64_t>(pos[j]) - s0 + 1, 0, nk);
      lo_mask[j] = static_cast<__mmask16>(lim >= 16 ? 0xFFFF : (1u << lim) - 1);
      hi_mask[j] =
          static_cast<__mmask16>(lim >= 32 ? 0xFFFF : lim <= 16 ? 0 : (1u << (lim - 16)) - 1);
      lo[j] = _mm512_mask_mul_ps(neg_inf, lo_mask[j], _mm512_load_ps(b.s + j * kKeys), vscale);
      hi[j] =
          _mm512_mask_mul_ps(neg_inf, hi_mask[j], _mm512_load_ps(b.s + j * kKeys + 16), vscale);
      row_max[j] = _mm512_max_ps(lo[j], hi[j]);
    }
  }
  const __m512 m_old = _mm512_load_ps(m);
  // A row with no key in this step keeps m_old (max with -inf); every row has seen key 0 in
  // the first step, so m_new is finite from then on.
  const __m512 m_new = _mm512_max_ps(m_old, reduce_rows(row_max, Reduce::kMax));
  const __mmask16 moved = _mm512_cmp_ps_mask(m_new, m_old, _CMP_GT_OQ);
  _mm512_store_ps(m, m_new);
  __m512 row_sum[kRows];
  for (int j = 0; j < kRows; ++j) {
    const __m512 mj = _mm512_set1_ps(m[j]);
    const __m512 p_lo = _mm512_maskz_mov_ps(lo_mask[j], exp2_nonpositive(_mm512_sub_ps(lo[j], mj)));
    const __m512 p_hi = _mm512_maskz_mov_ps(hi_mask[j], exp2_nonpositive(_mm512_sub_ps(hi[j], mj)));
    row_sum[j] = _mm512_add_ps(p_lo, p_hi);
    _mm512_store_si512(b.p + j * kKeys, (__m512i)_mm512_cvtne2ps_pbh(p_hi, p_lo));
  }
  const __m512 sums = reduce_rows(row_sum, Reduce::kAdd);
  if (moved) {
    // corr = 2^(m_old - m_new): 0 on the first step (m_old = -inf), 1 where m did not move.
    const __m512 corr = exp2_nonpositive(_mm512_sub_ps(m_old, m_new));
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), corr, sums));
    alignas(64) float c[kRows];
    _mm512_store_ps(c, corr);
    for (int j = 0; j < kRows; ++j) {
      if (!((moved >> j) & 1)) continue;
      const __m512 vc = _mm512_set1_ps(c[j]);
      for (int d = 0; d < D; d += 16) {
        _mm512_store_ps(o + j * D + d, _mm512_mul_ps(_mm512_load_ps(o + j * D + d), vc));
      }
    }
  } else {
    _mm512_store_ps(l, _mm512_add_ps(_mm512_load_ps(l), sums));
  }

#if defined(PAGEDINFER_AMX)
  if constexpr (kAmx) weighted_sum_amx<D>(o, b);
  else
#endif
    weighted_sum_avx512<D>(o, nk, b);
}

template <int D, bool kAmx>
void run_item(const Args& a, const Item& it, Buffers<D>& b) {
  const int64_t r = it.req;
  const int64_t q0 = a.q_start[r];
  const int64_t q_len = a.q_end[r] - q0;
  const int64_t ctx0 = a.seq_lens[r] - q_len;  // position of the request's first query row
  const int64_t num_rows = q_len * a.group;
  const int64_t row0 = it.tile_begin * kRows;
  const int64_t row_end = std::min(it.tile_end * kRows, num_rows);
  const int64_t tiles = it.tile_end - it.tile_begin;
  const int32_t* table = a.block_table + r * a.table_stride;

  // Folded query rows (token t, group member g) and their positions; padding rows copy the
  // last real row's position so that they stay finite (their results are never written).
  for (int64_t i = 0; i < tiles * kRows; ++i) {
    const int64_t row = std::min(row0 + i, row_end - 1);
    const int64_t t = row / a.group, g = row % a.group;
    c10::BFloat16* dst = b.q + i * D;
    if (row0 + i < row_end) {
      std::memcpy(dst, a.query + (q0 + t) * a.q_token_stride + (it.head * a.group + g) * D,
                  D * sizeof(c10::BFloat16));
    } else {
      std::memset(dst, 0, D * sizeof(c10::BFloat16));
    }
    b.pos[i] = static_cast<int32_t>(ctx0 + t);
  }
  std::fill(b.o, b.o + tiles * kRows * D, 0.f);
  std::fill(b.m, b.m + tiles * kRows, -std::numeric_limits<float>::infinity());
  std::fill(b.l, b.l + tiles * kRows, 0.f);

  const int64_t kv_end = b.pos[(row_end - 1 - row0)] + 1;
  for (int64_t s0 = 0; s0 < kv_end; s0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, kv_end - s0);
    stage_keys<D>(a, table, it.head, s0, nk, kv_end, b);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t last = std::min<int64_t>((tile + 1) * kRows, row_end - row0) - 1;
      if (s0 > b.pos[last]) continue;  // the tile's rows have seen all their keys
      attend_tile<D, kAmx>(tile, s0, nk, a.scale * 1.44269504088896341f, b);
    }
  }

  for (int64_t row = row0; row < row_end; ++row) {
    const int64_t i = row - row0;
    const int64_t t = row / a.group, g = row % a.group;
    c10::BFloat16* dst = a.out + (q0 + t) * a.out_token_stride + (it.head * a.group + g) * D;
    const __m512 inv = _mm512_set1_ps(1.f / b.l[i]);
    for (int d = 0; d < D; d += 16) {
      pagedinfer::store16(dst + d, _mm512_mul_ps(_mm512_load_ps(b.o + i * D + d), inv));
    }
  }
}

template <int D, bool kAmx>
void run_all(const Args& a, int64_t num_reqs, int64_t num_kv_heads) {
  // Items of up to kMaxTiles row tiles; fewer per item when there is little work, so that
  // both threads get some.
  int64_t total_tiles = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    total_tiles += (static_cast<int64_t>(a.q_end[r] - a.q_start[r]) * a.group + kRows - 1) /
                   kRows * num_kv_heads;
  }
  const int64_t threads = at::get_num_threads();
  const int64_t per_item =
      std::clamp<int64_t>((total_tiles + threads * 4 - 1) / (threads * 4), 1, kMaxTiles);
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = a.q_end[r] - a.q_start[r];
    const int64_t tiles = (q_len * a.group + kRows - 1) / kRows;
    const int64_t ctx0 = a.seq_lens[r] - q_len;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t tb = 0; tb < tiles; tb += per_item) {
        const int64_t te = std::min(tiles, tb + per_item);
        const int64_t last_row = std::min(te * kRows, q_len * a.group) - 1;
        const int64_t keys = ctx0 + last_row / a.group + 1;
        items.push_back({r, h, tb, te, keys * (te - tb)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, n)))
  {
#if defined(PAGEDINFER_AMX)
    if constexpr (kAmx) configure_tiles();
#endif
    std::unique_ptr<Buffers<D>> buf(new Buffers<D>);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run_item<D, kAmx>(a, items[i], *buf);
#if defined(PAGEDINFER_AMX)
    if constexpr (kAmx) _tile_release();
#endif
  }
}

// AMX tiles where the kernel may use them, AVX-512-BF16 elsewhere.
template <int D>
void run_any(const Args& a, int64_t num_reqs, int64_t num_kv_heads) {
#if defined(PAGEDINFER_AMX)
  if (amx_permitted()) return run_all<D, true>(a, num_reqs, num_kv_heads);
#endif
  run_all<D, false>(a, num_reqs, num_kv_heads);
}

#endif  // PAGEDINFER_BF16_PREFILL

}  // namespace

bool prefill_attention_available() {
#if defined(PAGEDINFER_BF16_PREFILL)
  return true;
#else
  return false;
#endif
}

void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table,
                             torch::Tensor q_start, torch::Tensor q_end, torch::Tensor seq_lens,
                             double scale) {
  TORCH_CHECK(prefill_attention_available(),
              "paged_prefill_attention needs AVX-512-BF16 or AMX-BF16 (check "
              "prefill_attention_available())");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query and out: [num_tokens, num_heads, head_dim], same shape");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "query and out: each token's heads contiguous (any stride between tokens)");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16,
              "paged_prefill_attention is bfloat16 only");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "caches: contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && q_start.scalar_type() == at::kInt &&
                  q_end.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table, q_start, q_end and seq_lens are int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && q_start.is_contiguous() &&
                  q_end.is_contiguous() && seq_lens.is_contiguous(),
              "block_table rows and the per-request arrays must be contiguous");
  const int64_t num_reqs = q_start.size(0);
  TORCH_CHECK(q_end.size(0) == num_reqs && seq_lens.size(0) == num_reqs &&
                  block_table.size(0) == num_reqs,
              "one q_start, q_end, seq_len and block-table row per request");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim differs from the query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128");
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* qe = q_end.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK(0 <= qs[r] && qs[r] < qe[r] && qe[r] <= query.size(0),
                "request ", r, ": query rows [", qs[r], ", ", qe[r], ") out of range");
    TORCH_CHECK(qe[r] - qs[r] <= sl[r], "request ", r, ": more query rows than its seq_len");
    TORCH_CHECK(sl[r] <= max_blocks * key_cache.size(1),
                "request ", r, ": seq_len beyond its block table");
  }
  if (num_reqs == 0) return;
#if defined(PAGEDINFER_BF16_PREFILL)
  Args a{};
  a.query = query.data_ptr<c10::BFloat16>();
  a.out = out.data_ptr<c10::BFloat16>();
  a.key_cache = key_cache.data_ptr<c10::BFloat16>();
  a.value_cache = value_cache.data_ptr<c10::BFloat16>();
  a.block_table = block_table.data_ptr<int32_t>();
  a.q_start = qs;
  a.q_end = qe;
  a.seq_lens = sl;
  a.table_stride = block_table.stride(0);
  a.block_size = key_cache.size(1);
  a.block_stride = key_cache.stride(0);
  a.row_stride = key_cache.stride(1);
  a.q_token_stride = query.stride(0);
  a.out_token_stride = out.stride(0);
  a.group = num_heads / num_kv_heads;
  a.scale = static_cast<float>(scale);
  if (head_dim == 64) {
    run_any<64>(a, num_reqs, num_kv_heads);
  } else {
    run_any<128>(a, num_reqs, num_kv_heads);
  }
#endif
}
