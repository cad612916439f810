// ember::prefill_attention kernels for AVX2 + FMA + F16C (prefill_attention_body.h).
#include "attention/prefill_attention.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "common/simd_avx2.h"
#include "attention/prefill_attention_body.h"

ember::PrefillKernels ember::prefill_kernels_avx2() { return PrefillBody<Avx2>::kernels(); }
int64_t ember::prefill_rows_avx2() { return PrefillBody<Avx2>::kRows; }
#pragma GCC pop_options
