// Weight-only quantised linear layers on the GGUF file's own blocks: Q4_1 (w = d * q + m, q
// in 0..15; Q4_0 is the case m = -8 d) and Q8_0 (w = d * q, q in -127..127), one scale (and
// offset) per group of 32 inputs. Built for decode's few rows; with AVX512-VNNI, steps of
// 16+ rows run the GEMM further down ("many rows").
//
// A decode step of a small batch reads every weight once and does ~2 flops with it, so the
// cost is reading and widening the codes. The weights are repacked at load so that one
// 64-byte vector holds the same 4 inputs of 16 output features ("x16" layout below): each
// of the 16 lanes accumulates one output, no horizontal sums, and the 16 features' scales
// of a group are one vector load.
//
// Two inner products over that layout, the caller choosing (`int8_activations`):
// - int8 activations, CPUs with AVX512-VNNI or AVX2: the activations are quantised per
//   group of 32 to int8 with a float scale (what llama.cpp does with its q8_1 activations;
//   the rounding, <= 0.4% of the group's largest value, is of the order of bf16's own);
//   `vpdpbusd` multiplies 64 code/activation byte pairs per instruction, AVX2's
//   `vpmaddubsw` + `vpmaddwd` 32 in two. Exact integer dot products, float scales.
// - float activations (and any CPU without either): codes widened to float32, exact
//   products, float32 sums; the result equals the dense product up to summation order, so
//   float32 models keep greedy parity with the dense weights.
// Both add the Q4 offset as sum_g m[n, g] * (sum of x over group g), from unrounded x.
//
// "x16" layout: output features padded to a multiple of 16; feature block b = features
// 16b..16b+15. For each block b and input group g (32 inputs) one contiguous record, so a
// thread reads a single forward stream:
// - Q4 (320 bytes): codes [4 vectors, 16 lanes, 4 bytes], then scale and offset as float16
//   [16] each. Vector j, lane i holds bytes 4j..4j+3 of feature 16b+i's GGUF block g (byte
//   t: input t in the low nibble, input 16 + t in the high one), so vector j carries inputs
//   4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high nibbles).
// - Q8 (544 bytes): codes int8 [8 vectors, 16 lanes, 4 bytes] (vector j, lane i: inputs
//   4j..4j+3 of feature 16b+i), then scale as float16 [16].
// The scales are the file's float16 values, widened in registers.
#include <torch/types.h>  // not torch/extension.h: pybind11 and the autograd API cost ~40 s of compile per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "quant_common.h"
#include "vec.h"

