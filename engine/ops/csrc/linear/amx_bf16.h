// AMX-BF16 tile micro-kernel shared by the many-row (prefill) paths of ember::linear_bf16 (linear_bf16_amx.cpp, on
// the packed weights as they are) and ember::linear_gguf (linear_gguf_amx.cpp, on blocks dequantized to bf16).
// Call only where cpu_has_amx_bf16() (common/cpu_isa.h); the implementation (amx_bf16.cpp) is compiled for
// AMX-TILE + AMX-BF16 + AVX512-BF16. ISA: none (this header).
//
// B operand: one 32-column block in linear.h's bf16 layout, [kc / 2, 32, 2] (row kk holds columns 0..31 of input
// pair (2 kk, 2 kk + 1), 128 bytes): exactly AMX's VNNI B layout, read as two 16-column tiles 64 bytes apart.
#pragma once

#include <cstdint>

namespace ember {

// Loads this thread's tile configuration (8 tiles of 16 rows x 64 bytes); every amx_bf16_block call of the thread
// must sit between amx_begin() and amx_end() (which releases the tiles: other code, oneDNN, configures its own).
void amx_begin();
void amx_end();
// Loads this thread's tile configuration with tile t of rows[t] rows x colsb[t] bytes (amx_begin's is 16 x 64 for
// all 8): for tile kernels of other shapes (linear_gguf/linear_gguf_amx8.h). Released by amx_end().
void amx_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]);

// c[m, 32] (fp32, row stride 32) = (first ? 0 : c) + a[m, kc] @ b[kc, 32] in bf16 products, fp32 sums.
// a: bf16 bits, row stride lda values, m a multiple of 16 (pad rows with zeros), kc a multiple of 32.
void amx_bf16_block(const uint16_t* a, int64_t lda, int64_t m, const uint16_t* b, int64_t kc, float* c, bool first);

// out[r, 0..ncols) = c[r, 0..ncols) for r < rows (c row stride 32), as fp32 or bf16 (round to nearest even);
// out row stride ldo values.
void amx_store_rows(const float* c, int64_t rows, int64_t ncols, void* out, int64_t ldo, bool bf16);

// dst[kk, r, 0..1] = bf16(src[r, 2 kk .. 2 kk + 1]) for r < 32, kk < kc / 2 (src row stride lds floats, kc a
// multiple of 32): 32 fp32 rows of K values to the B layout above, each value rounded to nearest even.
void amx_rows_to_vnni(const float* src, int64_t lds, int64_t kc, uint16_t* dst);

}  // namespace ember
