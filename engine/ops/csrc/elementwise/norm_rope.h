// The interface between ember::rms_norm's and ember::rope's driver (fused_rows.cpp) and their per-ISA bf16 row
// kernels (norm_rope_<isa>.cpp over norm_rope_body.h). ISA: none.
#pragma once

#include <cstdint>

namespace ember {

// One bf16 row of n values (bf16 bits): out = bf16(w * bf16(x * inv)), inv = 1 / sqrt(mean(x^2) + eps), the sum of
// squares in fp32 (in the vector lanes' order).
using RmsNormRow = void (*)(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps);
// One bf16 head of d values rotated by one token's cos / sin rows (rot values, even, <= d): the first rot values as
// rotate-half pairs (i, i + rot / 2), out[i] = bf16(bf16(x[i] cos[i]) + bf16(rot_half(x)[i] sin[i])), as torch
// rounds each op; the rest copied.
using RopeHead = void (*)(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* out, int64_t rot,
                          int64_t d);

struct RowKernels {
  RmsNormRow rms_norm;
  RopeHead rope;
};

RowKernels row_kernels_avx512();
RowKernels row_kernels_avx2();

}  // namespace ember
