// Weight-only quantised linear layers on the GGUF formats with 5- or 6-bit codes or
// 256-input super-blocks: Q5_0, Q4_K, Q5_K and Q6_K (with Q8_0, what a Q4_K_M file holds;
// quant_linear_cpu.cpp has Q4_0/Q4_1/Q8_0).
//
// Every one of them is, per sub-block s of kSub inputs,
//     w = a_s * (q - kZero) - m_s,   q an unsigned kBits-bit code,
// with a_s = d * sc_s (d float16 per super-block of kSuper inputs, sc_s the sub-block's
// 6-bit (Q4_K, Q5_K) or int8 (Q6_K) scale; Q5_0: a = d) and m_s = dmin * mn_s (Q4_K, Q5_K
// only). The kernel multiplies exact codes by float32 activations with float32 sums and
// applies a_s and m_s once per sub-block, so float32 models equal the dense product up to
// summation order (greedy parity with the dequantised weights). With int8 activations
// (AVX2 and up), the activations are rounded per group of 32 as quant_linear_cpu.cpp does
// and the codes meet them in integer dot products: exact integer sums per sub-block,
// scaled in float32. AVX2: vpmaddubsw/vpmaddwd on 8 lanes in one prefetched pass over the
// weights (block_int8); with AVX-VNNI vpdpbusd, and steps of 9+ rows through a GEMM of
// 6-row tiles (tile_half_ymm). AVX512-VNNI: vpdpbusd on 16 lanes, steps
// of 32+ rows through a register-blocked GEMM (tile_int8), smaller ones through
// block_int8_16. Every one of them has the same float arithmetic: the same bits.
//
// Packed layout ("planes", written by model/quant.py): output features padded to 16, one
// record per (block of 16 features, super-block), in this order:
// - kSuper / 8 low vectors of 64 bytes: lane i's int32 word w holds the low 4 bits of
//   codes 8w..8w+7 of feature 16b+i (code 8w+k in bits 4k..4k+3);
// - high bits (5-bit: kSuper / 32 vectors, word v holds bit 4 of codes 32v..32v+31, code
//   32v + 8m + 2t + e in bit 8t + 2m + e; 6-bit: kSuper / 16 vectors, word v holds bits 4-5
//   of codes 16v..16v+15, code 16v + 8m + 2t + e in bits 8t + 4m + 2e, +1). So byte t of a
//   low word holds codes 2t (low nibble) and 2t + 1 (high nibble) of its 8, and byte t of
//   the high word holds their high bits: one shift and mask lines them up with the nibbles
//   (the int8 path's vpmaddubsw multiplies such bytes by the activations of the even and of
//   the odd inputs, prepared in that order);
// - d as float16 [16]; dmin as float16 [16] (formats with mins);
// - the sub-block scales as bytes [sub-blocks, 16]; then the mins likewise.
// That is 4.625 / 5.625 / 6.5625 / 5.5 bits per weight (Q4_K / Q5_K / Q6_K / Q5_0): the
// file's own size, give or take the scales' layout.
//
// One source for every x86 tier and ARM: gcc vector types of kW float lanes (16 with
// AVX-512: one zmm; 8 otherwise: one ymm with AVX2, two q registers with NEON, scalar code
// elsewhere), a block's 16 lanes in 16 / kW passes over its record.
#include <torch/types.h>  // not torch/extension.h: pybind11 and the autograd API cost ~40 s of compile per file
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "quant_common.h"

