// bf16 activations widened to fp32 for kernels that multiply in fp32 (the drivers of linear/ and linear_q/).
// ISA: none; include only in generic driver files (an inline copy compiled inside an ISA region could be merged
// into generic code by the linker).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace ember {

// fp32 copy of rows x k bf16 values, written at row stride ld (the padding zeroed): each is the 16 bits above 16
// zero bits.
inline std::vector<float> widen_bf16(const uint16_t* src, int64_t rows, int64_t k, int64_t ld) {
  std::vector<float> out(rows * ld);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[m * k + i]) << 16;
      std::memcpy(&out[m * ld + i], &bits, sizeof(float));
    }
  return out;
}

// The same for n values in one row.
inline std::vector<float> widen_bf16(const uint16_t* src, int64_t n) { return widen_bf16(src, 1, n, n); }

}  // namespace ember
