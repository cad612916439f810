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
    GgufTile<GAmx, Avx512>::template dequant_rows<T>(a, n0, k0, kc, rows);
    ember::amx_rows_to_vnni(rows, kChunk, kc, vnni);
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
