// The interface between ember::prefill_attention's driver (prefill_attention.cpp: checks, KV writes, tasks,
// threads) and its per-ISA kernels (prefill_attention_<isa>.cpp). ISA: none.
//
// A task is one request, one KV head and a block of its new tokens: the block's nq queries times the G query heads
// that share the KV head are M "query rows" (m = i * G + g), attended together so that every key and value row they
// read is widened once and used M times (a GEMM's reuse, where decode attention has one row's).
#pragma once

#include <cstdint>

#include "attention/decode_attention.h"

namespace ember {

// Query rows a kernel handles per pass (a task's M is a multiple of it): 64 on AVX-512, 32 on AVX2.
int64_t prefill_rows_avx512();
int64_t prefill_rows_avx2();

// qt: [D, M] fp32, the task's queries transposed and pre-scaled (rows past G * nq zero). Query row m < G * nq sits
// at position first_pos + m / G and sees keys 0 .. that position; the keys are positions 0 .. first_pos + nq - 1,
// row l of K/V at (slots[l] * kv_stride + kh * (D + row_extra<T>())). scratch: prefill_scratch_floats(M, D) floats.
// out: [M, D] fp32, normalised (rows past G * nq undefined).
template <typename T>
using PrefillOne = void (*)(const float* qt, int64_t M, int64_t G, int64_t nq, int64_t first_pos, const T* k,
                            const T* v, const int32_t* slots, int64_t kv_stride, int64_t kh, float* scratch,
                            float* out);

// Keys per block: its scores [64, M] and K/V rows stay in L1/L2 (32 measured ~10 % slower).
constexpr int64_t kPrefillKeys = 64;

inline int64_t prefill_scratch_floats(int64_t M, int64_t D) {
  return 2 * kPrefillKeys * D + (kPrefillKeys + 4) * M + 4 * M;
}

// Kernels by head size (nullptr: that head size has none, and the Python reference runs instead).
struct PrefillKernels {
  PrefillOne<float> (*f32)(int64_t head_dim);
  PrefillOne<Bf16> (*bf16)(int64_t head_dim);
  PrefillOne<Half> (*f16)(int64_t head_dim);
  PrefillOne<int8_t> (*q8)(int64_t head_dim);
  PrefillOne<Fp8E4M3> (*fp8)(int64_t head_dim);
};

PrefillKernels prefill_kernels_avx2();
PrefillKernels prefill_kernels_avx512();

// AMX-BF16 (prefill_attention_amx.cpp), for bf16 queries over a bf16 cache and head size D of 64, 128 or 256: q
// holds the task's G * nq <= kPrefillAmxRows query rows as they are (row m = i * G + g, [rows, D] bf16, padded with
// zero rows to a multiple of 16), unscaled; the keys and their rows as for PrefillOne (bf16 rows: no scale); out
// [rows rounded up to 16, D] fp32, normalised. Softmax numerators are rounded to bf16, the values the P V product
// multiplies, and summed as rounded. Call only where cpu_has_amx_bf16().
constexpr int64_t kPrefillAmxRows = 64;
void prefill_amx_bf16(const uint16_t* q, int64_t G, int64_t nq, int64_t first_pos, int64_t D, float scale,
                      const uint16_t* k, const uint16_t* v, const int32_t* slots, int64_t kv_stride, int64_t kh,
                      float* out);

}  // namespace ember
