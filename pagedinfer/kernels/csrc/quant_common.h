// What the quantised-linear kernels share (quant_linear_cpu.cpp: Q4/Q8 records,
// kquant_linear_cpu.cpp: Q5_0 and the K-quants): the activations of one call, prepared
// once, and the rounding store of a block's 16 output lanes.
#pragma once

#include <torch/types.h>  // not torch/extension.h: pybind11 and the autograd API cost ~40 s of compile per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "vec.h"

namespace pagedinfer::quant {

constexpr int64_t kGroup = 32;  // inputs per activation group (sums, int8 scales)
constexpr int64_t kLanes = 16;  // output features per packed block
constexpr int kMaxRows = 8;     // activation rows sharing one pass over the weights
                                // (a verify step of k <= 7 drafts is one pass)
constexpr int64_t kPrefetchBytes = 8192;  // software prefetch distance in the weight stream
                                          // (measured on 30 layers' weights: ~20 -> ~30 GB/s;
                                          // from DRAM 12 -> 14 GB/s)

// Asks for the `bytes` of the record kPrefetchBytes ahead of `rec` in a weight stream.
inline void prefetch_ahead(const uint8_t* rec, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(rec + kPrefetchBytes + l, 0, 3);
}

// Activations of one call: float32 copy and per-group sums; for the VNNI path also int8
// codes, their per-group scales and per-group code sums.
struct Activations {
  int64_t K = 0, G = 0;
  const float* xf = nullptr;       // [rows, K]
  const float* xsum = nullptr;     // [rows, G]
  const int8_t* xq = nullptr;      // [rows, K]
  const float* xscale = nullptr;   // [rows, G]
  const int32_t* xqsum = nullptr;  // [rows, G]
};

template <typename T>
void widen(const T* x, int64_t n, float* xf) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVec<T>) {
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(xf + i, load16(x + i));
  }
#endif
  for (; i < n; ++i) xf[i] = static_cast<float>(x[i]);
}

// The sum of a group's 32 values in _mm512_reduce_add_ps's order (gcc's: the 16-lane
// halves, then 8, 4, lanes {0,2} and {1,3}, the pair), so that every tier's group sums,
// and with them the K-quant mins' terms, are the same bits.
inline float group_sum(const float* x) {
  float v[16], t[8], u[4];
  for (int i = 0; i < 16; ++i) v[i] = x[16 + i] + x[i];
  for (int i = 0; i < 8; ++i) t[i] = v[8 + i] + v[i];
  for (int i = 0; i < 4; ++i) u[i] = t[4 + i] + t[i];
  return (u[0] + u[2]) + (u[1] + u[3]);
}

// Per group of 32: the float sum; with xq, also int8 codes (scale = max |x| / 127, round
// to nearest even) and their sum. Every path sums the group as the same fixed tree
// (group_sum); each row's results depend on that row alone, whatever the batch.
// Group g's codes go to xq + g * q_step and its sum, scale and code sum to element
// g * s_step of theirs (a row-major layout by default; the int8 GEMM's tiles interleave rows).
inline void prepare_groups(const float* xf, int64_t num_groups, float* xsum, int8_t* xq,
                           float* xscale, int32_t* xqsum, int64_t q_step = kGroup,
                           int64_t s_step = 1) {
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    const float* x = xf + gi * kGroup;
    const int64_t g = gi * s_step;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    xsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    if (xq == nullptr) continue;
    int8_t* q = xq + gi * q_step;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    // cvtps rounds as the MXCSR says: to nearest even, as std::nearbyint below.
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
    xscale[g] = amax / 127.f;
    xqsum[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
    float amax = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(x[j]));
    xsum[g] = group_sum(x);
    if (xq == nullptr) continue;
    int8_t* q = xq + gi * q_step;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t codes = 0;
    for (int64_t j = 0; j < kGroup; ++j) {
      const int32_t code = static_cast<int32_t>(std::nearbyint(x[j] * inv));
      q[j] = static_cast<int8_t>(code);  // |code| <= 127 by construction
      codes += code;
    }
    xscale[g] = amax / 127.f;
    xqsum[g] = codes;
#endif
  }
}

