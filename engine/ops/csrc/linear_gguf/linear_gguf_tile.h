// ember::linear_gguf's many-rows path (prefill, 16+ rows): each 32-row output block's K-chunk is dequantized once
// into an fp32 [kc, 32] tile and the packed fp32 linear's register-blocked micro-kernel (linear/linear_fma_body.h,
// over the fp32 vector type VF) runs every activation row over it, as linear_q_body.h does. The dequantized values
// equal gguf's (one rounding of exact operands, fused or not), so this path is fp32 linear algebra on the file's
// weights: no activation quantization. Included inside the ISA's target region. ISA: AVX2+FMA+F16C (+VF's).
#pragma once

#include "linear/linear_fma_body.h"
#include "linear_gguf/linear_gguf_body.h"
#include "linear_gguf/linear_gguf_x16.h"

namespace {

// 16 code bytes -> scale * code + base (one rounding: the product is exact), 16 floats.
inline void g_store16(__m128i codes, bool sgn, __m256 scale, __m256 base, float* o) {
  const __m128i hi = _mm_srli_si128(codes, 8);
  const __m256i a = sgn ? _mm256_cvtepi8_epi32(codes) : _mm256_cvtepu8_epi32(codes);
  const __m256i b = sgn ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
  _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), scale, base));
  _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), scale, base));
}
inline void g_store32(__m256i codes, bool sgn, float scale, float base, float* o) {
  const __m256 s = _mm256_set1_ps(scale), b = _mm256_set1_ps(base);
  g_store16(_mm256_castsi256_si128(codes), sgn, s, b, o);
  g_store16(_mm256_extracti128_si256(codes, 1), sgn, s, b, o + 16);
}

// One block's values (32 or 256), as gguf.quants.dequantize computes them.
template <int T, class V>
inline void g_dequant_block(const uint8_t* b, float* o) {
  if constexpr (T == ember::kQ6_K) {
    const float d = g_half(b + 208);
    for (int h = 0; h < 2; ++h) {
      __m256i c[4];
      g_q6_half(b, h, c);
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 2; ++i) {
          const float ds = d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * (4 * h + j) + i]));
          const __m128i part = i ? _mm256_extracti128_si256(c[j], 1) : _mm256_castsi256_si128(c[j]);
          g_store16(part, false, _mm256_set1_ps(ds), _mm256_set1_ps(-32.0f * ds), o + 128 * h + 32 * j + 16 * i);
        }
    }
  } else if constexpr (T == ember::kQ4_K || T == ember::kQ5_K) {
    uint64_t sc, mn;
    g_k_scales(b + 4, sc, mn);
    const float d = g_half(b), dmin = g_half(b + 2);
    const __m256i qh = T == ember::kQ5_K ? g_load256(b + 16) : _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q = g_load256(b + (T == ember::kQ5_K ? 48 : 16) + 32 * j);
      __m256i lo = _mm256_and_si256(q, g_mask8(0x0F)), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), g_mask8(0x0F));
      if constexpr (T == ember::kQ5_K) {
        lo = _mm256_or_si256(lo, g_k5_high(qh, 2 * j));
        hi = _mm256_or_si256(hi, g_k5_high(qh, 2 * j + 1));
      }
      for (int s = 2 * j; s < 2 * j + 2; ++s) {
        const float scale = d * static_cast<float>((sc >> (8 * s)) & 0xFF);
        const float base = -(dmin * static_cast<float>((mn >> (8 * s)) & 0xFF));
        g_store32(s == 2 * j ? lo : hi, false, scale, base, o + 32 * s);
      }
    }
  } else {
    using L = Layout32<T>;
    const float d = g_half(b), base = L::min ? g_half(b + 2) : -static_cast<float>(L::code_offset) * d;
    g_store32(g_decode32<T, V>(b), T == ember::kQ8_0, d, base, o);
  }
}

template <class V, class VF>
struct GgufTile {
  static constexpr int64_t kRows = ember::kGgufBlockRows, kChunk = ember::kGgufTileChunk;

  // out[r * kChunk + i] = W[n0 + r, k0 + i] for i < kc, r < 32 (rows past N: zero).
  template <int T>
  static void dequant_rows(const GgufLinearArgs& a, int64_t n0, int64_t k0, int64_t kc, float* out) {
    const ember::GgufTypeInfo ti = ember::gguf_type_info(T);
    const int64_t row_bytes = a.k / ti.values * ti.bytes;
    uint8_t tmp[256];
    for (int64_t r = 0; r < kRows; ++r) {
      float* o = out + r * kChunk;
      const int64_t n = n0 + r;
      if (n >= a.n) {
        for (int64_t i = 0; i < kc; ++i) o[i] = 0.0f;
        continue;
      }
      for (int64_t b = k0 / ti.values; b < (k0 + kc) / ti.values; ++b)
        g_dequant_block<T, V>(ember::gguf_row_block(T, a.w, row_bytes, n, b, tmp), o + b * ti.values - k0);
    }
  }

