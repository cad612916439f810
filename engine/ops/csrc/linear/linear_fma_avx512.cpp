// ember::linear_bf16 and ember::linear_f32 block kernels for AVX-512 F/BW/VL/DQ (Skylake-X on; the AVX512-BF16 tier
// uses them for fp32 weights): fp32 FMAs, bf16 pairs widened by shifts in zmm registers (linear_fma_body.h).
#include "linear/linear.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "linear/linear_fma_body.h"

ember::LinearKernel ember::linear_bf16_kernel_avx512() { return LinearBody<Avx512>::kernel(); }
ember::LinearKernel ember::linear_f32_kernel_avx512() { return LinearBody<Avx512>::f32_kernel(); }
#pragma GCC pop_options