namespace {

using pagedinfer::quant::Activations;
using pagedinfer::quant::kGroup;
using pagedinfer::quant::kLanes;
using pagedinfer::quant::prepare_activations;
using pagedinfer::quant::check_activations;
using pagedinfer::quant::kMaxRows;
using pagedinfer::quant::run_blocks;


#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
constexpr int kPasses = kLanes / kW;
typedef float VF __attribute__((vector_size(kW * 4)));
typedef int32_t VI __attribute__((vector_size(kW * 4)));
typedef uint32_t VU __attribute__((vector_size(kW * 4)));
typedef uint8_t VB __attribute__((vector_size(kW)));
typedef int8_t VS __attribute__((vector_size(kW)));

// The formats (GGUF type ids 6, 12, 13, 14).
struct FmtQ5_0 {
  static constexpr int kSuper = 32, kSub = 32, kBits = 5, kZero = 16;
  static constexpr bool kMins = false, kSubScales = false, kSignedScales = false;
};
struct FmtQ4_K {
  static constexpr int kSuper = 256, kSub = 32, kBits = 4, kZero = 0;
  static constexpr bool kMins = true, kSubScales = true, kSignedScales = false;
};
struct FmtQ5_K {
  static constexpr int kSuper = 256, kSub = 32, kBits = 5, kZero = 0;
  static constexpr bool kMins = true, kSubScales = true, kSignedScales = false;
};
struct FmtQ6_K {
  static constexpr int kSuper = 256, kSub = 16, kBits = 6, kZero = 32;
  static constexpr bool kMins = false, kSubScales = true, kSignedScales = true;
};

// Byte offsets inside one record (see the layout above).
template <class F>
struct Layout {
  static constexpr int64_t kLow = F::kSuper / 8;  // low-nibble vectors
  static constexpr int64_t kHigh = F::kBits == 4 ? 0 : F::kBits == 5 ? F::kSuper / 32 : F::kSuper / 16;
  static constexpr int64_t kNumSub = F::kSuper / F::kSub;
  static constexpr int64_t kD = (kLow + kHigh) * 64;
  static constexpr int64_t kDmin = kD + 32;
  static constexpr int64_t kSc = kD + (F::kMins ? 64 : 32);
  static constexpr int64_t kMn = kSc + (F::kSubScales ? kNumSub * 16 : 0);
  static constexpr int64_t kBytes = kMn + (F::kMins ? kNumSub * 16 : 0);
};

template <typename V>
inline V load(const uint8_t* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kW float16 values -> float32.
inline VF load_half(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<VF>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<VF>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  VF out;
  for (int i = 0; i < kW; ++i) {
    uint16_t bits;
    std::memcpy(&bits, p + 2 * i, 2);
    out[i] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
  return out;
#endif
}

// kW sub-block scales (bytes) -> float32.
template <bool Signed>
inline VF load_scales(const uint8_t* p) {
  if constexpr (Signed) return __builtin_convertvector(load<VS>(p), VF);
  else return __builtin_convertvector(load<VB>(p), VF);
}

// acc[r][i] = row r0 + r of the activations times feature i of this block, all super-blocks.
template <class F, int R>
void block(const Activations& a, int64_t r0, const uint8_t* recs, float (*acc)[kLanes]) {
  using L = Layout<F>;
  // AVX2 has 16 vector registers: up to 4 rows keep two chains each to hide the FMA
  // latency; more rows share one.
  constexpr bool kTwoChains = R <= 4;
  const int64_t K = a.K, G = a.G, num_super = K / F::kSuper;
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kLanes; ++i) acc[r][i] = 0.f;
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* rec = recs + sb * L::kBytes;
    pagedinfer::quant::prefetch_ahead(rec, L::kBytes);
    for (int p = 0; p < kPasses; ++p) {
      const int64_t lane = p * kW * 4;  // this pass's bytes in a 64-byte code vector
      const VF d = load_half(rec + L::kD + p * kW * 2);
      VF dmin{};
      if constexpr (F::kMins) dmin = load_half(rec + L::kDmin + p * kW * 2);
      for (int64_t s = 0; s < L::kNumSub; ++s) {
        VF t0[R], t1[R];
        for (int r = 0; r < R; ++r) t0[r] = t1[r] = VF{};
#pragma GCC unroll 4
        for (int64_t m = 0; m < F::kSub / 8; ++m) {
          const int64_t w = s * (F::kSub / 8) + m;  // codes 8w..8w+7 of the super-block
          const VU lo = load<VU>(rec + w * 64 + lane);
          VU hi{};
          if constexpr (F::kBits == 5)
            hi = load<VU>(rec + (L::kLow + w / 4) * 64 + lane) >> (2 * (w % 4));
          else if constexpr (F::kBits == 6)
            hi = load<VU>(rec + (L::kLow + w / 2) * 64 + lane) >> (4 * (w % 2));
          const int64_t x0 = sb * F::kSuper + 8 * w;
#pragma GCC unroll 8
          for (int k = 0; k < 8; ++k) {
            VU q = (lo >> (4 * k)) & 15u;
            // Code 2t + e of the word: bit(s) at 8t + e (5-bit) or 8t + 2e (6-bit) of hi.
            if constexpr (F::kBits == 5) q |= ((hi >> (8 * (k >> 1) + (k & 1))) & 1u) << 4;
            else if constexpr (F::kBits == 6) q |= ((hi >> (8 * (k >> 1) + 2 * (k & 1))) & 3u) << 4;
            VI c = reinterpret_cast<VI>(q);
            if constexpr (F::kZero != 0) c -= F::kZero;
            const VF f = __builtin_convertvector(c, VF);
            for (int r = 0; r < R; ++r) {
              const float xv = a.xf[(r0 + r) * K + x0 + k];
              if (kTwoChains && (k & 1)) t1[r] += f * xv;
              else t0[r] += f * xv;
            }
          }
        }
        VF scale = d;
        if constexpr (F::kSubScales)
          scale = d * load_scales<F::kSignedScales>(rec + L::kSc + s * 16 + p * kW);
        VF min{};
        if constexpr (F::kMins) min = dmin * load_scales<false>(rec + L::kMn + s * 16 + p * kW);
        const int64_t g = (sb * F::kSuper + s * F::kSub) / kGroup;
        for (int r = 0; r < R; ++r) {
          VF total;
          std::memcpy(&total, acc[r] + p * kW, sizeof total);
          total += scale * (t0[r] + t1[r]);
          if constexpr (F::kMins) total -= min * a.xsum[(r0 + r) * G + g];
          std::memcpy(acc[r] + p * kW, &total, sizeof total);
        }
      }
    }
  }
}

// --- int8 activations ---------------------------------------------------------------------

// AVX2 for the integer dot products, F16C for the float16 scales (every AVX2 tier has it).
#if defined(__AVX2__) && defined(__F16C__)
#define PAGEDINFER_KQUANT_INT8 1
constexpr bool kInt8Dot = true;
#else
constexpr bool kInt8Dot = false;
#endif

// The int8 activations in the order the codes' bytes pair them: per 8 inputs, the 4 even
// ones then the 4 odd ones; and, with sub-blocks of 16 (Q6_K), the code sums per 16 inputs.
struct PairedActivations {
  std::vector<int8_t> xp;      // [rows, K]
  std::vector<int32_t> sum16;  // [rows, K / 16]
};

inline PairedActivations pair_activations(const Activations& a, int64_t rows, bool sums16) {
  PairedActivations p;
  p.xp.resize(static_cast<size_t>(rows * a.K));
  if (sums16) p.sum16.resize(static_cast<size_t>(rows * a.K / 16));
  for (int64_t i = 0; i < rows * a.K; i += 8) {
    for (int64_t t = 0; t < 4; ++t) {
      p.xp[i + t] = a.xq[i + 2 * t];
      p.xp[i + 4 + t] = a.xq[i + 2 * t + 1];
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(p.sum16.size()); ++i) {
    int32_t total = 0;
    for (int64_t j = 0; j < 16; ++j) total += a.xq[16 * i + j];
    p.sum16[i] = total;
  }
  return p;
}

#if defined(PAGEDINFER_KQUANT_INT8)
// The bits at 8t + `from` of every 32-bit lane moved to 8t + 4 (`from` a constant once the
// callers' loops are unrolled).
inline __m256i align_high(__m256i h, int from) {
  return from <= 4 ? _mm256_slli_epi32(h, 4 - from) : _mm256_srli_epi32(h, from - 4);
}

// 8 sub-block scales (bytes) -> float32.
template <bool Signed>
inline __m256 scales8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// One 8-lane pass over word w of a super-block: its even and its odd codes as bytes.
template <class F>
inline void codes_of_word(const uint8_t* rec, int64_t lane, int64_t w, __m256i& ev, __m256i& od) {
  using L = Layout<F>;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + w * 64 + lane));
  ev = _mm256_and_si256(v, nibble);
  od = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  if constexpr (F::kBits == 5) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + (L::kLow + w / 4) * 64 + lane));
    const __m256i bit = _mm256_set1_epi8(0x10);
    const int from = static_cast<int>(2 * (w % 4));
    ev = _mm256_or_si256(ev, _mm256_and_si256(align_high(h, from), bit));
    od = _mm256_or_si256(od, _mm256_and_si256(align_high(h, from + 1), bit));
  } else if constexpr (F::kBits == 6) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + (L::kLow + w / 2) * 64 + lane));
    const __m256i bits = _mm256_set1_epi8(0x30);
    const int from = static_cast<int>(4 * (w % 2));
    ev = _mm256_or_si256(ev, _mm256_and_si256(align_high(h, from), bits));
    od = _mm256_or_si256(od, _mm256_and_si256(align_high(h, from + 2), bits));
  }
}

