// ember::prefill_attention kernels for AVX-512 F/BW/VL/DQ (prefill_attention_body.h); the AVX512-BF16 tier uses them
// too (K/V are widened to fp32 once per block and reused by every query row, so fp32 FMAs are what the math runs).
#include "attention/prefill_attention.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "attention/prefill_attention_body.h"

ember::PrefillKernels ember::prefill_kernels_avx512() { return PrefillBody<Avx512>::kernels(); }
int64_t ember::prefill_rows_avx512() { return PrefillBody<Avx512>::kRows; }
#pragma GCC pop_options
