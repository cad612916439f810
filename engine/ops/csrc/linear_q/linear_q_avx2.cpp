// ember::linear_q kernels for AVX2 + FMA + F16C: the int16 dot is vpmaddwd (int16 pairs -> int32), two of them
// added per block of 32 (linear_q_body.h). Any x86-64 CPU from Haswell / Zen 1 on.
#include "linear_q/linear_q.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {
struct MaddDot {
  static __m256i dot(__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }
  static __m256i dot2(__m256i a, __m256i b, __m256i c, __m256i d) {
    return _mm256_add_epi32(_mm256_madd_epi16(a, b), _mm256_madd_epi16(c, d));
  }
};
}  // namespace

#include "common/simd_avx2.h"
#include "linear_q/linear_q_body.h"

ember::QLinearKernel ember::linear_q_kernel_avx2(const QLayout& layout) {
  return QLinearBody<MaddDot, Avx2>::kernel(layout);
}
#pragma GCC pop_options