namespace {

// An integer dot product for int8 activations: AVX512-VNNI (vpdpbusd on zmm), else AVX2
// (vpmaddubsw + vpmaddwd on ymm, as llama.cpp does on such CPUs).
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
    (defined(__AVX2__) && defined(__F16C__))
constexpr bool kInt8Dot = true;
#else
constexpr bool kInt8Dot = false;
#endif

using pagedinfer::quant::Activations;
using pagedinfer::quant::kGroup;
using pagedinfer::quant::kLanes;
using pagedinfer::quant::prepare_activations;
using pagedinfer::quant::check_activations;
using pagedinfer::quant::kMaxRows;
using pagedinfer::quant::run_blocks;
using pagedinfer::quant::kGemmMinRows;
using pagedinfer::quant::kTileBlocks;
using pagedinfer::quant::kTileRows;
constexpr int64_t kTileRecordBytes = pagedinfer::quant::tile_record_bytes(false);

enum class Format : int64_t { kQ4 = 4, kQ8 = 8 };

template <Format F>
struct Record {
  static constexpr int64_t kVectors = F == Format::kQ4 ? 4 : 8;  // 64-byte code vectors
  static constexpr int64_t kCodeBytes = kVectors * 64;
  static constexpr int64_t kBytes = kCodeBytes + (F == Format::kQ4 ? 64 : 32);
  static const uint16_t* scale(const uint8_t* rec) {
    return reinterpret_cast<const uint16_t*>(rec + kCodeBytes);
  }
  static const uint16_t* offset(const uint8_t* rec) { return scale(rec) + kLanes; }
  // Record g of a feature block's run, asking for the bytes kPrefetchBytes ahead of it.
  static const uint8_t* fetch(const uint8_t* recs, int64_t g) {
    const uint8_t* rec = recs + g * kBytes;
    pagedinfer::quant::prefetch_ahead(rec, kBytes);
    return rec;
  }
};

inline int64_t record_bytes(Format f) {
  return f == Format::kQ4 ? Record<Format::kQ4>::kBytes : Record<Format::kQ8>::kBytes;
}

#if defined(__AVX512F__)
inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
// 8 float lanes / 8 int32 lanes in gcc's portable vector types (the non-AVX-512 path).
using F8 = pagedinfer::F8v;
using I8 = pagedinfer::I8v;

inline F8 load_half8(const uint16_t* p) {
#if defined(__F16C__)
  return reinterpret_cast<F8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  F8 out;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
  return out;
#endif
}
#endif

// --- float32 products (exact codes, float32 sums) ----------------------------------------

// acc_out[r][i] = sum over the row of block b's feature i times activation row r0 + r.
template <Format F, int R>
void block_float(const Activations& a, int64_t r0, const uint8_t* recs, float (*acc_out)[kLanes]) {
  using Rec = Record<F>;
  const int64_t G = a.G, K = a.K;
#if defined(__AVX512F__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = Rec::fetch(recs, g);
    __m512 t0[R], t1[R];  // two chains: low and high inputs (Q4) / even and odd vectors (Q8)
    for (int r = 0; r < R; ++r) t0[r] = t1[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < Rec::kVectors; ++j) {
      const __m512i v = _mm512_loadu_si512(rec + j * 64);
      for (int t = 0; t < 4; ++t) {
        if constexpr (F == Format::kQ4) {
          const __m512i s = _mm512_srli_epi32(v, 8 * t);
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(s, _mm512_set1_epi32(0x0F)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(s, 4), _mm512_set1_epi32(0x0F)));
          for (int r = 0; r < R; ++r) {
            const float* x = a.xf + (r0 + r) * K + g * kGroup;
            t0[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[4 * j + t]), t0[r]);
            t1[r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[16 + 4 * j + t]), t1[r]);
          }
        } else {
          // Sign-extend byte t of each lane: shift it to the top, arithmetic shift down.
          const __m512 c = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * t), 24));
          for (int r = 0; r < R; ++r) {
            const __m512 xv = _mm512_set1_ps(a.xf[(r0 + r) * K + g * kGroup + 4 * j + t]);
            if (j % 2 == 0) t0[r] = _mm512_fmadd_ps(c, xv, t0[r]);
            else t1[r] = _mm512_fmadd_ps(c, xv, t1[r]);
          }
        }
      }
    }
    const __m512 d = load_half16(Rec::scale(rec));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(t0[r], t1[r]), d, acc[r]);
      if constexpr (F == Format::kQ4)
        acc[r] = _mm512_fmadd_ps(load_half16(Rec::offset(rec)),
                                 _mm512_set1_ps(a.xsum[(r0 + r) * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc_out[r], acc[r]);
#else
  // Without AVX-512: the same products in GCC vector types of 8 floats, one half of the
  // block's 16 lanes at a time (bytes 32h..32h+31 of each 64-byte code vector). gcc lowers
  // them to AVX2 (one ymm each) or NEON (two q registers), scalar code elsewhere.
  // AVX2 has 16 vector registers: rows past 4 share one chain per row, fewer rows keep
  // two (low and high inputs / even and odd vectors) to hide the FMA latency, and the
  // totals live in acc_out, updated once per group.
  constexpr bool kTwoChains = R <= 4;
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kLanes; ++i) acc_out[r][i] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = Rec::fetch(recs, g);
    for (int64_t h = 0; h < 2; ++h) {
      F8 t0[R], t1[R];
      for (int r = 0; r < R; ++r) t0[r] = t1[r] = F8{};
      for (int64_t j = 0; j < Rec::kVectors; ++j) {
        I8 v;
        std::memcpy(&v, rec + j * 64 + h * 32, sizeof v);
        for (int t = 0; t < 4; ++t) {
          if constexpr (F == Format::kQ4) {
            const I8 sh = v >> (8 * t);  // the nibbles' bits are below bit 8 * t + 8: sign-safe
            const F8 lo = __builtin_convertvector(sh & 0x0F, F8);
            const F8 hi = __builtin_convertvector((sh >> 4) & 0x0F, F8);
            for (int r = 0; r < R; ++r) {
              const float* x = a.xf + (r0 + r) * K + g * kGroup;
              t0[r] += lo * x[4 * j + t];
              if constexpr (kTwoChains) t1[r] += hi * x[16 + 4 * j + t];
              else t0[r] += hi * x[16 + 4 * j + t];
            }
          } else {
            const F8 c = __builtin_convertvector((v << (24 - 8 * t)) >> 24, F8);  // sign-extended byte t
            for (int r = 0; r < R; ++r) {
              const float xv = a.xf[(r0 + r) * K + g * kGroup + 4 * j + t];
              if (kTwoChains && j % 2 == 1) t1[r] += c * xv;
              else t0[r] += c * xv;
            }
          }
        }
      }
      const F8 d = load_half8(Rec::scale(rec) + 8 * h);
      F8 m{};
      if constexpr (F == Format::kQ4) m = load_half8(Rec::offset(rec) + 8 * h);
      for (int r = 0; r < R; ++r) {
        F8 total;
        std::memcpy(&total, acc_out[r] + 8 * h, sizeof total);
        total += (t0[r] + t1[r]) * d;
        if constexpr (F == Format::kQ4) total += m * a.xsum[(r0 + r) * G + g];
        std::memcpy(acc_out[r] + 8 * h, &total, sizeof total);
      }
    }
  }
