// ember::read_bandwidth's AVX2 read loop: 256 bytes per iteration into 4 independent 64-bit-lane sums.
#include "bandwidth/read_bandwidth.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2")

uint64_t ember::read_sum_avx2(const uint8_t* p, int64_t n) {
  __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  int64_t i = 0;
  for (; i + 256 <= n; i += 256)
    for (int j = 0; j < 4; ++j) {
      const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64 * j));
      const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64 * j + 32));
      s[j] = _mm256_add_epi64(s[j], _mm256_xor_si256(a, b));
    }
  for (; i + 32 <= n; i += 32) s[0] = _mm256_add_epi64(s[0], _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
  const __m256i t = _mm256_add_epi64(_mm256_add_epi64(s[0], s[1]), _mm256_add_epi64(s[2], s[3]));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#pragma GCC pop_options