// x [rows, K] (float32/bfloat16/float16, contiguous) prepared into `scratch`; with
// `int8`, the int8 codes instead of the float32 copy (the integer kernels read only the
// codes, scales and sums: a 512-row step's float copy would be written and never read).
// The returned view points into `scratch`. Rows are prepared in parallel once there are
// enough of them (a 512-row prefill's preparation alone took ~28% of a 576 x 576 product
// on one thread while the other waited).
inline Activations prepare_activations(const torch::Tensor& x, bool int8, std::vector<float>& scratch) {
  const int64_t rows = x.size(0), K = x.size(1), G = K / kGroup;
  const int64_t floats = int8 ? 0 : rows * K;
  scratch.resize(static_cast<size_t>(floats + rows * G + (int8 ? 2 * rows * G + rows * K / 4 : 0)));
  float* xf = scratch.data();
  float* xsum = xf + floats;
  float* xscale = xsum + rows * G;
  int32_t* xqsum = reinterpret_cast<int32_t*>(xscale + rows * G);
  int8_t* xq = reinterpret_cast<int8_t*>(xqsum + rows * G);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));  // ~32K values
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_prepare", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      if (!int8) {
        widen(xp + begin * K, (end - begin) * K, xf + begin * K);
        prepare_groups(xf + begin * K, (end - begin) * G, xsum + begin * G, nullptr, nullptr, nullptr);
        return;
      }
      std::vector<float> row(static_cast<size_t>(K));  // one row widened at a time
      for (int64_t r = begin; r < end; ++r) {
        widen(xp + r * K, K, row.data());
        prepare_groups(row.data(), G, xsum + r * G, xq + r * K, xscale + r * G, xqsum + r * G);
      }
    });
  });
  Activations a;
  a.K = K, a.G = G, a.xsum = xsum;
  if (int8) a.xq = xq, a.xscale = xscale, a.xqsum = xqsum;
  else a.xf = xf;
  return a;
}

// out[0:width] = lanes[0:width], rounded to Out.
template <typename Out>
inline void store_lanes(Out* out, const float* lanes, int64_t width) {
#if defined(__AVX512F__)
  if constexpr (kVec<Out>) {
    if (width == kLanes) {
      store16(out, _mm512_loadu_ps(lanes));
      return;
    }
  }
#endif
  for (int64_t i = 0; i < width; ++i) out[i] = static_cast<Out>(lanes[i]);
}

inline void check_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
}

inline void check_blocks(int64_t blocks, int64_t out_features) {
  TORCH_CHECK(out_features > (blocks - 1) * kLanes && out_features <= blocks * kLanes,
              "out_features does not match the packed blocks");
}

// out [rows, out_features] in x's dtype, parallel over the packed blocks of 16 features:
// block_fn(R, r0, b, acc) fills acc[0:R][0:16] with rows r0..r0+R-1 times block b's features.
template <typename BlockFn>
torch::Tensor run_blocks(const torch::Tensor& x, int64_t blocks, int64_t out_features,
                         const BlockFn& block_fn) {
  check_blocks(blocks, out_features);
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows, out_features}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_store", [&] {
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      float acc[kMaxRows][kLanes];
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kLanes, width = std::min(kLanes, out_features - n0);
        for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
          const int R = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
          block_fn(R, r0, b, acc);
          for (int r = 0; r < R; ++r)
            store_lanes(outp + (r0 + r) * out_features + n0, acc[r], width);
        }
      }
    });
  });
  return out;
}

