// ember::read_bandwidth: the STREAM-like baseline the linear kernels' benchmarks compare against (a multi-threaded
// sequential read of a buffer, every byte loaded into vector registers and folded into a sum so nothing is elided).
// ISA: none; the per-ISA read loops live in read_bandwidth_<isa>.cpp.
#pragma once

#include <cstdint>

namespace ember {

// Folds bytes [p, p + n) into one 64-bit value (n a multiple of 64 and p 64-byte aligned for the vector loops;
// the driver hands each thread such a slice).
uint64_t read_sum_avx2(const uint8_t* p, int64_t n);
uint64_t read_sum_avx512(const uint8_t* p, int64_t n);

}  // namespace ember
