// Row strides for activations that a kernel reads one row of a tile after another. ISA: none; include only in
// generic driver files.
//
// The row-tile micro-kernels broadcast x[m][k] for each of up to 12 rows in turn. With a row stride that is a
// multiple of 4 KiB (every K from 2048 bf16 / 1024 fp32 values up) all those rows fall into one set of the 8-way L1
// and evict each other at every step. Measured on the Zen 4 EPYC (ember::linear_bf16, 2 threads, Llama-1B layers
// from DRAM, builds alternated): 308-335 -> 365-391 GFLOP/s at 32 rows and 356-387 -> 414-436 at 128 with the
// stride one cache line longer.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace ember {

constexpr int64_t kCacheLine = 64;

// The stride, in elements of elem_bytes, of a rows x k input: k for one row, else k plus one cache line.
inline int64_t row_stride(int64_t rows, int64_t k, int64_t elem_bytes) {
  return rows > 1 ? k + kCacheLine / elem_bytes : k;
}

// rows x k values at stride ld (the padding zeroed).
template <class T>
std::vector<T> with_stride(const T* src, int64_t rows, int64_t k, int64_t ld) {
  std::vector<T> out(rows * ld);
  for (int64_t m = 0; m < rows; ++m) std::memcpy(out.data() + m * ld, src + m * k, k * sizeof(T));
  return out;
}

}  // namespace ember
