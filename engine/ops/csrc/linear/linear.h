// The interface between the packed linear ops' driver (linear.cpp: checks, threads, dispatch) and their per-format,
// per-ISA block kernels (linear_<format>_<isa>.cpp). ISA: none.
//
// Both formats split the output columns into blocks of 32 (columns past N are zero padding, never stored):
//  - bf16 (ember::linear_bf16): [N_pad / 32, K / 2, 32, 2]. For each input pair (2k, 2k+1) a block's 32 columns x 2
//    values are 128 contiguous bytes, each 32-bit lane a (W[n, 2k], W[n, 2k+1]) pair (what vdpbf16ps multiplies).
//  - fp32 (ember::linear_f32): [N_pad / 32, K, 32]. For each input k a block's 32 columns are 128 contiguous bytes:
//    the block is already the fp32 tile the micro-kernel reads, so nothing is widened.
// (engine/ops/linear.py pack_linear_weight builds both.)
#pragma once

#include <cstdint>

namespace ember {

constexpr int64_t kLinearBlock = 32;  // output columns per packed block

struct LinearArgs {
  const uint16_t* x;   // [rows, K] bf16 bits, contiguous (bf16 format), else nullptr
  const float* xf;     // [rows, K] fp32: x widened (bf16 kernels that multiply in fp32) or the fp32 input
  const void* w;       // packed weight (uint16_t bf16 bits or float, by format)
  int64_t rows, k, n;  // k: input features (even for bf16)
  void* out;           // [rows, n] in the format's dtype
  // Row stride of the input the kernel reads (x or xf), in its elements: k, or k plus a cache line when several rows
  // share a call (common/row_stride.h).
  int64_t ldx;
};

struct LinearKernel {
  // Every row of output block `block`. `scratch` is this thread's scratch_floats(rows, k) floats.
  void (*run_block)(const LinearArgs& a, int64_t block, float* scratch);
  int64_t (*scratch_floats)(int64_t rows, int64_t k);
  bool fp32_input;  // run_block reads LinearArgs::xf (for bf16, the driver widens x first)
};

LinearKernel linear_bf16_kernel_avx2();
LinearKernel linear_bf16_kernel_avx512();
LinearKernel linear_bf16_kernel_avx512bf16();
LinearKernel linear_f32_kernel_avx2();
LinearKernel linear_f32_kernel_avx512();

}  // namespace ember
