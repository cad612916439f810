// ember::linear_q kernels for AVX512-VNNI (+VL: Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 on): the int16 dot
// is vpdpwssd on 256-bit registers (multiply and accumulate int16 pairs into int32 in one instruction). 256-bit, not
// 512: decode is bound by the weight stream, and one 32-value block per vector pair keeps the body shared with AVX2.
#include "linear_q/linear_q.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace {
struct VnniDot {
  static __m256i dot(__m256i a, __m256i b) { return _mm256_dpwssd_epi32(_mm256_setzero_si256(), a, b); }
  static __m256i dot2(__m256i a, __m256i b, __m256i c, __m256i d) {
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), a, b), c, d);
  }
};
}  // namespace

#include "common/simd_avx512.h"
#include "linear_q/linear_q_body.h"

ember::QLinearKernel ember::linear_q_kernel_avx512vnni(const QLayout& layout) {
  return QLinearBody<VnniDot, Avx512>::kernel(layout);
}
#pragma GCC pop_options
