// ember::rms_norm's and ember::rope's bf16 row kernels for AVX2 + FMA, 8 lanes (norm_rope.h, norm_rope_body.h).
#include "elementwise/norm_rope.h"

#include <immintrin.h>

#include <cmath>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "common/simd_avx2.h"
#include "elementwise/norm_rope_body.h"

ember::RowKernels ember::row_kernels_avx2() {
  return {NormRope<Avx2>::rms_norm, NormRope<Avx2>::rope};
}
#pragma GCC pop_options
