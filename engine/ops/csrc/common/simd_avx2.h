// 8-lane fp32 vector operations the kernel bodies are written over (linear/*_body.h, attention/*_body.h).
// ISA: AVX2 + FMA + F16C. Include only inside a `#pragma GCC target("avx2,fma,f16c")` region, after every
// standard and ATen header (their inline functions must not be compiled for this ISA).
#pragma once

#include <immintrin.h>
#include <cstdint>

#include "common/dtypes.h"

namespace {

struct Avx2 {
  using F = __m256;
  static constexpr int W = 8;           // fp32 lanes
  static constexpr int kRegisters = 16;  // ymm0-15

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const Bf16* p) {  // bf16 -> fp32 is a 16-bit left shift of the raw bits
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static F load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load(const int8_t* p) {  // 8 int8 -> fp32 (the int8 KV cache)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F load(const Fp8E4M3* p) {  // 8 fp8 e4m3 -> fp32: as fp16 bits, see Avx512::load(const Fp8E4M3*)
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F le_select(F a, F b, F x, F y) {  // per lane: a <= b ? x : y
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LE_OQ));
  }

  // W packed (column, input pair) bf16 values, 2W uint16, as fp32: `even` holds the first input of each pair.
  static void load_pairs(const uint16_t* p, F& even, F& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  // The first n (<= W) lanes as bf16, rounded to nearest even as torch rounds.
  static void store_bf16(uint16_t* out, F v, int n) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // lanes 0-7 in the low half
    const __m128i lo = _mm256_castsi256_si128(packed);
    if (n >= W) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), lo);
      return;
    }
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), lo);
    for (int i = 0; i < n; ++i) out[i] = tmp[i];
  }

  // v rounded to bf16 (nearest even, as torch rounds) and widened back: the value a bf16 tensor would hold.
  static F round_bf16(F v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  // Lanes >= n replaced by `fill`.
  static F first_n(F v, int64_t n, F fill) {
    if (n >= W) return v;
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx));
    return _mm256_blendv_ps(fill, v, keep);
  }

  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // Lane j of the result = the sum of all lanes of v[j] (W dot products finished by one transposing add tree).
  static F reduce_lanes(const F* v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // per 128-bit half: sums of v0..v3, v4..v7
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
  }

  // e^x for x <= 0: 2^n * 2^f, n = round(x log2 e), |f| <= 1/2, 2^f by its degree-7 Taylor series (< 1e-7 relative).
  static F exp(F x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    const __m256 p = taylor_exp(f);
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
  }
  static F taylor_exp(F f) {
    F p = set1(1.0f / 5040);
    p = fma(p, f, set1(1.0f / 720));
    p = fma(p, f, set1(1.0f / 120));
    p = fma(p, f, set1(1.0f / 24));
    p = fma(p, f, set1(1.0f / 6));
    p = fma(p, f, set1(0.5f));
    p = fma(p, f, set1(1.0f));
    p = fma(p, f, set1(1.0f));
    return p;
  }
};

}  // namespace
