// ember::decode_attention kernels for AVX2 + FMA + F16C: 8 keys per score vector (decode_attention_body.h).
#include "attention/decode_attention.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "common/simd_avx2.h"
#include "attention/decode_attention_body.h"

ember::AttentionKernels ember::attention_kernels_avx2() { return AttentionBody<Avx2>::kernels(); }
#pragma GCC pop_options
