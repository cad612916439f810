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
