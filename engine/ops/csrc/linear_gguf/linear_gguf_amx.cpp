// ember::linear_gguf's AMX many-row path (linear_gguf.h, GgufBlockFn): per 32-row output block and 512-value
// K-chunk, the blocks are dequantized to fp32 exactly as gguf does (linear_gguf_tile.h's g_dequant_block), rounded
// to bf16 into AMX's B layout (linear/amx_bf16.h), and every activation row (bf16, padded to 16) runs over the
// chunk in AMX tiles, fp32 sums in scratch across chunks. Only called where cpu_has_amx_bf16().
// ISA: AVX512-BF16 (+F/BW/VL/DQ, AVX2, FMA, F16C); the tile instructions live in linear/amx_bf16.cpp.
#include "linear_gguf/linear_gguf.h"

#include <immintrin.h>

#include "linear/amx_bf16.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

#include "common/simd_avx512.h"
#include "linear_gguf/linear_gguf_policy256.h"

namespace {
struct AmxBits {  // only bits_to_0x10 (the 5-bit types' decode) is used by the dequantizer
  static constexpr bool kQ8Offset = false;
  static constexpr int64_t tile_min_rows(int) { return 0; }
  static __m256i dot(__m256i w, __m256i) { return w; }
  static __m256i dot_s8(__m256i w, __m256i) { return w; }
  static __m256i bits_to_0x10(uint32_t qh) { return _mm256_maskz_mov_epi8(qh, g_mask8(0x10)); }
};
using GAmx = G256<AmxBits>;
}  // namespace

#include "linear_gguf/linear_gguf_tile.h"

namespace {
// The 16-row layout's 32-value types (Q4_0, Q4_1, Q8_0; linear_gguf.h): a 32-row block's K-chunk [k0, k0 + kc)
// straight from its two groups into the B layout, [kc / 2, 32, 2] bf16, each value gguf's (scale * code + base,
// one rounding of exact operands: the product is exact) rounded to nearest even, as dequant_rows then
// amx_rows_to_vnni compute it. A group's chunk c is 16 rows of 4 codes (values 4c.. of the block, or 4c.. in the
// low nibbles and 16 + 4c.. in the high ones), so each 4-row quarter widens to one fp32 vector in (row, value)
// order, two quarters round to one bf16 vector whose dwords are (row, value pair), and two dword permutes split
// the 16 rows' even and odd pairs into two rows of the B layout. Per value ~0.2 vector ops, against the generic
// path's gather of each row's bytes, fp32 rows and transpose: AMX Xeon, 2 threads, a SmolLM2 layer's four calls
// 0.57-0.66 -> 0.26-0.39 ms at 12-32 rows (Q4_0 / Q4_1 / Q8_0), a Llama-1B layer's 8.7-10.0 -> 5.5-6.0 at 32; a
// 256-token prefill (scripts/profile_prefill.py) of the 1B Q8_0 509 -> 419 ms, of SmolLM2 Q4_1 92-95 -> 87-88.
// What is left (perf, one thread, 16 rows): this conversion ~60 % of the path (widening from memory instead of
// from a register measured no faster) and the tile products ~40 % (at 16 rows a block has only two chains of
// tdpbf16ps, each waiting on the last).
template <int T>
void x16_to_vnni(const GgufLinearArgs& a, int64_t n0, int64_t k0, int64_t kc, uint16_t* vnni) {
  constexpr int bb = T == ember::kQ4_0 ? 18 : T == ember::kQ4_1 ? 20 : 34, hd = T == ember::kQ4_1 ? 64 : 32;
  constexpr bool q8 = T == ember::kQ8_0;
  const int64_t nb = a.k / 32, group_bytes = 16 * nb * bb;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512i quarter[4];  // lane j of quarter i: row 4 i + j / 4
  for (int i = 0; i < 4; ++i)
    quarter[i] = _mm512_add_epi32(_mm512_set1_epi32(4 * i), _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2));
  for (int g = 0; g < 2; ++g) {
    const int64_t gi = n0 / 16 + g;
    uint16_t* col = vnni + 2 * 16 * g;  // this group's 16 columns of every B row (32 columns, 2 values each)
    if (16 * gi >= a.n) {  // no such group (the weight's last block): zero columns
      for (int64_t kk = 0; kk < kc / 2; ++kk) _mm512_storeu_si512(col + kk * 64, _mm512_setzero_si512());
      continue;
    }
    const uint8_t* gw = a.w + gi * group_bytes;
    for (int64_t b = k0 / 32; b < (k0 + kc) / 32; ++b) {
      const uint8_t* blk = gw + b * 16 * bb;
      // kPrefetch bytes ahead in this thread's stream (its blocks' groups lie back to back): the hardware prefetcher
      // stops at each 4 KiB page, and a SmolLM2 gate|up call at 32 rows took 190 us from memory against 150 from
      // the cache without this line, 162-168 with it (a Llama-1B layer's four calls 5-13 % faster at 16-32 rows).
      g_prefetch(blk, 16 * bb);
      uint16_t* out = col + (b * 32 - k0) / 2 * 64;  // B row of the block's first value pair
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      const __m512 base = T == ember::kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                              reinterpret_cast<const __m256i*>(blk + 32)))
                          : T == ember::kQ4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)) : _mm512_setzero_ps();
      __m512 dq[4], bq[4];
      for (int i = 0; i < 4; ++i) {
        dq[i] = _mm512_permutexvar_ps(quarter[i], d);
        bq[i] = _mm512_permutexvar_ps(quarter[i], base);
      }
      // codes: 16 rows x 4 codes, values 4 c'.. of the block; its two B rows are value pairs 2 c', 2 c' + 1
      const auto emit = [&](__m512i codes, int c2) {
        __m512 f[4];
        for (int i = 0; i < 4; ++i) {
          const __m128i part = _mm512_extracti32x4_epi32(codes, i);
          const __m512i wide = q8 ? _mm512_cvtepi8_epi32(part) : _mm512_cvtepu8_epi32(part);
          f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide), dq[i], bq[i]);
        }
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);  // rows 0-7
        const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);  // rows 8-15
        _mm512_storeu_si512(out + c2 * 64, _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_storeu_si512(out + (c2 + 1) * 64, _mm512_permutex2var_epi32(lo, odd, hi));
      };
      for (int c = 0; c < (q8 ? 8 : 4); ++c) {
        const __m512i q = _mm512_loadu_si512(blk + hd + 64 * c);
        if constexpr (q8) {
          emit(q, 2 * c);
        } else {
          emit(_mm512_and_si512(q, _mm512_set1_epi8(0x0F)), 2 * c);
          emit(_mm512_and_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi8(0x0F)), 8 + 2 * c);
        }
      }
    }
  }
}

