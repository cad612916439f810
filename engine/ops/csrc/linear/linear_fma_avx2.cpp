// ember::linear_bf16 and ember::linear_f32 block kernels for AVX2 + FMA (+F16C, part of the tier): fp32 FMAs, bf16
// pairs widened by shifts in registers (linear_fma_body.h). Runs on any x86-64 CPU from Haswell / Zen 1 on.
#include "linear/linear.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "common/simd_avx2.h"
#include "linear/linear_fma_body.h"

ember::LinearKernel ember::linear_bf16_kernel_avx2() { return LinearBody<Avx2>::kernel(); }
ember::LinearKernel ember::linear_f32_kernel_avx2() { return LinearBody<Avx2>::f32_kernel(); }
#pragma GCC pop_options
