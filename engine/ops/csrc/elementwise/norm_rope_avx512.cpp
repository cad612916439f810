// ember::rms_norm's and ember::rope's bf16 row kernels for AVX-512 F/BW, 16 lanes (norm_rope.h, norm_rope_body.h).
#include "elementwise/norm_rope.h"

#include <immintrin.h>

#include <cmath>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "elementwise/norm_rope_body.h"

ember::RowKernels ember::row_kernels_avx512() {
  return {NormRope<Avx512>::rms_norm, NormRope<Avx512>::rope};
}
#pragma GCC pop_options
