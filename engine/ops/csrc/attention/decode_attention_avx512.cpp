// ember::decode_attention kernels for AVX-512 F/BW/VL/DQ: 16 keys per score vector (decode_attention_body.h).
// The AVX512-BF16 tier uses these too (attention reads K/V as fp32 after widening), except for bf16 queries over a
// bf16 cache on an AMX CPU, which take tile products (decode_attention_amx.cpp).
#include "attention/decode_attention.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "attention/decode_attention_body.h"

ember::AttentionKernels ember::attention_kernels_avx512() { return AttentionBody<Avx512>::kernels(); }
#pragma GCC pop_options