// Sub-block s of one super-block, one 8-lane pass: dot[r] = the integer dot products of
// its codes (unsigned, zero point not yet taken off) with row r0 + r's int8 activations
// (`x` at the super-block's first input of row r0). With AVX-VNNI (or AVX512-VNNI's ymm
// form) vpdpbusd multiplies and sums into 32 bits in one instruction: the even and the odd
// codes in two chains while few rows give few independent ones. Otherwise vpmaddubsw pairs
// stay in 16 bits for as many words as cannot overflow (per word <= 2 x 2 x 15 x 127 with
// 4-bit codes: 4 words; 5-bit: 2; 6-bit: 1), then vpmaddwd widens them. Exact integer sums
// either way, so both give the same results.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define PAGEDINFER_YMM_VNNI 1
inline __m256i dpbusd8(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u8, s8);
#else
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}
#endif

template <class F, int R>
inline void sub_block_dots(const uint8_t* rec, int64_t lane, int64_t s, const int8_t* x,
                           int64_t K, __m256i (&dot)[R]) {
  constexpr int64_t kWords = F::kSub / 8;
#if defined(PAGEDINFER_YMM_VNNI)
  constexpr bool kTwoChains = R <= 4;
  __m256i odd[R];
  for (int r = 0; r < R; ++r) odd[r] = _mm256_setzero_si256();
#else
  constexpr int64_t kRun = F::kBits == 4 ? 4 : F::kBits == 5 ? 2 : 1;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[R];
#endif
  for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int64_t m = 0; m < kWords; ++m) {
    const int64_t w = s * kWords + m;
    __m256i ev, od;
    codes_of_word<F>(rec, lane, w, ev, od);
    for (int r = 0; r < R; ++r) {
      const int32_t* xd = reinterpret_cast<const int32_t*>(x + r * K + 8 * w);
#if defined(PAGEDINFER_YMM_VNNI)
      dot[r] = dpbusd8(dot[r], ev, _mm256_set1_epi32(xd[0]));
      if constexpr (kTwoChains) odd[r] = dpbusd8(odd[r], od, _mm256_set1_epi32(xd[1]));
      else dot[r] = dpbusd8(dot[r], od, _mm256_set1_epi32(xd[1]));
#else
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(ev, _mm256_set1_epi32(xd[0])),
                                         _mm256_maddubs_epi16(od, _mm256_set1_epi32(xd[1])));
      s16[r] = m % kRun == 0 ? p : _mm256_add_epi16(s16[r], p);
      if (m % kRun == kRun - 1 || m == kWords - 1)
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(s16[r], ones));
#endif
    }
  }
