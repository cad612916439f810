// The interface between ember::decode_attention's driver (decode_attention.cpp: checks, KV writes, threads, the
// portable loop) and its per-ISA kernels (decode_attention_<isa>.cpp). ISA: none.
#pragma once

#include <cstdint>

#include "common/dtypes.h"

namespace ember {

// The int8 KV cache (engine/ops/kv_quant.py): each (slot, kv head) row is D int8 values followed by the row's fp32
// scale in the next 4 bytes (unaligned), value = q * scale, so one row's values and scale share a cache line or two
// and the cache is still one tensor per layer [num_slots + 1, kv_heads, D + 4]. row_extra<T>() is those 4 bytes.
constexpr int64_t kQ8ScaleBytes = 4;
template <typename T>
constexpr int64_t row_extra() { return 0; }
template <>
constexpr int64_t row_extra<int8_t>() { return kQ8ScaleBytes; }
template <>
constexpr int64_t row_extra<Fp8E4M3>() { return kQ8ScaleBytes; }  // the fp8 cache: the same layout, e4m3 values
template <typename T>  // T: int8_t or Fp8E4M3 (one byte a value)
inline float q8_scale(const T* row, int64_t D) {
  float s;
  __builtin_memcpy(&s, row + D, sizeof(float));
  return s;
}

// One request and one KV head over one chunk of its positions: the G queries sharing that KV head attend over the
// chunk's L positions (slots: the chunk's first): the query heads of one row, or of several rows of the request at
// consecutive positions (a speculative verify step's last token and drafts), query g over the chunk's first qlen[g]
// positions (qlen nullptr: all L; 0: none), so each K/V row is read once for all.
// qf: [G, D] fp32, pre-scaled. k/v: the layer's cache, row of (slot, kv head kh) at
// (slot * kv_stride + kh * (D + row_extra<T>())).
// scores: scratch of G * round_up(L, 16) + G + G * D floats. The result is a partial softmax, for the driver to
// combine over chunks: out [G, D] fp32 = sum over the chunk of e^(score - m) v, and stats [G, 2] = (m, sum of
// e^(score - m)), m the query's largest score in the chunk (-inf and a sum of 0 where it sees none of it).
template <typename T>
using AttendOne = void (*)(const float* qf, int64_t G, const T* k, const T* v, const int32_t* slots, int64_t L,
                           int64_t kv_stride, int64_t kh, float* scores, float* out, float* stats,
                           const int64_t* qlen);

// Kernels by head size; nullptr where a head size has none (the driver then runs the portable loop).
struct AttentionKernels {
  AttendOne<float> (*f32)(int64_t head_dim);
  AttendOne<Bf16> (*bf16)(int64_t head_dim);
  AttendOne<Half> (*f16)(int64_t head_dim);
  AttendOne<int8_t> (*q8)(int64_t head_dim);  // the int8 cache: dequantized in registers, never copied out
  AttendOne<Fp8E4M3> (*fp8)(int64_t head_dim);  // the fp8 e4m3 cache, likewise
};

// AMX-BF16 (decode_attention_amx.cpp), for bf16 queries over a bf16 cache, head size D of 64 or 128 and G <= 16
// query rows: AttendOne's contract with the queries as they are, q [G, D] bf16 bits, and the scale apart. Only where
// cpu_has_amx_bf16().
void attend_amx_bf16(const uint16_t* q, int64_t G, int64_t D, float scale, const uint16_t* k, const uint16_t* v,
                     const int32_t* slots, int64_t L, int64_t kv_stride, int64_t kh, float* scores, float* out,
                     float* stats, const int64_t* qlen);

// AVX512-BF16 (decode_attention_dpbf16.cpp), for the same case on CPUs without AMX: attend_amx_bf16's contract, by
// head size (64; nullptr otherwise). Only where the CPU has AVX512-BF16 (the avx512bf16 tier).
using AttendBf16 = void (*)(const uint16_t* q, int64_t G, float scale, const uint16_t* k, const uint16_t* v,
                            const int32_t* slots, int64_t L, int64_t kv_stride, int64_t kh, float* scores,
                            float* out, float* stats, const int64_t* qlen);
AttendBf16 attend_dpbf16_kernel(int64_t head_dim);

AttentionKernels attention_kernels_avx2();
AttentionKernels attention_kernels_avx512();

}  // namespace ember