// --- tiles for the int8 GEMMs (AVX512-VNNI; the K-quants on AVX2 too) -------------------
//
// The activations of a many-row step are prepared straight into tiles of kTileRows rows, so
// that a GEMM microkernel reaches every operand of a tile from one pointer: record (t, g)
// holds rows 6t..6t+5's int8 codes of input group g ([6][32]), then their float scales
// [6], float sums [6] and int32 code sums times -Zero [6], and with `sums16` those of each
// half group [6][2] (Q6_K's 16-input sub-blocks). A format whose codes q stand for
// q - Zero starts its integer dot products at -Zero * (the codes' sum) and needs no
// subtraction per sub-block (one vector op of ~12-16 per 32 inputs and row). With `paired`
// each 8 inputs' codes come as the 4 even ones then the 4 odd ones (the K-quant records
// pair them so). Rows past the end are zeros (their results are never stored).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDINFER_INT8_GEMM 1
#endif
constexpr int kTileRows = 6;          // rows per tile: 2 x 6 int32 sums + 2 x 6 float totals in zmm
constexpr int kTileBlocks = 2;        // feature blocks of 16 per work item of the microkernels
constexpr int64_t kGemmMinRows = 16;  // below, the few-row kernels (docs/benchmarks.md)
// Q5_0 and the K-quants: their few-row kernel with AVX512-VNNI (kquant_linear_cpu.cpp,
// block_int8_16) streams the weights once per step with prefetch, and from DRAM (where a
// real model's weights are) it beat the GEMM up to 40-48 rows (Q4_K 1,070-1,080 against
// 860-890 GFLOP/s at 24-32 rows, Q6_K 860-870 against 730-770); in cache the GEMM wins from
// ~10 rows (Q4_K 1,215 against 850 at 12). 32: DRAM's side of that, with a margin.
constexpr int64_t kGemmMinRowsK = 32;
// The AVX2 tier's K-quant GEMM (kquant_linear_cpu.cpp, tile_half_ymm) from this many rows:
// from DRAM (a 75 MB matrix, AVX-VNNI) it beat the few-row kernel at 10-16 rows (Q4_K
// 488-574 against 409-435 GOP/s, Q6_K 361-437 against 323-338), was level at 9 and behind
// at 7-8, where a second tile of 6 is mostly padding.
constexpr int64_t kGemmMinRowsYmm = 9;

constexpr int64_t tile_record_bytes(bool sums16) { return kTileRows * (kGroup + 12 + (sums16 ? 8 : 0)); }

// The tiles and their work items serve the AVX2 tier's K-quant GEMM too (ymm, AVX-VNNI:
// kquant_linear_cpu.cpp, tile_half_ymm).
#if defined(__AVX2__) && defined(__F16C__)
#define PAGEDINFER_INT8_TILES 1
#endif

#if defined(PAGEDINFER_INT8_TILES)

template <bool Paired, bool Sums16, int Zero>
std::unique_ptr<uint8_t[]> prepare_tiles(const torch::Tensor& x) {
  constexpr int64_t kRecord = tile_record_bytes(Sums16);
  const int64_t rows = x.size(0), K = x.size(1), G = K / kGroup;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows, tile_bytes = G * kRecord;
  std::unique_ptr<uint8_t[]> out(new uint8_t[static_cast<size_t>(tiles * tile_bytes)]);
  if (rows % kTileRows != 0) std::memset(out.get() + (tiles - 1) * tile_bytes, 0, static_cast<size_t>(tile_bytes));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_tiles", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, tiles, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
      std::vector<float> row(static_cast<size_t>(K));
      for (int64_t t = begin; t < end; ++t) {
        uint8_t* tile = out.get() + t * tile_bytes;
        float* scale = reinterpret_cast<float*>(tile + kTileRows * kGroup);
        int32_t* code_sum = reinterpret_cast<int32_t*>(scale + 2 * kTileRows);
        for (int r = 0; r < kTileRows && t * kTileRows + r < rows; ++r) {
          widen(xp + (t * kTileRows + r) * K, K, row.data());
          prepare_groups(row.data(), G, scale + kTileRows + r, reinterpret_cast<int8_t*>(tile + r * kGroup),
                         scale + r, code_sum + r, kRecord, kRecord / 4);
          if constexpr (Paired || Sums16 || Zero != 0) {
            for (int64_t g = 0; g < G; ++g) {
              int8_t* q = reinterpret_cast<int8_t*>(tile + g * kRecord + r * kGroup);
              code_sum[g * (kRecord / 4) + r] *= -Zero;
              if constexpr (Sums16) {
                // Each 16 codes' sum: psadbw of the codes + 128 (unsigned) against zero, less
                // 16 x 128 (a scalar loop here was ~20% of a Q6_K product at 512 rows).
                int32_t* halves = code_sum + kTileRows + g * (kRecord / 4) + 2 * r;
                const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
                for (int h = 0; h < 2; ++h) {
                  const __m128i u = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)), flip);
                  const __m128i sad = _mm_sad_epu8(u, _mm_setzero_si128());
                  const int32_t sum = _mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128;
                  halves[h] = -Zero * sum;
                }
              }
              if constexpr (Paired) {
                // Per 8 codes: 0 2 4 6 1 3 5 7 (one byte shuffle per 16).
                const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
                for (int h = 0; h < 2; ++h) {
                  __m128i* p = reinterpret_cast<__m128i*>(q + 16 * h);
                  _mm_storeu_si128(p, _mm_shuffle_epi8(_mm_loadu_si128(p), order));
                }
              }
            }
          }
        }
      }
    });
  });
  return out;
}