#endif
}

// --- int8 activations: integer dot products ----------------------------------------------

template <Format F, int R>
void block_int8(const Activations& a, int64_t r0, const uint8_t* recs, float (*acc_out)[kLanes]) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  using Rec = Record<F>;
  const int64_t G = a.G, K = a.K;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = Rec::fetch(recs, g);
    // Unsigned code bytes (vpdpbusd's first operand is unsigned): Q4 nibbles as they are,
    // Q8 codes + 128 (xor of the sign bit), corrected below with 128 * sum(x codes).
    __m512i c[8];
    if constexpr (F == Format::kQ4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(rec + j * 64);
        c[j] = _mm512_and_si512(v, nibble);
        c[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    } else {
      for (int j = 0; j < 8; ++j) c[j] = _mm512_xor_si512(_mm512_loadu_si512(rec + j * 64), sign);
    }
    const __m512 d = load_half16(Rec::scale(rec));
    for (int r = 0; r < R; ++r) {
      const int32_t* xd = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * K + g * kGroup);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        s0 = _mm512_dpbusd_epi32(s0, c[j], _mm512_set1_epi32(xd[j]));
        s1 = _mm512_dpbusd_epi32(s1, c[4 + j], _mm512_set1_epi32(xd[4 + j]));
      }
      __m512i s = _mm512_add_epi32(s0, s1);
      if constexpr (F == Format::kQ8)
        s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a.xqsum[(r0 + r) * G + g]));
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.xscale[(r0 + r) * G + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), ds, acc[r]);
      if constexpr (F == Format::kQ4)
        acc[r] = _mm512_fmadd_ps(load_half16(Rec::offset(rec)),
                                 _mm512_set1_ps(a.xsum[(r0 + r) * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc_out[r], acc[r]);
#elif defined(__AVX2__) && defined(__F16C__)
  // Two passes of 8 lanes (bytes 32h..32h+31 of each 64-byte code vector). vpmaddubsw
  // multiplies unsigned code bytes by signed activation bytes into pairs of 16-bit sums:
  // Q4 nibbles as they are (8 pairs of <= 2 * 15 * 127 sum to <= 30,480: no saturation
  // before one vpmaddwd widens them to 32 bits); Q8 as |w| times x with w's sign (each pair
  // <= 2 * 128 * 127: widened at once).
  using Rec = Record<F>;
  const int64_t G = a.G, K = a.K;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kLanes; ++i) acc_out[r][i] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = Rec::fetch(recs, g);
    for (int64_t h = 0; h < 2; ++h) {
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int j = 0; j < Rec::kVectors; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + j * 64 + h * 32));
        if constexpr (F == Format::kQ4) {
          const __m256i lo = _mm256_and_si256(v, nibble);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int r = 0; r < R; ++r) {
            const int32_t* xd = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * K + g * kGroup);
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xd[j])),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xd[4 + j])));
            s[r] = _mm256_add_epi16(s[r], p);  // 16-bit until the end of the group (see above)
          }
        } else {
          const __m256i w = _mm256_abs_epi8(v);
          for (int r = 0; r < R; ++r) {
            const int32_t* xd = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * K + g * kGroup);
            const __m256i p = _mm256_maddubs_epi16(w, _mm256_sign_epi8(_mm256_set1_epi32(xd[j]), v));
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Rec::scale(rec) + 8 * h)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (F == Format::kQ4)
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Rec::offset(rec) + 8 * h)));
      for (int r = 0; r < R; ++r) {
        __m256i dot = s[r];
        if constexpr (F == Format::kQ4) dot = _mm256_madd_epi16(dot, ones);
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a.xscale[(r0 + r) * G + g]));
        __m256 total = _mm256_loadu_ps(acc_out[r] + 8 * h);
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, total);
        if constexpr (F == Format::kQ4)
          total = _mm256_fmadd_ps(m, _mm256_set1_ps(a.xsum[(r0 + r) * G + g]), total);
        _mm256_storeu_ps(acc_out[r] + 8 * h, total);
      }
    }
  }
