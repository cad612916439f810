// A 16 x 16 transpose of 32-bit values in 16 zmm registers, shared by the attention kernels that put keys in the
// lanes (prefill_attention_amx.cpp, decode_attention_dpbf16.cpp). ISA: AVX-512 F; include inside a target region
// with it enabled, after every standard and ATen header.
#pragma once

#include <immintrin.h>

namespace {

// r[0..15]: 16 rows of 16 32-bit values; returns them transposed in t (t[c] = column c of r).
inline void transpose16(const __m512i* r, __m512i* t) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4 i + j], 128-bit lane L: rows 4 i .. 4 i + 3 of column 4 L + j
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88), x1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xDD);
    t[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[8 + j] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[4 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

}  // namespace
