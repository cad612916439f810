// Tile helpers shared by the AMX attention kernels (decode_attention_amx.cpp, prefill_attention_amx.cpp): include
// inside a target region with AMX-BF16 and AVX-512 (BW, BF16) enabled. ISA: that region's.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

// K and V rows sit at slots the hardware prefetcher cannot predict: each block prefetches the rows this many keys
// ahead into L2 (the vector kernel's 16 KiB ahead, decode_attention_body.h, is 128 rows of head size 64).
constexpr int64_t kAheadKeys = 64;

inline void prefetch_rows(const uint16_t* base, const int32_t* slots, int64_t from, int64_t to, int64_t kv_stride,
                          int64_t D) {
  for (int64_t l = from; l < to; ++l) {
    const char* row = reinterpret_cast<const char*>(base + static_cast<int64_t>(slots[l]) * kv_stride);
    for (int64_t off = 0; off < D * 2; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
  }
}

// V rows l0 .. l0 + 31 (zeros past n) as the B tiles of head values e0 .. e0 + 3 (16 each): row i of tile e holds
// values 16 e .. 16 e + 15 of keys 2 i and 2 i + 1, interleaved.
inline void value_tiles(const uint16_t* vbase, const int32_t* slots, int64_t n, int64_t kv_stride, int64_t e0,
                        uint16_t (*bv)[16 * 32]) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < 16; ++i) {
    __m512i r[2][2];  // [key of the pair][32 head values of the pass's 64]
    for (int j = 0; j < 2; ++j) {
      const int64_t l = 2 * i + j;
      if (l < n) {
        const uint16_t* row = vbase + static_cast<int64_t>(slots[l]) * kv_stride + 16 * e0;
        r[j][0] = _mm512_loadu_si512(row);
        r[j][1] = _mm512_loadu_si512(row + 32);
      } else {
        r[j][0] = r[j][1] = _mm512_setzero_si512();
      }
    }
    for (int e = 0; e < 4; ++e) {
      const __m512i x = _mm512_permutex2var_epi16(r[0][e / 2], e % 2 ? hi : lo, r[1][e / 2]);
      _mm512_store_si512(bv[e] + 32 * i, x);
    }
  }
}

// C tiles 0-3 += A (tile 4, loaded from a with row stride lda bytes) times the B tiles bv[0..3] (through tile 5).
inline void dp_four(const void* a, int64_t lda, const uint16_t (*bv)[16 * 32]) {
  _tile_loadd(4, a, lda);
  _tile_loadd(5, bv[0], 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(5, bv[1], 64);
  _tile_dpbf16ps(1, 4, 5);
  _tile_loadd(5, bv[2], 64);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(5, bv[3], 64);
  _tile_dpbf16ps(3, 4, 5);
}

// C tile e (0-3) into c, 16 rows of 16 floats (tile numbers are literals in the instruction).
inline void store_c(int e, float (*c)[16]) {
  switch (e) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

}  // namespace
