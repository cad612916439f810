// The int8 activations of one ember::linear_gguf call: per row, per block of 32 (the 32-value types) or 256 values
// (K-quants), d = max|x| / 127 and q = round(x / d), with the per-16 and per-32 sums the kernels take (GgufActs).
// Portable C++, with AVX-512 and AVX2 versions that give the same values. ISA: none (the versions are in target
// regions of their own in quantize_acts.cpp, called only on their tiers).
#pragma once

#include <cstdint>
#include <vector>

#include "common/cpu_isa.h"

namespace ember {

struct QuantizedActs {  // a call's quantized activations; linear_gguf.h's GgufActs points into them
  std::vector<int8_t> q;
  int64_t ldq = 0;  // row stride of q (row_stride: padded when several rows share the call)
  std::vector<float> d, msum;
  std::vector<int16_t> bsum, s32;
  std::vector<int32_t> off;
  std::vector<int8_t> q32;  // the amx8 path's A tiles
  std::vector<float> kt;
  std::vector<int16_t> ktp;
};

// o = x (rows x k, fp32 in xf or bf16 in xb) quantized in blocks of qb; lane_offset: the kernel's GgufActs::off
// multiplier; isa: the tier, which picks the version (all give the same values).
void quantize_acts(const float* xf, const uint16_t* xb, int64_t rows, int64_t k, int64_t qb, int lane_offset, Isa isa,
                   QuantizedActs& o);

}  // namespace ember
