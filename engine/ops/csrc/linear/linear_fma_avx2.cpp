// ember::linear_bf16 block kernels for AVX2 + FMA (+F16C, part of the tier): bf16 pairs widened by shifts in
// registers, fp32 FMAs (linear_bf16_body.h). Runs on any x86-64 CPU from Haswell / Zen 1 on.
#include "linear/linear.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "common/simd_avx2.h"
#include "linear/linear_bf16_body.h"

ember::LinearKernel ember::linear_bf16_kernel_avx2() { return LinearBody<Avx2>::kernel(); }
#pragma GCC pop_options