  // dst[c * 32 + r] = src[r * kChunk + c] for r < 32, c < kc: 8 x 8 transposes of fp32.
  static void transpose(const float* src, int64_t kc, float* dst) {
    for (int64_t r0 = 0; r0 < kRows; r0 += 8)
      for (int64_t c0 = 0; c0 < kc; c0 += 8) {
        __m256 v[8], t[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(src + (r0 + i) * kChunk + c0);
        for (int i = 0; i < 4; ++i) {  // pairs of rows interleaved
          t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
          t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
        }
        for (int i = 0; i < 2; ++i) {  // quads: columns 4i'.. of rows 4i..4i+3 per 128-bit half
          v[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
          v[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
          v[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
          v[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
        }
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(dst + (c0 + i) * kRows + r0, _mm256_permute2f128_ps(v[i], v[4 + i], 0x20));
          _mm256_storeu_ps(dst + (c0 + 4 + i) * kRows + r0, _mm256_permute2f128_ps(v[i], v[4 + i], 0x31));
        }
      }
  }

  template <int T>
  static void run_block_tile(const GgufLinearArgs& a, int64_t block, float* scratch) {
    using Fma = LinearBody<VF>;
    const int64_t k = a.k, n0 = block * kRows, nr = g_min64(kRows, a.n - n0);
    float* tile = scratch;                 // [kChunk, 32]
    float* rows = tile + kChunk * kRows;   // [32, kChunk]
    float* acc = rows + kRows * kChunk;    // [a.rows, 32]
    for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
      const int64_t kc = g_min64(kChunk, k - k0);  // a multiple of the block size
      dequant_rows<T>(a, n0, k0, kc, rows);
      transpose(rows, kc, tile);
      for (int64_t m0 = 0; m0 < a.rows; m0 += Fma::kTileRows) {
        const int64_t mr = g_min64(Fma::kTileRows, a.rows - m0);
        Fma::template tile_for<Fma::kTileRows>(mr)(a.xf + m0 * k + k0, k, tile, kc, acc + m0 * kRows, k0 == 0);
      }
    }
    for (int64_t m = 0; m < a.rows; ++m)
      for (int64_t c = 0; c < nr; ++c) g_store(a, m * a.n + n0 + c, acc[m * kRows + c]);
  }
};

// The kernel of type `qtype` for integer policy V, 16-row policy X (linear_gguf_x16.h) and fp32 vectors VF;
// lane_offset as GgufActs::off documents (a 16-row kernel's lane is a whole row: the whole offset).
template <class V, class VF, class X>
struct GgufKernels {
  template <int T>
  static ember::GgufKernel entry() {
    constexpr bool x16 = ember::gguf_x16(T);
    constexpr int lane = x16 ? (T == ember::kQ4_0 ? 8 : T == ember::kQ8_0 && X::kQ8Offset ? 128 : 0)
                             : T == ember::kQ5_0 ? 2 : 0;
    constexpr bool kq = T == ember::kQ4_K || T == ember::kQ5_K || T == ember::kQ6_K;
    ember::GgufKernel out{x16 ? X16Body<X>::template run_block<T> : GgufBody<V>::template run_block<T>,
                          GgufTile<V, VF>::template run_block_tile<T>, lane, V::tile_min_rows(T)};
    if constexpr (kq && V::R == 1 && !x16) {  // the wide path: K-quants on the 256-bit policy (AVX2)
      out.run_block_wide = GgufBody<V>::template run_block<T, true>;
      out.wide_min_rows = V::wide_min_rows(T);
    }
    return out;
  }
  static ember::GgufKernel make(int64_t qtype) {
    switch (qtype) {
      case ember::kQ4_0: return entry<ember::kQ4_0>();
      case ember::kQ4_1: return entry<ember::kQ4_1>();
      case ember::kQ5_0: return entry<ember::kQ5_0>();
      case ember::kQ5_1: return entry<ember::kQ5_1>();
      case ember::kQ8_0: return entry<ember::kQ8_0>();
      case ember::kQ4_K: return entry<ember::kQ4_K>();
      case ember::kQ5_K: return entry<ember::kQ5_K>();
      default: return entry<ember::kQ6_K>();  // the driver checked the type
    }
  }
};

}  // namespace