#if defined(PAGEDINFER_YMM_VNNI)
  if constexpr (kTwoChains)
    for (int r = 0; r < R; ++r) dot[r] = _mm256_add_epi32(dot[r], odd[r]);
#endif
}

template <class F, int R>
void block_int8(const Activations& a, const PairedActivations& p, int64_t r0, const uint8_t* recs,
                float (*acc)[kLanes]) {
  using L = Layout<F>;
  const int64_t K = a.K, G = a.G, num_super = K / F::kSuper;
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kLanes; ++i) acc[r][i] = 0.f;
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* rec = recs + sb * L::kBytes;
    pagedinfer::quant::prefetch_ahead(rec, L::kBytes);
    const int8_t* x = p.xp.data() + r0 * K + sb * F::kSuper;
    for (int64_t pass = 0; pass < 2; ++pass) {
      const int64_t lane = pass * 32;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L::kD + pass * 16)));
      __m256 dmin = _mm256_setzero_ps();
      if constexpr (F::kMins)
        dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L::kDmin + pass * 16)));
      for (int64_t sub = 0; sub < L::kNumSub; ++sub) {
        __m256i dot[R];
        sub_block_dots<F, R>(rec, lane, sub, x, K, dot);
        __m256 scale = d, min = _mm256_setzero_ps();
        if constexpr (F::kSubScales)
          scale = _mm256_mul_ps(d, scales8<F::kSignedScales>(rec + L::kSc + sub * 16 + pass * 8));
        if constexpr (F::kMins)
          min = _mm256_mul_ps(dmin, scales8<false>(rec + L::kMn + sub * 16 + pass * 8));
        const int64_t first = sb * F::kSuper + sub * F::kSub, g = first / kGroup;
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          // The zero point: kZero times the sum of the sub-block's int8 activations.
          const int32_t xs = F::kSub == 16 ? p.sum16[row * (K / 16) + first / 16] : a.xqsum[row * G + g];
          const __m256i exact = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(F::kZero * xs));
          __m256 total = _mm256_loadu_ps(acc[r] + 8 * pass);
          total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact),
                                  _mm256_mul_ps(scale, _mm256_set1_ps(a.xscale[row * G + g])), total);
          if constexpr (F::kMins)
            total = _mm256_fnmadd_ps(min, _mm256_set1_ps(a.xsum[row * G + g]), total);
          _mm256_storeu_ps(acc[r] + 8 * pass, total);
        }
      }
    }
  }
}
#endif

// --- many rows: the GEMMs' frame (the AVX2 tier's tile_half_ymm, AVX-512's tile_int8) ----
#if defined(PAGEDINFER_INT8_TILES)
using pagedinfer::quant::kTileRows;

// The K-quant GEMMs' frame: x prepared into tiles (codes paired as the records pair them),
// run_tiles over the packed blocks; tile(out, nb, tile, weights, valid rows, first
// feature, lead, super-blocks, bytes per block) stores one tile's product.
template <class F, typename TileFn>
torch::Tensor run_kquant_tiles(const torch::Tensor& x, const uint8_t* packed, int64_t blocks,
                               int64_t out_features, const TileFn& tile) {
  constexpr bool kSums16 = F::kSub == 16;
  const int64_t num_super = x.size(1) / F::kSuper, run_bytes = num_super * Layout<F>::kBytes;
  const std::unique_ptr<uint8_t[]> tiled = pagedinfer::quant::prepare_tiles<true, kSums16, F::kZero>(x);
  const int64_t tile_bytes = x.size(1) / kGroup * pagedinfer::quant::tile_record_bytes(kSums16);
  return pagedinfer::quant::run_tiles(
      x, tiled.get(), tile_bytes, packed, blocks, run_bytes, out_features,
      [&](auto* o, int nb, const uint8_t* xt, const uint8_t* w, int valid, int64_t n0, bool lead) {
        tile(o, nb, xt, w, valid, n0, lead, num_super, run_bytes);
      });
}
#endif

