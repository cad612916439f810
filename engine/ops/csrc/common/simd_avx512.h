// 16-lane fp32 vector operations the kernel bodies are written over (linear/*_body.h, attention/*_body.h).
// ISA: AVX-512 F + BW + VL + DQ. Include only inside a matching `#pragma GCC target` region, after every standard
// and ATen header (their inline functions must not be compiled for this ISA).
#pragma once

#include <immintrin.h>
#include <cstdint>

#include "common/dtypes.h"

namespace {

struct Avx512 {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int kRegisters = 32;  // zmm0-31

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const Bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static F load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F load(const int8_t* p) {  // 16 int8 -> fp32 (the int8 KV cache)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // 16 fp8 e4m3 -> fp32 (the fp8 KV cache). Sign to bit 15 and exponent + mantissa to bits 7..13 make an fp16 of
  // value x * 2^-8 (fp16's exponent bias is 8 more than e4m3's), subnormals included (fp16 has them too, and F16C
  // converts them exactly), so one conversion and a multiply by 2^8 give x. The sign gets there by sign-extending
  // the byte and shifting it left by 7: its copies land in bits 14 and 15, and bit 14 (fp16's top exponent bit, 0 for
  // every e4m3 value) is cleared. (e4m3fn's NaN 0x7F is never written.)
  static F load(const Fp8E4M3* p) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F le_select(F a, F b, F x, F y) {  // per lane: a <= b ? x : y
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), y, x);
  }

  static void load_pairs(const uint16_t* p, F& even, F& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  static void store_bf16(uint16_t* out, F v, int n) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 mask = n >= W ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(r));
  }

  // v rounded to bf16 (nearest even, as torch rounds) and widened back: the value a bf16 tensor would hold.
  static F round_bf16(F v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  static F first_n(F v, int64_t n, F fill) {
    if (n >= W) return v;
    return _mm512_mask_mov_ps(fill, __mmask16((1u << n) - 1), v);
  }

  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }

  // Lane j of the result = the sum of all 16 lanes of v[j]: 15 shuffle+add pairs instead of 16 reductions.
  static F reduce_lanes(const F* v) {
    __m512 r[8], s[4], w[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
      r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of rows 4i .. 4i+3
      s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; ++i)
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }

  static F exp(F x) {  // as Avx2::exp, with a rounding instruction and scalef for the 2^n
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    F p = set1(1.0f / 5040);
    p = fma(p, f, set1(1.0f / 720));
    p = fma(p, f, set1(1.0f / 120));
    p = fma(p, f, set1(1.0f / 24));
    p = fma(p, f, set1(1.0f / 6));
    p = fma(p, f, set1(0.5f));
    p = fma(p, f, set1(1.0f));
    p = fma(p, f, set1(1.0f));
    return _mm512_scalef_ps(p, n);
  }
};

}  // namespace
