// ember::linear_q's kernels over 256-bit int16 dot products, written once over a policy P whose dot(a, b) multiplies
// 16 int16 pairs into 8 int32 lanes (lane i = a[2i] b[2i] + a[2i+1] b[2i+1]) and dot2 adds two such:
//   AVX2 (linear_q_avx2.cpp):          vpmaddwd (and vpaddd)
//   AVX512-VNNI (linear_q_avx512vnni): vpdpwssd, accumulating
// Weights (4-bit 0..15 or int8) widen to int16 in registers; activations are int16 per 32 (linear_q.h). No sum can
// overflow: 4 products of at most 128 * 32767 per lane per block.
// Included inside the ISA's target region, after every standard header; everything here has internal linkage
// (see linear_fma_body.h for why no std:: templates).
//
// Per output row n and up to kRowTile activation rows: for each block of 32 inputs, widen the weights once (4-bit:
// a shuffle, a mask and a shift; 8-bit: two sign-extensions), then per activation row two int16 dots, one int ->
// float conversion and one multiply-add by s[n, b] * xd[m, b]. Rows come in the interleaved groups of 4 of
// linear_q.h, so each thread reads one sequential stream; a group (1-2 KiB) stays in L1 while the activation row
// tiles pass over it, and activations stay in L1/L2.
#pragma once

#include "common/dtypes.h"
#include "linear/linear_fma_body.h"
#include "linear_q/linear_q.h"

namespace {

using ember::kQBlockRows;
using ember::QLayout;
using ember::QLinearArgs;
using ember::QLinearKernel;

constexpr int kRowTile = 8;  // activation rows per pass: 8 accumulators + 2 weight vectors + temporaries in 16 ymm

inline int64_t qmin64(int64_t a, int64_t b) { return a < b ? a : b; }


inline float q_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A row's block of 32 weights widened to int16: values 0-15 in lo, 16-31 in hi. 4-bit: the 16 bytes in both
// lanes, byte i shuffled into int16 lane i (high byte zero), then its two nibbles: no lane crossing.
template <bool Q4>
inline void unpack_block(const uint8_t* wb, __m256i& lo, __m256i& hi) {
  if constexpr (Q4) {
    const __m256i spread = _mm256_setr_epi8(0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1,
                                            8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1);
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));
    const __m256i bytes = _mm256_shuffle_epi8(raw, spread);
    lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(bytes, 4);  // the int16's high byte is zero: this is the high nibble
  } else {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16)));
  }
}