// --- many rows on the AVX2 tier: the tiles of tile_int8 below, one half block at a time --
//
// The activations in tiles of kTileRows rows (quant_common.h, prepare_tiles: one pointer
// reaches every row's codes, scales and sums); a tile's rows times one half (8 features)
// of a block over all of K, the float totals in kTileRows ymm registers, each word's codes
// unpacked once for all of the tile's rows. block_int8 (8 rows x 8 lanes per pass) keeps
// its totals in memory and has the compiler spill its 8 rows' sums and row pointers
// (perf annotate). The float epilogue per sub-block is block_int8's, operation for
// operation, and the integer sums start at the zero point as tile_int8's do, so every
// path gives bit-identical results.
// Only with vpdpbusd: without it (vpmaddubsw + vpmaddwd per word, no room for 16-bit
// partial sums beside 6 rows' totals) the tiles measured slower than block_int8 (Q4_K 339
// against 368 GOP/s at 512 rows, 296 against 364 at 16; Q6_K 300 against 324).
#if defined(PAGEDINFER_YMM_VNNI)
// lanes[r][8 h .. 8 h + 7] = row r of the tile (records `xt`) times features 8h..8h+7 of
// the block whose records start at w. (Both halves in one walk, each broadcast serving
// two vpdpbusd, measured slower: Q4_K 555-583 against 575-605 GOP/s at 512 rows, Q6_K
// 377-379 against 437-492, its 12 sums leaving the totals to memory.)
template <class F>
void tile_half_ymm(const uint8_t* xt, int64_t num_super, const uint8_t* w, int h, bool fetch,
                   float (*lanes)[kLanes]) {
  using L = Layout<F>;
  constexpr int R = kTileRows;
  constexpr int64_t kRecord = pagedinfer::quant::tile_record_bytes(F::kSub == 16);
  constexpr int64_t kWords = F::kSub / 8;
  const int64_t lane = 32 * h;  // this half's bytes in a 64-byte code vector
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* rec = w + sb * L::kBytes;
    if (fetch) pagedinfer::quant::prefetch_ahead(rec, L::kBytes);
    for (int64_t sub = 0; sub < L::kNumSub; ++sub) {
      const int64_t first = sb * F::kSuper + sub * F::kSub;
      const uint8_t* x = xt + first / kGroup * kRecord;
      const float* xscale = reinterpret_cast<const float*>(x + R * kGroup);
      const float* xsum = xscale + R;
      const int32_t* zero = reinterpret_cast<const int32_t*>(xsum + R);
      __m256i s[R];
      for (int r = 0; r < R; ++r) {
        const int32_t z = F::kSub == 16 ? zero[R + 2 * r + (first % kGroup) / 16] : zero[r];
        s[r] = F::kZero ? _mm256_set1_epi32(z) : _mm256_setzero_si256();
      }
#pragma GCC unroll 4
      for (int64_t m = 0; m < kWords; ++m) {
        __m256i ev, od;
        codes_of_word<F>(rec, lane, sub * kWords + m, ev, od);
        const int64_t at = (first % kGroup) + 8 * m;
        for (int r = 0; r < R; ++r) {
          const int32_t* xd = reinterpret_cast<const int32_t*>(x + r * kGroup + at);
          s[r] = dpbusd8(dpbusd8(s[r], ev, _mm256_set1_epi32(xd[0])), od, _mm256_set1_epi32(xd[1]));
        }
      }
      __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L::kD + 16 * h)));
      if constexpr (F::kSubScales)
        scale = _mm256_mul_ps(scale, scales8<F::kSignedScales>(rec + L::kSc + sub * 16 + 8 * h));
      __m256 min = _mm256_setzero_ps();
      if constexpr (F::kMins)
        min = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L::kDmin + 16 * h))),
                            scales8<false>(rec + L::kMn + sub * 16 + 8 * h));
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(scale, _mm256_set1_ps(xscale[r])), acc[r]);
        if constexpr (F::kMins) acc[r] = _mm256_fnmadd_ps(min, _mm256_set1_ps(xsum[r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(lanes[r] + 8 * h, acc[r]);
}

template <class F>
torch::Tensor run_gemm_ymm(const torch::Tensor& x, const uint8_t* packed, int64_t blocks,
                           int64_t out_features) {
  return run_kquant_tiles<F>(
      x, packed, blocks, out_features,
      [&](auto* o, int nb, const uint8_t* xt, const uint8_t* w, int valid, int64_t n0, bool lead,
          int64_t num_super, int64_t run_bytes) {
        float lanes[kTileRows][kLanes];
        for (int b = 0; b < nb; ++b) {
          // The first half's pass asks for the weights ahead on the item's first tile (from
          // DRAM, 6 rows: 326 -> 535-561 GOP/s).
          tile_half_ymm<F>(xt, num_super, w + b * run_bytes, 0, lead, lanes);
          tile_half_ymm<F>(xt, num_super, w + b * run_bytes, 1, false, lanes);
          const int64_t first = n0 + b * kLanes, width = std::min(kLanes, out_features - first);
          for (int r = 0; r < valid; ++r) pagedinfer::quant::store_lanes(o + r * out_features + first, lanes[r], width);
        }
      });
}
#endif

// --- many rows: a register-blocked int8 GEMM (AVX512-VNNI) -------------------------------
//
// As quant_linear_cpu.cpp's tile_int8: activations in tiles of kTileRows rows (paired as
// the codes' bytes are, quant_common.h), each record's codes unpacked once for the tile's
// rows, vpdpbusd on 16 lanes (a whole block) where block_int8 above runs two 8-lane passes
// of vpmaddubsw. The float epilogue per sub-block is block_int8's, operation for
// operation, so both paths give bit-identical results.
#if defined(PAGEDINFER_INT8_GEMM)
using pagedinfer::quant::kGemmMinRowsK;
using pagedinfer::quant::kTileBlocks;
using pagedinfer::quant::kTileRows;

// The bits at 8t + `from` of every 32-bit lane moved to 8t + 4.
inline __m512i align_high16(__m512i h, int from) {
  return from <= 4 ? _mm512_slli_epi32(h, 4 - from) : _mm512_srli_epi32(h, from - 4);
}

// Word w of a super-block's record, all 16 lanes: its even and its odd codes as bytes.
template <class F>
inline void codes_of_word16(const uint8_t* rec, int64_t w, __m512i& ev, __m512i& od) {
  using L = Layout<F>;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(rec + w * 64);
  ev = _mm512_and_si512(v, nibble);
  od = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  // ev | (aligned high bits & mask): ternary logic 0xF8 (A | (B & C)).
  if constexpr (F::kBits == 5) {
    const __m512i h = _mm512_loadu_si512(rec + (L::kLow + w / 4) * 64);
    const __m512i bit = _mm512_set1_epi8(0x10);
    const int from = static_cast<int>(2 * (w % 4));
    ev = _mm512_ternarylogic_epi32(ev, align_high16(h, from), bit, 0xF8);
    od = _mm512_ternarylogic_epi32(od, align_high16(h, from + 1), bit, 0xF8);
  } else if constexpr (F::kBits == 6) {
    const __m512i h = _mm512_loadu_si512(rec + (L::kLow + w / 2) * 64);
    const __m512i bits = _mm512_set1_epi8(0x30);
    const int from = static_cast<int>(4 * (w % 2));
    ev = _mm512_ternarylogic_epi32(ev, align_high16(h, from), bits, 0xF8);
    od = _mm512_ternarylogic_epi32(od, align_high16(h, from + 2), bits, 0xF8);
  }
}

// 16 sub-block scales (bytes) -> float32.
template <bool Signed>
inline __m512 scales16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// out[r][n0 + 16 nb + i] = row r of the tile (records `xt`) times feature i of block nb of
// the NB blocks whose record runs start at w (block nb at w + nb * run_bytes).
template <class F, int NB, typename Out>
void tile_int8(const uint8_t* xt, int64_t num_super, const uint8_t* w, int64_t run_bytes,
               Out* out, int64_t out_features, int rows, int64_t n0) {
  using L = Layout<F>;
  constexpr int R = kTileRows;
  constexpr int64_t kRecord = pagedinfer::quant::tile_record_bytes(F::kSub == 16);
  constexpr int64_t kWords = F::kSub / 8;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* rec[NB];
    for (int nb = 0; nb < NB; ++nb) rec[nb] = w + nb * run_bytes + sb * L::kBytes;
    for (int64_t sub = 0; sub < L::kNumSub; ++sub) {
      const int64_t first = sb * F::kSuper + sub * F::kSub;  // the sub-block's first input
      const uint8_t* x = xt + first / kGroup * kRecord;      // its group's tile record
      const float* xscale = reinterpret_cast<const float*>(x + R * kGroup);
      const float* xsum = xscale + R;
      // -kZero times the sum of the sub-block's int8 activations (prepare_tiles): where the
      // sums start, so they end as the exact products of (q - kZero) and the activations.
      const int32_t* zero = reinterpret_cast<const int32_t*>(xsum + R);
      __m512i s[R][NB];
      for (int r = 0; r < R; ++r) {
        const int32_t z = F::kSub == 16 ? zero[R + 2 * r + (first % kGroup) / 16] : zero[r];
        for (int nb = 0; nb < NB; ++nb) s[r][nb] = F::kZero ? _mm512_set1_epi32(z) : _mm512_setzero_si512();
      }
#pragma GCC unroll 4
      for (int64_t m = 0; m < kWords; ++m) {
        const int64_t wd = sub * kWords + m;  // codes 8 wd .. 8 wd + 7 of the super-block
        __m512i ev[NB], od[NB];
        for (int nb = 0; nb < NB; ++nb) codes_of_word16<F>(rec[nb], wd, ev[nb], od[nb]);
        const int64_t at = (first % kGroup) + 8 * m;  // byte of the row's 32 in the record
        for (int r = 0; r < R; ++r) {
          const int32_t* xd = reinterpret_cast<const int32_t*>(x + r * kGroup + at);
          const __m512i xe = _mm512_set1_epi32(xd[0]), xo = _mm512_set1_epi32(xd[1]);
          for (int nb = 0; nb < NB; ++nb) {
            s[r][nb] = _mm512_dpbusd_epi32(s[r][nb], ev[nb], xe);
            s[r][nb] = _mm512_dpbusd_epi32(s[r][nb], od[nb], xo);
          }
        }
      }
      for (int nb = 0; nb < NB; ++nb) {
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[nb] + L::kD)));
        if constexpr (F::kSubScales)
          scale = _mm512_mul_ps(scale, scales16<F::kSignedScales>(rec[nb] + L::kSc + sub * 16));
        __m512 min = _mm512_setzero_ps();
        if constexpr (F::kMins)
          min = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[nb] + L::kDmin))),
                              scales16<false>(rec[nb] + L::kMn + sub * 16));
        for (int r = 0; r < R; ++r) {
          acc[r][nb] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][nb]), _mm512_mul_ps(scale, _mm512_set1_ps(xscale[r])),
                                       acc[r][nb]);
          if constexpr (F::kMins) acc[r][nb] = _mm512_fnmadd_ps(min, _mm512_set1_ps(xsum[r]), acc[r][nb]);
        }
      }
    }
  }
  pagedinfer::quant::store_tile<NB>(acc, out, out_features, rows, n0);
}

