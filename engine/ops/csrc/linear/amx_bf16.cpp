// AMX-BF16 kernels of linear/amx_bf16.h. ISA: AMX-TILE + AMX-BF16 + AVX512-BF16 (Sapphire Rapids on).
//
// amx_bf16_block: 2 x 2 register blocking over the 8 tiles: C tiles 0-3 (32 rows x 32 columns of fp32), A tiles 4-5
// (two 16-row slabs of 32 bf16 inputs), B tiles 6-7 (the block's two 16-column halves of 16 input pairs); 4
// tdpbf16ps per 4 tile loads. B is the caller's L1-sized chunk, A streams from L2.
#include "linear/amx_bf16.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

namespace {
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
}  // namespace

void ember::amx_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = colsb[t];
    cfg.rows[t] = rows[t];
  }
  // GCC 12 does not see ldtilecfg read the struct and drops the stores above without this barrier.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

void ember::amx_begin() {
  static constexpr uint8_t kRows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  static constexpr uint16_t kColsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  amx_config(kRows, kColsb);
}

void ember::amx_end() { _tile_release(); }

void ember::amx_bf16_block(const uint16_t* a, int64_t lda, int64_t m, const uint16_t* b, int64_t kc, float* c,
                           bool first) {
  const int64_t sa = lda * 2;
  constexpr int64_t sb = 128, sc = 128;
  int64_t m0 = 0;
  for (; m0 + 32 <= m; m0 += 32) {
    float* c0 = c + m0 * 32;
    float* c1 = c0 + 16 * 32;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, c0, sc);
      _tile_loadd(1, c0 + 16, sc);
      _tile_loadd(2, c1, sc);
      _tile_loadd(3, c1 + 16, sc);
    }
    const uint16_t* a0 = a + m0 * lda;
    const uint16_t* a1 = a0 + 16 * lda;
    for (int64_t kk = 0; kk < kc; kk += 32) {
      const uint16_t* bk = b + kk * 32;  // row kk / 2 of 64 values
      _tile_loadd(4, a0 + kk, sa);
      _tile_loadd(6, bk, sb);
      _tile_loadd(7, bk + 32, sb);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a1 + kk, sa);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c0, sc);
    _tile_stored(1, c0 + 16, sc);
    _tile_stored(2, c1, sc);
    _tile_stored(3, c1 + 16, sc);
  }
  if (m0 < m) {  // 16 rows left
    float* c0 = c + m0 * 32;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
    } else {
      _tile_loadd(0, c0, sc);
      _tile_loadd(1, c0 + 16, sc);
    }
    const uint16_t* a0 = a + m0 * lda;
    for (int64_t kk = 0; kk < kc; kk += 32) {
      const uint16_t* bk = b + kk * 32;
      _tile_loadd(4, a0 + kk, sa);
      _tile_loadd(6, bk, sb);
      _tile_loadd(7, bk + 32, sb);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c0, sc);
    _tile_stored(1, c0 + 16, sc);
  }
}

void ember::amx_store_rows(const float* c, int64_t rows, int64_t ncols, void* out, int64_t ldo, bool bf16) {
  const __mmask16 lo = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 hi = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_loadu_ps(c + r * 32), v1 = _mm512_loadu_ps(c + r * 32 + 16);
    if (bf16) {
      uint16_t* o = static_cast<uint16_t*>(out) + r * ldo;
      _mm256_mask_storeu_epi16(o, lo, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v0)));
      _mm256_mask_storeu_epi16(o + 16, hi, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v1)));
    } else {
      float* o = static_cast<float*>(out) + r * ldo;
      _mm512_mask_storeu_ps(o, lo, v0);
      _mm512_mask_storeu_ps(o + 16, hi, v1);
    }
  }
}

void ember::amx_rows_to_vnni(const float* src, int64_t lds, int64_t kc, uint16_t* dst) {
  // 16 pairs x 16 rows at a time: each row's 32 fp32 become 16 bf16 pairs (one zmm of 32-bit lanes), then a 16 x 16
  // transpose of 32-bit lanes puts pair kk of rows r0..r0+15 in one zmm.
  auto* d32 = reinterpret_cast<uint32_t*>(dst);
  for (int64_t p0 = 0; p0 < kc / 2; p0 += 16)
    for (int64_t r0 = 0; r0 < 32; r0 += 16) {
      __m512i v[16], t[16];
      for (int i = 0; i < 16; ++i) {
        const float* s = src + (r0 + i) * lds + 2 * p0;
        v[i] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s)));
      }
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {
        v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      // v[4 i + j] now holds, per 128-bit lane L, column 4 L + j of rows 4 i .. 4 i + 3; two 128-bit shuffles later
      // v[q] is column q of all 16 rows.
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) {
          t[8 * i + j] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + 4 + j], 0x88);
          t[8 * i + 4 + j] = _mm512_shuffle_i32x4(v[8 * i + j], v[8 * i + 4 + j], 0xDD);
        }
      for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        v[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
      }
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(d32 + (p0 + q) * 32 + r0, v[q]);
    }
}
#pragma GCC pop_options
