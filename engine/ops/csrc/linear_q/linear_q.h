// The interface between ember::linear_q's driver (linear_q.cpp: checks, activation quantization, threads, dispatch)
// and its per-ISA kernels (linear_q_<isa>.cpp over linear_q_body.h; the scalar reference in linear_q_scalar.cpp).
// ISA: none.
//
// The weight is Ember's quantized format (engine/quant/format.py) packed in groups of 4 output rows, so that a
// thread computing 4 rows at once reads one sequential stream (4 separate row streams from DRAM ran at half the
// bandwidth on the AVX2 machine). For a row, per block of 32 inputs (bpb bytes):
//   4-bit: bpb = 16, byte j = value j (low nibble) | value j + 16 (high nibble), values 0..15
//   8-bit: bpb = 32, int8 values
//   W = scale * q + min, one fp16 or fp32 scale (and min) per G inputs, G = 16 (8-bit only) or a multiple of 32
// Packed (engine/quant/format.py pack): rows 4i..4i+3 form group i, the last group padded with zero rows:
//   qweight [ceil(N / 4), 4 * K * bpb / 32]: block b of the group's row r at byte (4 b + r) * bpb
//   scales, mins [ceil(N / 4), 4 * K / G]: weight group g of row r at (4 g + r)
// The kernels multiply integers: x is quantized per row in blocks of 32 to int16 with one fp32 scale xd per block
// (symmetric, -32767..32767, round to nearest even) and xs = xd * sum(xq) per block, which carries the mins:
//   y[m, n] = sum_b s[n, b] * xd[m, b] * sum_i q[n, 32b + i] * xq[m, 32b + i] + sum_g min[n, g] * xs[m, g]
// with xs[m, g] the sum of xd * sum(xq) over group g's blocks.
#pragma once

#include <cstdint>

namespace ember {

constexpr int64_t kQBlockRows = 32;    // output rows per unit of work stolen between threads
// int16, not int8 as llama.cpp: per-32 int8 activations flipped SmolLM2's greedy answer to the capital-of-France
// prompt (a 0.08 logit margin at its first token) on Q4_1 weights whose fp32 reference answers "Paris"; int16 costs
// one more add per block and is as exact as fp32 activations for every practical purpose (2^-16 of a block's max).
constexpr float kQActMax = 32767.0f;

struct QLayout {
  int bits;         // 4 or 8
  bool f16_scales;  // else fp32
  bool has_min;
  int64_t group;    // 16 or a multiple of 32
};

// From this many rows on (prefill chunks, decode batches of 16+) a call dequantizes each block of weights once into
// an fp32 tile and runs fp32 FMAs on fp32 activations (run_block_tile) instead of integer dots: measured on AVX2,
// 117 against 78 GFLOP/s at 32-33 rows, 137-147 against ~75 at 128-512 (bf16's packed kernel: 125-149), and the
// two paths cross near 8-16 rows. Each path computes a row independently of the others (bit for bit, whatever
// the batch); the two paths differ by rounding (~1e-5 relative), so a request's values can change in the last
// bits when its batch crosses 16 rows.
constexpr int64_t kQTileMinRows = 16;
constexpr int64_t kQTileChunk = 512;  // K values per fp32 tile: 512 x 32 x 4 B = 64 KiB, resident in L2

struct QLinearArgs {
  const float* xf;      // [rows, K] fp32 activations (tile path), else nullptr
  const int16_t* xq;    // [rows, K] activations quantized per 32
  const float* xd;      // [rows, K / 32] their scales
  const float* xs;      // [rows, K / G] sum over each weight group's blocks of xd * sum(xq) (mins only)
  const uint8_t* w;     // qweight bytes
  const void* scales;   // fp16 bits or fp32, by layout
  const void* mins;     // same, or nullptr
  int64_t rows, k, n;
  QLayout layout;
  bool out_bf16;        // out is bf16 (rounded to nearest even), else fp32
  void* out;            // [rows, n]
};

// x (fp32, or bf16 bits when xf is null) -> xq, xd and xs per block of 32 (the driver sums xs into groups).
using QuantizeFn = void (*)(const float* xf, const uint16_t* xb, int64_t rows, int64_t k, int16_t* xq, float* xd,
                            float* xs);

struct QLinearKernel {
  // Every row of output block `block` (rows [32 block, 32 block + 32) of W). scratch: q_scratch_floats floats.
  void (*run_block)(const QLinearArgs& a, int64_t block, float* scratch);  // integer dots on xq
  QuantizeFn quantize;
  void (*run_block_tile)(const QLinearArgs& a, int64_t block, float* scratch);  // fp32 on xf (many rows)
};

// Floats of per-thread scratch: the integer path widens one block's fp16 scales; the tile path holds the
// dequantized rows, their transposed tile and every row's accumulators.
inline int64_t q_scratch_floats(int64_t rows, int64_t k) {
  return rows >= kQTileMinRows ? 2 * kQTileChunk * kQBlockRows + rows * kQBlockRows : 2 * kQBlockRows * (k / 16);
}

QLinearKernel linear_q_kernel_scalar(const QLayout& layout);
QLinearKernel linear_q_kernel_avx2(const QLayout& layout);
QLinearKernel linear_q_kernel_avx512vnni(const QLayout& layout);

}  // namespace ember