template <class F>
torch::Tensor run_gemm_int8(const torch::Tensor& x, const uint8_t* packed, int64_t blocks,
                            int64_t out_features) {
  return run_kquant_tiles<F>(
      x, packed, blocks, out_features,
      [&](auto* o, int nb, const uint8_t* xt, const uint8_t* w, int valid, int64_t n0, bool,
          int64_t num_super, int64_t run_bytes) {
        if (nb == kTileBlocks) tile_int8<F, kTileBlocks>(xt, num_super, w, run_bytes, o, out_features, valid, n0);
        else tile_int8<F, 1>(xt, num_super, w, run_bytes, o, out_features, valid, n0);
      });
}
#endif

#if defined(PAGEDINFER_INT8_GEMM)
// Few rows (steps below kGemmMinRowsK) with AVX512-VNNI: block_int8's walk over the
// weights (one pass per step, prefetched), all 16 lanes of a block in one zmm and vpdpbusd
// where block_int8 takes two 8-lane passes of vpmaddubsw / vpmaddwd; the sums start at the
// zero point (-kZero x the sub-block's activation code sum) as tile_int8's do. Same integer
// sums and the same float operations in the same order as block_int8, so bit-identical
// results. Measured (docs/benchmarks.md "K-quant steps of 1-31 rows on zmm VNNI"):
// 1.4-2.4x block_int8.
template <class F, int R>
void block_int8_16(const Activations& a, const PairedActivations& p, int64_t r0,
                   const uint8_t* recs, float (*acc_out)[kLanes]) {
  using L = Layout<F>;
  constexpr int64_t kWords = F::kSub / 8;
  const int64_t K = a.K, G = a.G, num_super = K / F::kSuper;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* rec = recs + sb * L::kBytes;
    pagedinfer::quant::prefetch_ahead(rec, L::kBytes);
    const int8_t* x = p.xp.data() + r0 * K + sb * F::kSuper;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L::kD)));
    __m512 dmin = _mm512_setzero_ps();
    if constexpr (F::kMins)
      dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L::kDmin)));
    for (int64_t sub = 0; sub < L::kNumSub; ++sub) {
      const int64_t first = sb * F::kSuper + sub * F::kSub, g = first / kGroup;
      // The even and the odd codes' products in separate sums (two dependency chains of
      // vpdpbusd instead of one: at 1-2 rows the chain's latency is the kernel's pace).
      __m512i s[R], t[R];
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int32_t xs = F::kSub == 16 ? p.sum16[row * (K / 16) + first / 16] : a.xqsum[row * G + g];
        s[r] = _mm512_set1_epi32(-F::kZero * xs);
        t[r] = _mm512_setzero_si512();
      }
