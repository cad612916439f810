// ember::linear_gguf kernels for AVX512-VNNI (+BW/VL/DQ: Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 on), on
// 512-bit registers: two rows' 32 bytes per zmm (rows r, r+1 of a group are adjacent blocks in the stream), the
// byte dot of 32-value types one vpdpbusd, Q8_0 made unsigned (codes + 128, the 128 sum(x) taken off per lane:
// lane_offset 16), K-quants' sub-scaled dots vpmaddubsw + vpdpwssd (the scale's multiply and the accumulate in one).
#include "linear_gguf/linear_gguf.h"

#include <immintrin.h>

#pragma GCC push_options
// AMX-TILE and AMX-INT8 for linear_gguf_amx8.h only (the compiler emits tile instructions only from intrinsics).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

#include "common/simd_avx512.h"
#include "linear_gguf/linear_gguf_policy256.h"

namespace {
struct VnniDot {  // vpdpbusd on ymm; Q8_0 made unsigned (codes + 128), the 128 sum(x) off through lane_offset
  static constexpr bool kQ8Offset = true;
  static constexpr int64_t tile_min_rows(int) { return 0; }  // unused: GAvx512's decides
  static __m256i dot(__m256i w, __m256i x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x); }
  static __m256i dot_s8(__m256i w, __m256i x) { return dot(_mm256_xor_si256(w, g_mask8(0x80)), x); }
  static __m256i bits_to_0x10(uint32_t qh) { return _mm256_maskz_mov_epi8(qh, g_mask8(0x10)); }
};

struct GAvx512 {
  using Single = G256<VnniDot>;
  using I = __m512i;
  using F = __m512;
  static constexpr int R = 2;
  static constexpr bool kQ8Offset = true;
  static constexpr int rows_per_pass(int mt) { return mt <= 4 ? 4 : 2; }  // of 32 zmm
  // Integer dots until the fp32 tile path catches up. Measured on the AMX Xeon, Llama-1B shapes (q/o, k/v,
  // gate+up, down), GFLOP/s int8 vs tile over a layer. 1 thread (the other core was busy): Q4_K 146/50 at 16 rows,
  // 153/84 at 32, 158/106 at 64; Q8_0 118/88 at 32, 122/115 at 64; Q4_0 119/82 at 32, 120/126 at 64. 2 threads
  // (scripts/bench_linear.py --paths int8 tile): Q4_K 308/227 at 128, 298/291 at 256, 287/269 at 512, 276/283 at
  // 1024; Q6_K 256/228 at 128, 284/255 at 256, 267/271 at 512, 269/270 at 1024. With vpdpwssd folding the K-quants'
  // accumulate (2026-12-03): Q4_K 369/333 at 512, 346/317 at 1024; Q6_K 361/335 at 512, 347/300 at 1024. The
  // 16-row layout (2026-12-05): Q4_0 557/213 at 64, 550/290 at 256; Q8_0 508/218 at 64, 559/283 at 256. So
  // K-quants and the 16-row types never take the tile here; Q5_0 / Q5_1 from 64.
  static constexpr int64_t tile_min_rows(int t) {
    return t == ember::kQ5_0 || t == ember::kQ5_1 ? 64 : int64_t{1} << 40;
  }

  static I cat(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
  template <class Fn> static I rows(Fn f) { return cat(f(0), f(1)); }
  template <class Fn> static F rowsf(Fn f) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(f(0))), _mm256_set1_ps(f(1)), 1);
  }
  static I xload(const int8_t* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I dot(I w, I x) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x); }
  static I dot_s8(I w, I x) { return dot(_mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))), x); }
  static I dot_sc_acc(I acc, I w, I x, I s) { return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w, x), s); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I izero() { return _mm512_setzero_si512(); }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static I mask8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I srli16_4(I a) { return _mm512_srli_epi16(a, 4); }
  static I slli32_5(I a) { return _mm512_slli_epi32(a, 5); }
  static I shuffle(I a, I idx) { return _mm512_shuffle_epi8(a, idx); }
  static I pick(int c) { return _mm512_set1_epi16(static_cast<short>((2 * c + 1) << 8 | (2 * c))); }
  static I k5_high(I qh, int c) {
    const I s = c <= 4 ? _mm512_slli_epi16(qh, 4 - c) : _mm512_srli_epi16(qh, c - 4);
    return _mm512_and_si512(s, mask8(0x10));
  }
  static void q6_half(const uint8_t* b, int bb, int h, I c[4]) {
    __m256i r0[4], r1[4];
    g_q6_half(b, h, r0);
    g_q6_half(b + bb, h, r1);
    for (int j = 0; j < 4; ++j) c[j] = cat(r0[j], r1[j]);
  }
  static __m256i bits_to_0x10(uint32_t qh) { return _mm256_maskz_mov_epi8(qh, g_mask8(0x10)); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static float hsum_row(F v, int r) {
    const __m256 h = r ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};

struct X16Avx512 : GAvx512 {  // 16 rows a zmm, GAvx512's arithmetic; Q8_0 made unsigned (codes + 128)
  static constexpr int L = 16;
  static constexpr bool kPairSums = false;  // vpdpbusd sums 4 products a lane in one
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I add8(I a, I b) { return _mm512_add_epi8(a, b); }
  static I lane_base() {
    const __m128i b = _mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C);
    return _mm512_broadcast_i32x4(b);
  }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I srai16(I a, int n) { return _mm512_srai_epi16(a, n); }
  static I srai32(I a, int n) { return _mm512_srai_epi32(a, n); }
  static I slli32(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I q8(I w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static I dot(I acc, I w, uint32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(static_cast<int>(x4))); }
  static I dot8(I acc, I w, uint32_t x4) { return dot(acc, w, x4); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  // out[at .. at + 16) = v[0 .. 16), rounded to bf16 as bf16_bits does where out is bf16.
  static void store_out(const ember::GgufLinearArgs& a, int64_t at, const float* v) {
    const __m512 y = _mm512_loadu_ps(v);
    if (!a.out_bf16) return _mm512_storeu_ps(static_cast<float*>(a.out) + at, y);
    const __m512i u = _mm512_castps_si512(y);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.out) + at), _mm512_cvtepi32_epi16(r));
  }
};
}  // namespace

#include "linear_gguf/linear_gguf_tile.h"

ember::GgufKernel ember::linear_gguf_kernel_avx512vnni(int64_t qtype) {
  return GgufKernels<GAvx512, Avx512, X16Avx512>::make(qtype);
}

#include "linear_gguf/linear_gguf_amx8.h"

ember::GgufBlockFn ember::linear_gguf_amx8_block(int64_t qtype) {
  using A = X16Amx8<X16Avx512>;
  switch (qtype) {
    case kQ4_0: return A::run_block<kQ4_0>;
    case kQ4_1: return A::run_block<kQ4_1>;
    case kQ8_0: return A::run_block<kQ8_0>;
    case kQ4_K: return A::run_block_q4k;
    default: return nullptr;
  }
}
#pragma GCC pop_options