#else
  TORCH_CHECK(false, "int8 kernel called on a build without an integer dot product");
#endif
}

// --- many rows: a register-blocked int8 GEMM (AVX512-VNNI) ------------------------------
//
// block_int8 above is built for few rows: it streams the weights once and keeps a whole
// record's codes in registers, but every row's activation pointer, broadcast and scale
// costs integer and load work, so at prefill sizes it reached ~1.0 of the ~1.6-2.0 TOP/s
// that torch._int_mm does on this hardware (2-core Zen 5). Here the activations come as
// tiles of kTileRows rows (quant_common.h, prepare_tiles), so one pointer with constant
// offsets reaches every operand, each activation broadcast serves kTileBlocks feature
// blocks and every record's unpacked codes serve kTileRows rows. What bounds it then: per
// 512 multiply-adds (16 features x 32 inputs x 1 row) 8 vpdpbusd and 3 float operations
// (scale product, fma, Q4 offset fma) share the two multiply pipes, ~740 GOP/s per core
// at this machine's clock; one thread measured ~700. Each output lane sees the same
// float operations in the same order as in block_int8, so the two paths give bit-identical
// results and a row's result still does not depend on the batch it came in.
//
// out[r][n0 + 16 * nb + i] = row r of the tile (records `xt`; rows < `rows` stored) times
// feature i of block nb of the NB blocks whose record runs start at w (block nb at
// w + nb * run_bytes); out's rows are out_features apart. Features past out_features (the
// last block's padding) are not stored.
#if defined(PAGEDINFER_INT8_GEMM)
template <Format F, int NB, typename Out>
void tile_int8(int64_t G, const uint8_t* xt, const uint8_t* w, int64_t run_bytes, Out* out,
               int64_t out_features, int rows, int64_t n0) {
  using Rec = Record<F>;
  constexpr int R = kTileRows;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* x = xt + g * kTileRecordBytes;
    const int32_t* xd = reinterpret_cast<const int32_t*>(x);  // row r's codes: xd[8r .. 8r+7]
    const float* xscale = reinterpret_cast<const float*>(x + R * kGroup);
    const float* xsum = xscale + R;
    // Q8: -128 times each row's code sum (prepare_tiles), where its sums start: the codes
    // c + 128 meet x, so sum(c x) = sum((c + 128) x) - 128 sum(x).
    const int32_t* zero = reinterpret_cast<const int32_t*>(xsum + R);
    const uint8_t* rec[NB];
    for (int nb = 0; nb < NB; ++nb) rec[nb] = w + nb * run_bytes + g * Rec::kBytes;
    __m512i s[R][NB];
    for (int r = 0; r < R; ++r)
      for (int nb = 0; nb < NB; ++nb)
        s[r][nb] = F == Format::kQ8 ? _mm512_set1_epi32(zero[r]) : _mm512_setzero_si512();
    if constexpr (F == Format::kQ4) {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[NB], hi[NB];
        for (int nb = 0; nb < NB; ++nb) {
          const __m512i v = _mm512_loadu_si512(rec[nb] + j * 64);
          lo[nb] = _mm512_and_si512(v, nibble);
          hi[nb] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xl = _mm512_set1_epi32(xd[8 * r + j]), xh = _mm512_set1_epi32(xd[8 * r + 4 + j]);
          for (int nb = 0; nb < NB; ++nb) {
            s[r][nb] = _mm512_dpbusd_epi32(s[r][nb], lo[nb], xl);
            s[r][nb] = _mm512_dpbusd_epi32(s[r][nb], hi[nb], xh);
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i c[NB];
        for (int nb = 0; nb < NB; ++nb) c[nb] = _mm512_xor_si512(_mm512_loadu_si512(rec[nb] + j * 64), sign);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_set1_epi32(xd[8 * r + j]);
          for (int nb = 0; nb < NB; ++nb) s[r][nb] = _mm512_dpbusd_epi32(s[r][nb], c[nb], xv);
        }
      }
    }
    for (int nb = 0; nb < NB; ++nb) {
      const __m512 d = load_half16(Rec::scale(rec[nb]));
      for (int r = 0; r < R; ++r) {
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xscale[r]));
        acc[r][nb] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][nb]), ds, acc[r][nb]);
      }
      if constexpr (F == Format::kQ4) {
        const __m512 m = load_half16(Rec::offset(rec[nb]));
        for (int r = 0; r < R; ++r) acc[r][nb] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r]), acc[r][nb]);
      }
    }
  }
  pagedinfer::quant::store_tile<NB>(acc, out, out_features, rows, n0);
}