#pragma GCC unroll 4
      for (int64_t m = 0; m < kWords; ++m) {
        const int64_t w = sub * kWords + m;
        __m512i ev, od;
        codes_of_word16<F>(rec, w, ev, od);
        for (int r = 0; r < R; ++r) {
          const int32_t* xd = reinterpret_cast<const int32_t*>(x + r * K + 8 * w);
          s[r] = _mm512_dpbusd_epi32(s[r], ev, _mm512_set1_epi32(xd[0]));
          t[r] = _mm512_dpbusd_epi32(t[r], od, _mm512_set1_epi32(xd[1]));
        }
      }
      for (int r = 0; r < R; ++r) s[r] = _mm512_add_epi32(s[r], t[r]);
      __m512 scale = d, min = _mm512_setzero_ps();
      if constexpr (F::kSubScales) scale = _mm512_mul_ps(d, scales16<F::kSignedScales>(rec + L::kSc + sub * 16));
      if constexpr (F::kMins) min = _mm512_mul_ps(dmin, scales16<false>(rec + L::kMn + sub * 16));
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(scale, _mm512_set1_ps(a.xscale[row * G + g])),
                                 acc[r]);
        if constexpr (F::kMins) acc[r] = _mm512_fnmadd_ps(min, _mm512_set1_ps(a.xsum[row * G + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc_out[r], acc[r]);
}
#endif

template <class F>
void block_rows(int R, const Activations& a, const PairedActivations* paired, int64_t r0,
                const uint8_t* recs, float (*acc)[kLanes]) {
#if defined(PAGEDINFER_INT8_GEMM)
#define PAGEDINFER_INT8_ROWS(N) if (paired != nullptr) return block_int8_16<F, N>(a, *paired, r0, recs, acc);
#elif defined(PAGEDINFER_KQUANT_INT8)
#define PAGEDINFER_INT8_ROWS(N) if (paired != nullptr) return block_int8<F, N>(a, *paired, r0, recs, acc);
#else
#define PAGEDINFER_INT8_ROWS(N)
#endif
#define PAGEDINFER_ROWS(N)  \
  case N:                   \
    PAGEDINFER_INT8_ROWS(N) \
    return block<F, N>(a, r0, recs, acc);
  switch (R) {
    PAGEDINFER_ROWS(1)
    PAGEDINFER_ROWS(2)
    PAGEDINFER_ROWS(3)
    PAGEDINFER_ROWS(4)
    PAGEDINFER_ROWS(5)
    PAGEDINFER_ROWS(6)
    PAGEDINFER_ROWS(7)
    default:
      PAGEDINFER_ROWS(8)
  }
#undef PAGEDINFER_ROWS
#undef PAGEDINFER_INT8_ROWS
}

template <class F>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                  bool int8_activations) {
  using L = Layout<F>;
  check_activations(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % F::kSuper == 0, "in_features must be a multiple of ", F::kSuper);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == K / F::kSuper && packed.size(2) == L::kBytes,
              "packed weights must be contiguous uint8 [blocks, in / ", F::kSuper, ", ",
              L::kBytes, "]");
  const bool int8 = kInt8Dot && int8_activations;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
