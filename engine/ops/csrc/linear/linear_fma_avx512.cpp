// ember::linear_bf16 block kernels for AVX-512 F/BW/VL/DQ without BF16 dot products (Skylake-X, Cascade Lake,
// Ice Lake): bf16 pairs widened by shifts in zmm registers, fp32 FMAs (linear_bf16_body.h).
#include "linear/linear.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "linear/linear_bf16_body.h"

ember::LinearKernel ember::linear_bf16_kernel_avx512() { return LinearBody<Avx512>::kernel(); }
#pragma GCC pop_options
