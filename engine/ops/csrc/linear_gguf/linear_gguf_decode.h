// GGUF blocks -> bytes of unsigned codes in registers, written once for linear_gguf_body.h. 256-bit AVX2 code (also
// valid inside the AVX-512 region); the policy V supplies what differs (V::bits_to_0x10: AVX-512 has a one-
// instruction mask move). Included inside the ISA's target region, after every standard header. ISA: AVX2+F16C.
//
// Each function yields 32 values of one row in value order, one byte each, so that int8 x activations in value
// order multiply byte by byte (vpmaddubsw / vpdpbusd: unsigned weight byte x signed activation byte).
#pragma once

#include "linear_gguf/linear_gguf.h"

namespace {

inline __m256i g_load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i g_load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline uint32_t g_load32(const uint8_t* p) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}
inline float g_half(const uint8_t* p) {  // little-endian fp16 -> fp32 (F16C)
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline __m256i g_mask8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

// 16 bytes of nibbles -> 32 codes: low nibbles are values 0-15, high nibbles 16-31 (Q4_0/Q4_1/Q5_0/Q5_1).
inline __m256i g_nibbles16(const uint8_t* qs) {
  const __m128i t = g_load128(qs);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), g_mask8(0x0F));
}

// Byte offsets in a block: of d, of m (or dmin), of the 5th-bit words, of the nibbles / int8 codes.
template <int T>
struct Layout32 {
  static constexpr int bytes = T == ember::kQ4_0 ? 18 : T == ember::kQ4_1 ? 20 : T == ember::kQ5_0 ? 22
                             : T == ember::kQ5_1 ? 24 : 34;
  static constexpr bool min = T == ember::kQ4_1 || T == ember::kQ5_1;
  static constexpr bool five = T == ember::kQ5_0 || T == ember::kQ5_1;
  static constexpr int qh = min ? 4 : 2, qs = qh + (five ? 4 : 0);
  static constexpr int code_offset = T == ember::kQ4_0 ? 8 : T == ember::kQ5_0 ? 16 : 0;  // value = d (q - off)
};

// A 32-value block's codes: 0..15 (Q4), 0..31 (Q5) or Q8_0's int8 as stored (signed: the policy's dot handles it).
template <int T, class V>
inline __m256i g_decode32(const uint8_t* b) {
  using L = Layout32<T>;
  if constexpr (T == ember::kQ8_0) return g_load256(b + 2);
  else if constexpr (L::five) return _mm256_or_si256(g_nibbles16(b + L::qs), V::bits_to_0x10(g_load32(b + L::qh)));
  else return g_nibbles16(b + L::qs);
}

// Q4_K / Q5_K sub-block scales and mins, 6 bits each in 12 bytes (ggml's get_scale_min_k4), as 8 bytes each:
// sc[0..3], mn[0..3] are the low 6 bits of bytes 0-3 / 4-7; sc[4..7] (mn[4..7]) the low (high) nibbles of bytes
// 8-11 with their top 2 bits taken from the top 2 bits of bytes 0-3 (4-7).
inline void g_k_scales(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  const uint32_t u0 = g_load32(s), u1 = g_load32(s + 4), u2 = g_load32(s + 8);
  const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, lo2 = 0x03030303u;
  const uint32_t sc_hi = (u2 & lo4) | (((u0 >> 6) & lo2) << 4), mn_hi = ((u2 >> 4) & lo4) | (((u1 >> 6) & lo2) << 4);
  sc = (u0 & lo6) | static_cast<uint64_t>(sc_hi) << 32;
  mn = (u1 & lo6) | static_cast<uint64_t>(mn_hi) << 32;
}

// The int16 scale vector of 32-value chunk c (vpmaddwd's second operand) is one in-lane byte shuffle of a per-block
// table: pick(c) copies int16 lane c of each 128-bit half to its whole half. Q4_K/Q5_K: both halves hold
// sc[0..7] (one scale per chunk); Q6_K: the low half holds the even sub-scales, the high half the odd ones, since
// chunk c's first 16 values (the low half of the maddubs result) take sc[2c] and its last 16 sc[2c+1].
inline __m256i g_pick(int c) { return _mm256_set1_epi16(static_cast<short>((2 * c + 1) << 8 | (2 * c))); }

inline __m256i g_k_table(uint64_t sc) {
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
}
// [m0, m0, m1, m1, ..., m7, m7] as int16: vpmaddwd against the per-16 activation sums gives m_s * sum over 32.
inline __m256i g_k_mins(uint64_t mn) {
  const __m128i m = _mm_cvtsi64_si128(static_cast<long long>(mn));
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
}
inline __m256i g_q6_table(const uint8_t* sc) {
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(g_load128(sc), split));
}
inline __m256i g_q6_natural(const uint8_t* sc) { return _mm256_cvtepi8_epi16(g_load128(sc)); }

// Q5_K: the 5th bit of chunk c's value l is bit c of qh[l], moved to bit 4 (16-bit shifts: bit 4 of each byte
// comes from the same byte for every c in 0..7).
inline __m256i g_k5_high(__m256i qh, int c) {
  const __m256i s = c <= 4 ? _mm256_slli_epi16(qh, 4 - c) : _mm256_srli_epi16(qh, c - 4);
  return _mm256_and_si256(s, g_mask8(0x10));
}

// Q6_K, half h (128 values) of a block: chunk j (0..3) = 32 six-bit codes: low or high nibbles of ql[32 (j % 2) ..]
// with bits 2j, 2j+1 of qh[0..31] as bits 4-5.
inline void g_q6_half(const uint8_t* b, int h, __m256i c[4]) {
  const __m256i qa = g_load256(b + 64 * h), qb = g_load256(b + 64 * h + 32), qh = g_load256(b + 128 + 32 * h);
  const __m256i lo4 = g_mask8(0x0F), b45 = g_mask8(0x30);
  c[0] = _mm256_or_si256(_mm256_and_si256(qa, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), b45));
  c[1] = _mm256_or_si256(_mm256_and_si256(qb, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), b45));
  c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), lo4), _mm256_and_si256(qh, b45));
  c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), lo4),
                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), b45));
}

}  // namespace
