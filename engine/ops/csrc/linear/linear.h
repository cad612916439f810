// The interface between ember::linear_bf16's driver (linear_bf16.cpp: checks, threads, dispatch) and its per-ISA
// block kernels (linear_bf16_<isa>.cpp). ISA: none.
//
// Packed weight layout (engine/ops/linear.py pack_linear_weight): [N_pad / 32, K / 2, 32, 2] bf16. Block b holds
// output columns 32b..32b+31; for each input pair (2k, 2k+1) its 32 columns x 2 values are 128 contiguous bytes,
// each 32-bit lane a (W[n, 2k], W[n, 2k+1]) pair. Columns past N are zero padding and never stored.
#pragma once

#include <cstdint>

namespace ember {

constexpr int64_t kLinearBlock = 32;  // output columns per packed block

struct LinearArgs {
  const uint16_t* x;   // [rows, 2 * k2] bf16 bits, contiguous
  const float* xf;     // the same rows in fp32 (tiers that multiply in fp32), else nullptr
  const uint16_t* w;   // packed weight
  int64_t rows, k2, n;
  uint16_t* out;       // [rows, n] bf16 bits
};

struct LinearKernel {
  // Every row of output block `block`. `scratch` is this thread's scratch_floats(rows, k2) floats.
  void (*run_block)(const LinearArgs& a, int64_t block, float* scratch);
  int64_t (*scratch_floats)(int64_t rows, int64_t k2);
  bool fp32_input;  // run_block reads LinearArgs::xf
};

LinearKernel linear_kernel_avx2();
LinearKernel linear_kernel_avx512();
LinearKernel linear_kernel_avx512bf16();

}  // namespace ember