template <int T>
void run_block_amx(const GgufLinearArgs& a, int64_t block, float* scratch) {
  constexpr int64_t kRows = ember::kGgufBlockRows, kChunk = ember::kGgufTileChunk;
  const int64_t k = a.k, n0 = block * kRows, nr = g_min64(kRows, a.n - n0);
  float* rows = scratch;                                               // [32, kChunk] fp32
  auto* vnni = reinterpret_cast<uint16_t*>(rows + kRows * kChunk);     // [kChunk / 2, 32, 2] bf16
  float* acc = rows + kRows * kChunk + kChunk * kRows / 2;             // [rows_pad, 32]
  ember::amx_begin();
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    const int64_t kc = g_min64(kChunk, k - k0);  // a multiple of the block size, so of 32
    if constexpr (T == ember::kQ4_0 || T == ember::kQ4_1 || T == ember::kQ8_0) {
      x16_to_vnni<T>(a, n0, k0, kc, vnni);
    } else {
      GgufTile<GAmx, Avx512>::template dequant_rows<T>(a, n0, k0, kc, rows);
      ember::amx_rows_to_vnni(rows, kChunk, kc, vnni);
    }
    ember::amx_bf16_block(a.xb + k0, k, a.rows_pad, vnni, kc, acc, k0 == 0);
  }
  ember::amx_end();
  ember::amx_store_rows(acc, a.rows, nr, a.out_bf16 ? static_cast<void*>(static_cast<uint16_t*>(a.out) + n0)
                                                    : static_cast<void*>(static_cast<float*>(a.out) + n0),
                        a.n, a.out_bf16);
}
}  // namespace

ember::GgufBlockFn ember::linear_gguf_amx_block(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return run_block_amx<kQ4_0>;
    case kQ4_1: return run_block_amx<kQ4_1>;
    case kQ5_0: return run_block_amx<kQ5_0>;
    case kQ5_1: return run_block_amx<kQ5_1>;
    case kQ8_0: return run_block_amx<kQ8_0>;
    case kQ4_K: return run_block_amx<kQ4_K>;
    case kQ5_K: return run_block_amx<kQ5_K>;
    default: return run_block_amx<kQ6_K>;
  }
}
#pragma GCC pop_options
