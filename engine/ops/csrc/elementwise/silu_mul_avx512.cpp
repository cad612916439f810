// ember::silu_mul's row kernel for AVX-512 F/BW (silu_mul.h): 16 silu values gathered from the table at a time.
#include "elementwise/silu_mul.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "common/simd_avx512.h"

namespace {

int64_t row(const uint16_t* gate, const uint16_t* up, const uint16_t* table, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + i)));
    const __m512i s = _mm512_slli_epi32(_mm512_i32gather_epi32(idx, table, 2), 16);  // the entry's bits, widened
    const __m512 u = Avx512::load(reinterpret_cast<const Bf16*>(up + i));
    Avx512::store_bf16(out + i, _mm512_mul_ps(_mm512_castsi512_ps(s), u), 16);
  }
  return i;
}

}  // namespace

ember::SiluMulRow ember::silu_mul_row_avx512() { return row; }
#pragma GCC pop_options
