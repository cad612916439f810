// The 256-bit integer policy of linear_gguf_body.h (one row's 32 bytes per ymm), over D, which supplies the byte
// dot and the bit expansion: vpmaddubsw + vpmaddwd on AVX2 (linear_gguf_avx2.cpp), vpdpbusd on AVX512-VNNI
// (linear_gguf_avx512vnni.cpp, for one activation row, where zmm's extra inserts cost more than they save).
// Included inside the ISA's target region. ISA: AVX2 + FMA + F16C (+ what D uses).
#pragma once

#include "common/simd_avx2.h"
#include "linear_gguf/linear_gguf_decode.h"

namespace {
template <class D>
struct G256 {
  using I = __m256i;
  using F = __m256;
  static constexpr int R = 1;                // rows per vector
  static constexpr bool kQ8Offset = D::kQ8Offset;
  // Weight rows per pass over a group, by activation rows: accumulators (and K-quants' int sums) in 16 ymm.
  static constexpr int rows_per_pass(int mt) { return mt == 1 ? 4 : mt == 2 ? 2 : 1; }

  static constexpr int64_t tile_min_rows(int t) { return D::tile_min_rows(t); }
  static constexpr int64_t wide_min_rows(int t) { return D::wide_min_rows(t); }
  using Single = G256;  // the policy of the one-activation-row kernels
  template <class Fn> static I rows(Fn f) { return f(0); }
  template <class Fn> static F rowsf(Fn f) { return _mm256_set1_ps(f(0)); }
  static I xload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I dot(I w, I x) { return D::dot(w, x); }
  static I dot_s8(I w, I x) { return D::dot_s8(w, x); }
  static I dot_sc_acc(I acc, I w, I x, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s));
  }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I izero() { return _mm256_setzero_si256(); }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  static I mask8(int v) { return g_mask8(v); }
  static I srli16_4(I a) { return _mm256_srli_epi16(a, 4); }
  static I slli32_5(I a) { return _mm256_slli_epi32(a, 5); }
  static I shuffle(I a, I idx) { return _mm256_shuffle_epi8(a, idx); }
  static I pick(int c) { return g_pick(c); }
  static I k5_high(I qh, int c) { return g_k5_high(qh, c); }
  static void q6_half(const uint8_t* b, int, int h, I c[4]) { g_q6_half(b, h, c); }
  static __m256i bits_to_0x10(uint32_t qh) { return D::bits_to_0x10(qh); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static float hsum_row(F v, int) { return Avx2::hsum(v); }
  // K-quants' exact block totals (linear_gguf_body.h's dotk). reduce8: lane m = the sum of a[m]'s 8 lanes.
  static int32_t hsum_i(I v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
  }
  static I reduce8(const I* a) {
    const I q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const I q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    // q0's low half: a0..a3 over their lanes 0-3, its high half over lanes 4-7; q1 the same for a4..a7
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
  }
  static I pair(I v, int p) {  // int32 lane p of each half, to the whole half
    switch (p) {
      case 0: return _mm256_shuffle_epi32(v, 0x00);
      case 1: return _mm256_shuffle_epi32(v, 0x55);
      case 2: return _mm256_shuffle_epi32(v, 0xAA);
      default: return _mm256_shuffle_epi32(v, 0xFF);
    }
  }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};
}  // namespace
