// The interface between ember::silu_mul's driver (fused_rows.cpp) and its per-ISA row kernels (silu_mul_<isa>.cpp).
// ISA: none.
#pragma once

#include <cstdint>

namespace ember {

// out[i] = bf16(table[gate[i]] * up[i]) for i < n (bf16 bits): gate and up one row's halves of the fused gate|up
// projection, table[b] = torch's bf16 silu of the bf16 value with bits b (65536 entries and one more, so that a
// 4-byte gather at the last one stays inside). Returns how many it did (a multiple of the vector width; the driver
// does the rest).
using SiluMulRow = int64_t (*)(const uint16_t* gate, const uint16_t* up, const uint16_t* table, uint16_t* out,
                               int64_t n);

SiluMulRow silu_mul_row_avx512();
SiluMulRow silu_mul_row_avx2();

}  // namespace ember
