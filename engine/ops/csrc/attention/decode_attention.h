// The interface between ember::decode_attention's driver (decode_attention.cpp: checks, KV writes, threads, the
// portable loop) and its per-ISA kernels (decode_attention_<isa>.cpp). ISA: none.
#pragma once

#include <cstdint>

#include "common/dtypes.h"

namespace ember {

// One request and one KV head: the G query heads sharing that KV head attend over its L positions.
// qf: [G, D] fp32, pre-scaled. k/v: the layer's cache, row of (slot, kv head kh) at (slot * kv_stride + kh * D).
// scores: scratch of G * round_up(L, 16) + G floats. out: [G, D] fp32, normalised.
template <typename T>
using AttendOne = void (*)(const float* qf, int64_t G, const T* k, const T* v, const int32_t* slots, int64_t L,
                           int64_t kv_stride, int64_t kh, float* scores, float* out);

// Kernels by head size; nullptr where a head size has none (the driver then runs the portable loop).
struct AttentionKernels {
  AttendOne<float> (*f32)(int64_t head_dim);
  AttendOne<Bf16> (*bf16)(int64_t head_dim);
  AttendOne<Half> (*f16)(int64_t head_dim);
};

AttentionKernels attention_kernels_avx2();
AttentionKernels attention_kernels_avx512();

}  // namespace ember
