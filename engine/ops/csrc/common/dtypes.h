// Storage types the kernels read, layout-compatible with c10::BFloat16 and c10::Half (2 bytes, raw bits), so the
// ISA-specific files need no ATen header. ISA: none.
#pragma once

#include <cstdint>

namespace ember {
struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };
struct Fp8E4M3 { uint8_t bits; };  // c10::Float8_e4m3fn's layout (the fp8 KV cache)
}  // namespace ember

using ember::Bf16;
using ember::Half;
using ember::Fp8E4M3;

namespace {  // internal linkage: each ISA's file compiles its own copy (see linear_fma_body.h)

// The bits of f rounded to bf16, to nearest even as torch rounds (finite values).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The value of bf16 bits b.
inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace
