// ember::silu_mul's row kernel for AVX2 (silu_mul.h): 8 silu values gathered from the table at a time.
#include "elementwise/silu_mul.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "common/simd_avx2.h"

namespace {

int64_t row(const uint16_t* gate, const uint16_t* up, const uint16_t* table, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gate + i)));
    const __m256i s = _mm256_slli_epi32(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), idx, 2), 16);
    const __m256 u = Avx2::load(reinterpret_cast<const Bf16*>(up + i));
    Avx2::store_bf16(out + i, _mm256_mul_ps(_mm256_castsi256_ps(s), u), 8);
  }
  return i;
}

}  // namespace

ember::SiluMulRow ember::silu_mul_row_avx2() { return row; }
#pragma GCC pop_options