// out [rows, out_features] in x's dtype from the tiles (`tile_bytes` apart) and the packed
// weights (`run_bytes` per block of 16 features). Work items are (up to kTileBlocks feature
// blocks, 8 tiles), block-major, so a thread's items share their weights and walk the tiles
// in order; tile_fn(out, nb, tile, weights, valid rows, first feature, lead) stores one
// tile's product with nb blocks (out: the tile's first row); `lead`: the item's first tile,
// the one that brings its weights in (from DRAM, where a real model's are).
template <typename TileFn>
torch::Tensor run_tiles(const torch::Tensor& x, const uint8_t* tiled, int64_t tile_bytes,
                        const uint8_t* packed, int64_t blocks, int64_t run_bytes,
                        int64_t out_features, const TileFn& tile_fn) {
  check_blocks(blocks, out_features);
  const int64_t rows = x.size(0);
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t groups = (blocks + kTileBlocks - 1) / kTileBlocks;
  constexpr int64_t kChunk = 8;  // tiles per work item (48 rows)
  const int64_t chunks = (tiles + kChunk - 1) / kChunk;
  auto out = torch::empty({rows, out_features}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_tiles_out", [&] {
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b0 = item / chunks * kTileBlocks, c = item % chunks;
        const int nb = static_cast<int>(std::min<int64_t>(kTileBlocks, blocks - b0));
        for (int64_t t = c * kChunk; t < std::min(tiles, (c + 1) * kChunk); ++t) {
          const int valid = static_cast<int>(std::min<int64_t>(kTileRows, rows - t * kTileRows));
          tile_fn(outp + t * kTileRows * out_features, nb, tiled + t * tile_bytes,
                  packed + b0 * run_bytes, valid, b0 * kLanes, t == c * kChunk);
        }
      }
    });
  });
  return out;
}

#endif

#if defined(PAGEDINFER_INT8_GEMM)
// out[r * out_features + n0 + 16 nb + i] = acc[r][nb] lane i, for the tile's `rows` valid
// rows and the features below out_features.
template <int NB, typename Out>
inline void store_tile(const __m512 (&acc)[kTileRows][NB], Out* out, int64_t out_features, int rows, int64_t n0) {
  if constexpr (kVec<Out>) {
    if (rows == kTileRows && n0 + NB * kLanes <= out_features) {
      for (int r = 0; r < kTileRows; ++r)
        for (int nb = 0; nb < NB; ++nb) store16(out + r * out_features + n0 + nb * kLanes, acc[r][nb]);
      return;
    }
  }
  float lanes[kLanes];
  for (int r = 0; r < rows; ++r) {
    for (int nb = 0; nb < NB && n0 + nb * kLanes < out_features; ++nb) {
      _mm512_storeu_ps(lanes, acc[r][nb]);
      store_lanes(out + r * out_features + n0 + nb * kLanes, lanes, std::min(kLanes, out_features - n0 - nb * kLanes));
    }
  }
}
#endif

}  // namespace pagedinfer::quant
