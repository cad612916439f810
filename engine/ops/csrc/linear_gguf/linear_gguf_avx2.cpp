// ember::linear_gguf kernels for AVX2 + FMA + F16C (Haswell / Zen 1 on): one row's 32 bytes per ymm, the byte dot
// as vpmaddubsw (unsigned weight codes x int8 activations -> int16 pairs) then vpmaddwd (-> int32, by ones or by
// the sub-block scales). Q8_0's signed codes: their sign moves onto x (vpsignb) so the unsigned operand is |q|.
#include "linear_gguf/linear_gguf.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "common/simd_avx2.h"
#include "linear_gguf/linear_gguf_decode.h"

namespace {
struct GAvx2 {
  using I = __m256i;
  using F = __m256;
  static constexpr int R = 1;                // rows per vector
  static constexpr bool kQ8Offset = false;   // Q8_0 by vpsignb, no offset
  // Weight rows per pass over a group, by activation rows: accumulators (and K-quants' int sums) in 16 ymm.
  static constexpr int rows_per_pass(int mt) { return mt == 1 ? 4 : mt == 2 ? 2 : 1; }

  template <class Fn> static I rows(Fn f) { return f(0); }
  template <class Fn> static F rowsf(Fn f) { return _mm256_set1_ps(f(0)); }
  static I xload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I dot(I w, I x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)); }
  static I dot_s8(I w, I x) { return dot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
  static I dot_sc(I w, I x, I s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s); }
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
  // 32 bits -> 32 bytes, 0x10 where the bit is set: byte j takes qh's byte j / 8, then tests bit j % 8.
  static __m256i bits_to_0x10(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), g_mask8(0x10));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static float hsum_row(F v, int) { return Avx2::hsum(v); }
};
}  // namespace

#include "linear_gguf/linear_gguf_tile.h"

ember::GgufKernel ember::linear_gguf_kernel_avx2(int64_t qtype) { return GgufKernels<GAvx2, Avx2>::make(qtype); }
#pragma GCC pop_options
