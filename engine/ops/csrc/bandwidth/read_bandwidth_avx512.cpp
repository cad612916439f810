// ember::read_bandwidth's AVX-512 read loop: 256 bytes per iteration into 4 independent 64-bit-lane sums.
#include "bandwidth/read_bandwidth.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f")

uint64_t ember::read_sum_avx512(const uint8_t* p, int64_t n) {
  __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  int64_t i = 0;
  for (; i + 256 <= n; i += 256)
    for (int j = 0; j < 4; ++j) s[j] = _mm512_add_epi64(s[j], _mm512_load_si512(p + i + 64 * j));
  for (; i + 64 <= n; i += 64) s[0] = _mm512_add_epi64(s[0], _mm512_load_si512(p + i));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(
      _mm512_add_epi64(_mm512_add_epi64(s[0], s[1]), _mm512_add_epi64(s[2], s[3]))));
}
#pragma GCC pop_options