template <class P, class V>
struct QLinearBody {
  // res[r * MT + m] = sum over blocks of s_r(b) * xd[m, b] * <q_r, xq[m]> for NR rows r0.. of one 4-row group
  // (linear_q.h: the group's blocks interleave its rows, bpb bytes each; its scales interleave likewise, one per
  // `rep` blocks of 32, G16: two per block). NR = 4 at one or two activation rows, where one chain of dependent
  // multiply-adds per row would bound the loop by FMA latency; NR = 1 above (registers), rows taken in turn.
  template <int MT, int NR, bool Q4, bool G16>
  static void dot_rows(const uint8_t* w, const float* s, int64_t r0, int64_t rep, const int16_t* xq,
                       const float* xd, int64_t k, float* res) {
    constexpr int64_t bpb = Q4 ? 16 : 32;  // bytes per row per block
    const int64_t nb = k / 32;
    __m256 acc[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    int64_t g = 0, left = rep;  // the weight group of block b, without a division (idiv costs ~40 cycles)
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < NR; ++r) {
        __m256i lo, hi;  // values 0-15 and 16-31 as int16
        unpack_block<Q4>(w + (4 * b + r0 + r) * bpb, lo, hi);
        const __m256 s0 = _mm256_broadcast_ss(s + 4 * (G16 ? 2 * b : g) + r0 + r);
        const __m256 s1 = G16 ? _mm256_broadcast_ss(s + 4 * (2 * b + 1) + r0 + r) : s0;
        for (int m = 0; m < MT; ++m) {
          const int16_t* x = xq + m * k + 32 * b;
          const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
          const __m256 d = _mm256_set1_ps(xd[m * nb + b]);
          if constexpr (G16) {  // one scale per 16 values: each half on its own
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P::dot(lo, xlo)), _mm256_mul_ps(s0, d), acc[r][m]);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P::dot(hi, xhi)), _mm256_mul_ps(s1, d), acc[r][m]);
          } else {
            const __m256 p = _mm256_cvtepi32_ps(P::dot2(lo, xlo, hi, xhi));
            acc[r][m] = _mm256_fmadd_ps(p, _mm256_mul_ps(s0, d), acc[r][m]);
          }
        }
      }
      if (--left == 0) {
        left = rep;
        ++g;
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) res[r * MT + m] = q_hsum(acc[r][m]);
  }

  using DotFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, const int16_t*, const float*, int64_t,
                         float*);

  static constexpr int rows_for(int mt) { return mt <= 2 ? 4 : 1; }

  template <int MT, bool Q4, bool G16>
  static DotFn dot_for(int64_t mt) {
    if constexpr (MT == 1) return dot_rows<1, rows_for(1), Q4, G16>;
    else return mt == MT ? dot_rows<MT, rows_for(MT), Q4, G16> : dot_for<MT - 1, Q4, G16>(mt);
  }

  // fp16 -> fp32, 8 per conversion.
  static void widen(const uint16_t* src, int64_t count, float* dst) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < count; ++i) dst[i] = _cvtsh_ss(src[i]);
  }

  // The 4 rows' sum_g mins[g] * xs[g] at once: a group's 4 interleaved mins are one 4-float vector.
  template <bool F16>
  static __m128 min_dots(const void* mins, const float* xs, int64_t groups) {
    __m128 acc = _mm_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m128 mv = F16 ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                                  static_cast<const uint16_t*>(mins) + 4 * g)))
                            : _mm_loadu_ps(static_cast<const float*>(mins) + 4 * g);
      acc = _mm_fmadd_ps(mv, _mm_set1_ps(xs[g]), acc);
    }
    return acc;
  }

  template <bool Q4, bool F16, bool MIN, bool G16>
  static void run_block(const QLinearArgs& a, int64_t block, float* scratch) {
    const int64_t k = a.k, nb = k / 32, n0 = block * kQBlockRows, n1 = qmin64(n0 + kQBlockRows, a.n);
    const int64_t groups = k / a.layout.group, rep = G16 ? 1 : a.layout.group / 32, row_bytes = Q4 ? k / 2 : k;
    const int64_t g0 = n0 / 4, g1 = (n1 + 3) / 4;  // 4-row groups of this block (the last may be padding)
    // Group i's scales at scales + 4 * groups * i: fp32 as stored, or fp16 widened once for the block.
    const float* scales = static_cast<const float*>(a.scales);
    if constexpr (F16) {
      widen(static_cast<const uint16_t*>(a.scales) + g0 * 4 * groups, (g1 - g0) * 4 * groups, scratch);
      scales = scratch - g0 * 4 * groups;  // indexed from g0 on only
    }
    float res[4 * kRowTile];
    alignas(16) float mins4[4];
    for (int64_t m0 = 0; m0 < a.rows; m0 += kRowTile) {
      const int64_t mt = qmin64(kRowTile, a.rows - m0), nr = rows_for(static_cast<int>(mt));
      const DotFn dot = dot_for<kRowTile, Q4, G16>(mt);
      for (int64_t gi = g0; gi < g1; ++gi) {
        const uint8_t* w = a.w + gi * 4 * row_bytes;
        const float* s = scales + gi * 4 * groups;
        for (int64_t r0 = 0; r0 < 4; r0 += nr) dot(w, s, r0, rep, a.xq + m0 * k, a.xd + m0 * nb, k, res + r0 * mt);
        for (int64_t m = 0; m < mt; ++m) {
          if constexpr (MIN) {
            const int64_t msize = F16 ? 2 : 4;
            const void* mg = static_cast<const char*>(a.mins) + gi * 4 * groups * msize;
            _mm_store_ps(mins4, min_dots<F16>(mg, a.xs + (m0 + m) * groups, groups));
          }
          for (int64_t r = 0; r < 4 && gi * 4 + r < n1; ++r) {
            float y = res[r * mt + m];
            if constexpr (MIN) y += mins4[r];
            const int64_t at = (m0 + m) * a.n + gi * 4 + r;
            if (a.out_bf16) static_cast<uint16_t*>(a.out)[at] = bf16_bits(y);
            else static_cast<float*>(a.out)[at] = y;
          }
        }
      }
    }
  }

  // ---- many rows (prefill): dequantize a block's 32 rows once per K-chunk into an fp32 [kc, 32] tile and run
  // the packed fp32 linear's register-blocked micro-kernel (linear_fma_body.h) over every row on fp32 activations.
  // Measured against the integer path at 128 rows (AVX2): ~2.5x, as it does 32 fp32 FMAs per 8 loaded values
  // where the integer path converts and scales every block of every row.

  // out[r * ldo + i] = W[n0 + r, k0 + i] for i < kc, r < 32 (rows past N: zero).
  template <bool Q4, bool F16, bool MIN, bool G16>
  static void dequant_rows(const QLinearArgs& a, int64_t n0, int64_t k0, int64_t kc, float* out, int64_t ldo) {
    constexpr int64_t bpb = Q4 ? 16 : 32;
    const int64_t k = a.k, groups = k / a.layout.group, row_bytes = Q4 ? k / 2 : k;
    for (int64_t r = 0; r < kQBlockRows; ++r) {
      const int64_t n = n0 + r;
      float* o = out + r * ldo;
      if (n >= a.n) {
        for (int64_t i = 0; i < kc; ++i) o[i] = 0.0f;
        continue;
      }
      const uint8_t* w = a.w + (n / 4) * 4 * row_bytes;
      const int64_t rr = n % 4, sg = (n / 4) * 4 * groups;
      for (int64_t b = k0 / 32; b < (k0 + kc) / 32; ++b) {
        __m256i lo, hi;
        unpack_block<Q4>(w + (4 * b + rr) * bpb, lo, hi);
        const int64_t g_lo = G16 ? 2 * b : 32 * b / a.layout.group, g_hi = G16 ? 2 * b + 1 : g_lo;
        const __m256 s_lo = _mm256_set1_ps(scale_at<F16>(a.scales, sg + 4 * g_lo + rr));
        const __m256 s_hi = _mm256_set1_ps(scale_at<F16>(a.scales, sg + 4 * g_hi + rr));
        const __m256 m = _mm256_set1_ps(MIN ? scale_at<F16>(a.mins, sg + 4 * g_lo + rr) : 0.0f);
        float* ob = o + 32 * b - k0;
        const __m256i parts[4] = {lo, lo, hi, hi};
        for (int j = 0; j < 4; ++j) {
          const __m128i half = (j & 1) ? _mm256_extracti128_si256(parts[j], 1) : _mm256_castsi256_si128(parts[j]);
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(half));
          _mm256_storeu_ps(ob + 8 * j, _mm256_fmadd_ps(v, j < 2 ? s_lo : s_hi, m));
        }
      }
    }
  }

  template <bool F16>
  static float scale_at(const void* p, int64_t i) {
    if constexpr (F16) return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
    else return static_cast<const float*>(p)[i];
  }

  // dst[c * 32 + r] = src[r * lds + c] for r < 32, c < kc (kc a multiple of 8): 8 x 8 transposes.
  static void transpose_to_tile(const float* src, int64_t lds, int64_t kc, float* dst) {
    for (int64_t r0 = 0; r0 < kQBlockRows; r0 += 8)
      for (int64_t c0 = 0; c0 < kc; c0 += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(src + (r0 + i) * lds + c0);
        const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
        const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
        const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
        const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        const __m256 o[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                             _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                             _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                             _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (c0 + i) * kQBlockRows + r0, o[i]);
      }
  }

  template <bool Q4, bool F16, bool MIN, bool G16>
  static void run_block_tile(const QLinearArgs& a, int64_t block, float* scratch) {
    using Fma = LinearBody<V>;
    const int64_t k = a.k, n0 = block * kQBlockRows, nr = qmin64(kQBlockRows, a.n - n0);
    float* tile = scratch;                              // [kQTileChunk, 32]
    float* rows = tile + ember::kQTileChunk * kQBlockRows;  // [32, kQTileChunk]
    float* acc = rows + kQBlockRows * ember::kQTileChunk;   // [a.rows, 32]
    for (int64_t k0 = 0; k0 < k; k0 += ember::kQTileChunk) {
      const int64_t kc = qmin64(ember::kQTileChunk, k - k0);  // a multiple of 32
      dequant_rows<Q4, F16, MIN, G16>(a, n0, k0, kc, rows, ember::kQTileChunk);
      transpose_to_tile(rows, ember::kQTileChunk, kc, tile);
      for (int64_t m0 = 0; m0 < a.rows; m0 += Fma::kTileRows) {
        const int64_t mr = qmin64(Fma::kTileRows, a.rows - m0);
        Fma::template tile_for<Fma::kTileRows>(mr)(a.xf + m0 * k + k0, k, tile, kc, acc + m0 * kQBlockRows, k0 == 0);
      }
    }
    for (int64_t m = 0; m < a.rows; ++m)
      for (int64_t c = 0; c < nr; ++c) {
        const float y = acc[m * kQBlockRows + c];
        const int64_t at = m * a.n + n0 + c;
        if (a.out_bf16) static_cast<uint16_t*>(a.out)[at] = bf16_bits(y);
        else static_cast<float*>(a.out)[at] = y;
      }
  }

  // 32 fp32 values (8 per vector) -> int16 with one scale; returns the sum of the int16 values.
  static int32_t quantize_block(const __m256 v[4], int16_t* q, float* d_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / ember::kQActMax;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // nearest even (MXCSR default)
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    // packs works per 128-bit lane: the 64-bit quarters come out as 0, 2, 1, 3 of the wanted order
    for (int j = 0; j < 2; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * j),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2 * j], i[2 * j + 1]), 0xD8));
    *d_out = d;
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
  }

  static void quantize(const float* xf, const uint16_t* xb, int64_t rows, int64_t k, int16_t* xq, float* xd,
                       float* xs) {
    const int64_t nb = k / 32;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        __m256 v[4];
        for (int j = 0; j < 4; ++j) {
          const int64_t at = r * k + 32 * b + 8 * j;
          if (xf != nullptr) {
            v[j] = _mm256_loadu_ps(xf + at);
          } else {  // bf16 -> fp32 is a 16-bit left shift of the raw bits
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + at));
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
          }
        }
        float d;
        const int32_t sum = quantize_block(v, xq + r * k + 32 * b, &d);
        xd[r * nb + b] = d;
        xs[r * nb + b] = d * static_cast<float>(sum);
      }
  }

  template <bool Q4, bool F16, bool MIN, bool G16>
  static QLinearKernel make() {
    return {run_block<Q4, F16, MIN, G16>, quantize, run_block_tile<Q4, F16, MIN, G16>};
  }

  static QLinearKernel kernel(const QLayout& l) {
    if (l.bits == 4)
      return l.f16_scales ? (l.has_min ? make<true, true, true, false>() : make<true, true, false, false>())
                          : (l.has_min ? make<true, false, true, false>() : make<true, false, false, false>());
    if (l.group == 16)  // per-16 groups carry no mins (the driver refuses them)
      return l.f16_scales ? make<false, true, false, true>() : make<false, false, false, true>();
    return l.f16_scales ? (l.has_min ? make<false, true, true, false>() : make<false, true, false, false>())
                        : (l.has_min ? make<false, false, true, false>() : make<false, false, false, false>());
  }
};

}  // namespace
