// ember::linear_gguf kernels for AVX2 + FMA + F16C (Haswell / Zen 1 on): one row's 32 bytes per ymm, the byte dot
// as vpmaddubsw (unsigned weight codes x int8 activations -> int16 pairs) then vpmaddwd (-> int32, by ones or by
// the sub-block scales). Q8_0's signed codes: their sign moves onto x (vpsignb) so the unsigned operand is |q|.
#include "linear_gguf/linear_gguf.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "linear_gguf/linear_gguf_policy256.h"

namespace {
struct MaddDot {  // vpmaddubsw then vpmaddwd by ones; Q8_0's sign moved onto x (vpsignb): |q| x sign(q) x
  static constexpr bool kQ8Offset = false;
  // Integer dots until the fp32 tile path catches up. Measured on the AMX Xeon with this variant forced, Llama-1B
  // shapes, GFLOP/s int8 vs tile over a layer. 1 thread: Q8_0 76/55 at 48, 77/82 at 64; Q4_0 76/49 at 32, 77/82 at
  // 64. 2 threads (scripts/bench_linear.py --paths int8 tile): Q4_K 186/158 at 128, 206/169 at 256, 181/177 at 512,
  // 178/168 at 1024; Q6_K 185/120 at 128, 187/179 at 256, 177/172 at 512, 176/181 at 1024. The 16-row layout
  // (2026-12-05): Q4_0 286/144 at 64, 280/191 at 256; Q8_0 216/113 at 64, 215/130 at 256. So the K-quants stay on
  // integers through any prefill chunk (the tile never won by more than the noise), and so do the 16-row types;
  // Q5_0 / Q5_1 go to the tile from 64.
  static constexpr int64_t tile_min_rows(int t) {
    return t == ember::kQ4_K || t == ember::kQ5_K || t == ember::kQ6_K ? 1024
         : t == ember::kQ5_0 || t == ember::kQ5_1 ? 64 : int64_t{1} << 40;
  }
  // K-quants' wide path (8 rows in the float lanes, linear_gguf_body.h's dotk), measured on an AVX2-only EPYC, 2
  // threads, GFLOP/s int8 vs wide (scripts/bench_linear.py --paths int8 wide): Q4_K 188/219 at 32, 184/216 at 64,
  // 195/224 at 128, 192/201 at 512; Q6_K 170/172 at 32, 179/182 at 128, 181/187 at 512. From 64 rows, as the tile
  // path of the 32-value types: decode batches below that keep the int8 path's rounding.
  static constexpr int64_t wide_min_rows(int) { return 64; }
  static __m256i dot(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  }
  static __m256i dot_s8(__m256i w, __m256i x) { return dot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
  // 32 bits -> 32 bytes, 0x10 where the bit is set: byte j takes qh's byte j / 8, then tests bit j % 8.
  static __m256i bits_to_0x10(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), g_mask8(0x10));
  }
};
using GAvx2 = G256<MaddDot>;

// 8 rows a ymm (a group is two), GAvx2's arithmetic; Q8_0 dotted signed, its sign moved onto x (vpsignb).
struct X16Avx2 : GAvx2 {
  static constexpr int L = 8;
  static constexpr bool kPairSums = true;
  static I add8(I a, I b) { return _mm256_add_epi8(a, b); }
  static I lane_base() {  // 4 l in every byte of 32-bit lane l of each 128-bit half (vpshufb indexes per half)
    return _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C);
  }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I srai16(I a, int n) { return _mm256_srai_epi16(a, n); }
  static I srai32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I slli32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I pairs(I w, uint32_t x4) { return _mm256_maddubs_epi16(w, _mm256_set1_epi32(static_cast<int>(x4))); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen(I p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
  static I load(const uint8_t* p) { return g_load256(p); }
  static F half(const uint8_t* p) { return _mm256_cvtph_ps(g_load128(p)); }
  static I q8(I w) { return w; }
  static I dot(I acc, I w, uint32_t x4) { return add(acc, MaddDot::dot(w, _mm256_set1_epi32(static_cast<int>(x4)))); }
  static I dot8(I acc, I w, uint32_t x4) {
    return add(acc, MaddDot::dot_s8(w, _mm256_set1_epi32(static_cast<int>(x4))));
  }
  // out[at .. at + 8) = v[0 .. 8), rounded to bf16 as bf16_bits does where out is bf16.
  static void store_out(const ember::GgufLinearArgs& a, int64_t at, const float* v) {
    const __m256 y = _mm256_loadu_ps(v);
    if (!a.out_bf16) return _mm256_storeu_ps(static_cast<float*>(a.out) + at, y);
    const __m256i u = _mm256_castps_si256(y);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // r's 8 halves in the low 128
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.out) + at), _mm256_castsi256_si128(p));
  }
};
}  // namespace

#include "linear_gguf/linear_gguf_tile.h"

ember::GgufKernel ember::linear_gguf_kernel_avx2(int64_t qtype) {
  return GgufKernels<GAvx2, Avx2, X16Avx2>::make(qtype);
}
#pragma GCC pop_options