// out [rows, out_features] = x times the packed blocks, through tiles (run_tiles).
template <Format F>
torch::Tensor run_gemm_int8(const torch::Tensor& x, const uint8_t* packed, int64_t blocks,
                            int64_t out_features) {
  const int64_t G = x.size(1) / kGroup, run_bytes = G * Record<F>::kBytes;
  const std::unique_ptr<uint8_t[]> tiled = pagedinfer::quant::prepare_tiles<false, false, F == Format::kQ8 ? 128 : 0>(x);
  return pagedinfer::quant::run_tiles(
      x, tiled.get(), G * kTileRecordBytes, packed, blocks, run_bytes, out_features,
      [&](auto* o, int nb, const uint8_t* xt, const uint8_t* w, int valid, int64_t n0, bool) {
        if (nb == kTileBlocks) tile_int8<F, kTileBlocks>(G, xt, w, run_bytes, o, out_features, valid, n0);
        else tile_int8<F, 1>(G, xt, w, run_bytes, o, out_features, valid, n0);
      });
}
#endif

template <Format F, bool Int8>
void block(int R, const Activations& a, int64_t r0, const uint8_t* recs, float (*acc_out)[kLanes]) {
#define PAGEDINFER_BLOCK(N)                                              \
  case N:                                                                \
    if constexpr (Int8) return block_int8<F, N>(a, r0, recs, acc_out);   \
    else return block_float<F, N>(a, r0, recs, acc_out);
  switch (R) {
    PAGEDINFER_BLOCK(1)
    PAGEDINFER_BLOCK(2)
    PAGEDINFER_BLOCK(3)
    PAGEDINFER_BLOCK(4)
    PAGEDINFER_BLOCK(5)
    PAGEDINFER_BLOCK(6)
    PAGEDINFER_BLOCK(7)
    default:
      PAGEDINFER_BLOCK(8)
  }
#undef PAGEDINFER_BLOCK
}

torch::Tensor run_quant_linear(const torch::Tensor& x, const torch::Tensor& packed, Format format,
                               int64_t out_features, bool int8_activations) {
  check_activations(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "in_features must be a multiple of 32");
  const int64_t G = K / kGroup, rec_bytes = record_bytes(format);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == G && packed.size(2) == rec_bytes,
              "packed weights must be contiguous uint8 [blocks, in / 32, ", rec_bytes, "]");
  const bool int8 = kInt8Dot && int8_activations;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
#if defined(PAGEDINFER_INT8_GEMM)
  if (int8 && x.size(0) >= kGemmMinRows) {
    if (format == Format::kQ4) return run_gemm_int8<Format::kQ4>(x, pp, packed.size(0), out_features);
    return run_gemm_int8<Format::kQ8>(x, pp, packed.size(0), out_features);
  }
#endif
  std::vector<float> scratch;  // the prepared activations (a few KB at decode sizes)
  const Activations a = prepare_activations(x, int8, scratch);
  return run_blocks(x, packed.size(0), out_features, [&](int R, int64_t r0, int64_t b, float (*acc)[kLanes]) {
    const uint8_t* recs = pp + b * G * rec_bytes;
    if (format == Format::kQ4) {
      if (int8) block<Format::kQ4, true>(R, a, r0, recs, acc);
      else block<Format::kQ4, false>(R, a, r0, recs, acc);
    } else {
      if (int8) block<Format::kQ8, true>(R, a, r0, recs, acc);
      else block<Format::kQ8, false>(R, a, r0, recs, acc);
    }
  });
}

}  // namespace

// y = x @ W.T with W packed by model/quant.py in the "x16" layout above (format 4: Q4
// records, 8: Q8 records). x: [rows, in] float32/bfloat16/float16; returns
// [rows, out_features] in x's dtype. int8_activations: quantise x per group of 32 to int8
// where this build has an integer dot product (else the float path).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t format,
                           int64_t out_features, bool int8_activations) {
  TORCH_CHECK(format == 4 || format == 8, "format must be 4 (Q4) or 8 (Q8)");
  return run_quant_linear(x, packed, format == 4 ? Format::kQ4 : Format::kQ8, out_features,
                          int8_activations);
}

// Whether this build has an integer dot product for int8 activations (AVX512-VNNI, AVX2).
bool quant_linear_uses_int8_activations() { return kInt8Dot; }