#if defined(PAGEDINFER_INT8_GEMM)
  if (int8 && x.size(0) >= kGemmMinRowsK) {
    return run_gemm_int8<F>(x, pp, packed.size(0), out_features);
  }
#elif defined(PAGEDINFER_YMM_VNNI)
  if (int8 && x.size(0) >= pagedinfer::quant::kGemmMinRowsYmm) {
    return run_gemm_ymm<F>(x, pp, packed.size(0), out_features);
  }
#endif
  std::vector<float> scratch;
  const Activations a = prepare_activations(x, int8, scratch);
  PairedActivations paired;
  if (int8) paired = pair_activations(a, x.size(0), F::kSub == 16);
  const int64_t block_bytes = (K / F::kSuper) * L::kBytes;
  return run_blocks(x, packed.size(0), out_features, [&](int R, int64_t r0, int64_t b, float (*acc)[kLanes]) {
    block_rows<F>(R, a, int8 ? &paired : nullptr, r0, pp + b * block_bytes, acc);
  });
}

}  // namespace

// y = x @ W.T with W packed by model/quant.py in the "planes" layout above; format is the
// GGUF type id: 6 (Q5_0), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K). int8_activations: round x per
// group of 32 to int8 where this build has the integer path (AVX2), else float32.
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor packed, int64_t format,
                            int64_t out_features, bool int8_activations) {
  switch (format) {
    case 6: return run<FmtQ5_0>(x, packed, out_features, int8_activations);
    case 12: return run<FmtQ4_K>(x, packed, out_features, int8_activations);
    case 13: return run<FmtQ5_K>(x, packed, out_features, int8_activations);
    case 14: return run<FmtQ6_K>(x, packed, out_features, int8_activations);
    default: TORCH_CHECK(false, "unknown K-quant format ", format, " (6, 12, 13 or 14)");
  }
}

// Whether kquant_linear has an int8-activation path in this build (AVX2 and up).
bool kquant_linear_uses_int8_activations() { return kInt8Dot; }

// Record bytes of one (16 features, super-block) record of a format (for the packer's check).
int64_t kquant_record_bytes(int64_t format) {
  switch (format) {
    case 6: return Layout<FmtQ5_0>::kBytes;
    case 12: return Layout<FmtQ4_K>::kBytes;
    case 13: return Layout<FmtQ5_K>::kBytes;
    case 14: return Layout<FmtQ6_K>::kBytes;
    default: TORCH_CHECK(false, "unknown K-quant format ", format, " (6, 12, 13 or 14)");
  }
}
