// ember::linear_q in portable C++: the reference the SIMD kernels are tested against, and the kernel of the scalar
// tier. Same arithmetic as linear_q_body.h (int16 activations per 32, integer block dots, fp32 scales), summed in a
// plain order. ISA: none (generic x86-64).
#include <cmath>
#include <cstring>

#include "common/dtypes.h"
#include "linear_q/linear_q.h"

namespace {

using ember::kQBlockRows;
using ember::QLayout;
using ember::QLinearArgs;

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    const uint32_t bits = sign | 0x7F800000u | (man << 13);
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    const uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &bits, 4);
  }
  return sign ? -f : f;
}

float scale_at(const void* p, bool f16, int64_t i) {
  return f16 ? half_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Value i of row r (0..3) of a packed 4-row group (linear_q.h).
int weight_at(const uint8_t* group, int bits, int64_t r, int64_t i) {
  const int64_t bpb = bits == 4 ? 16 : 32, at = (4 * (i / 32) + r) * bpb;
  if (bits == 8) return static_cast<int8_t>(group[at + i % 32]);
  const uint8_t byte = group[at + i % 16];
  return (i % 32) < 16 ? byte & 0xF : byte >> 4;
}

void run_block(const QLinearArgs& a, int64_t block, float*) {
  const QLayout& l = a.layout;
  const int64_t k = a.k, nb = k / 32, groups = k / l.group, n0 = block * kQBlockRows;
  const int64_t n1 = n0 + kQBlockRows < a.n ? n0 + kQBlockRows : a.n;
  const int64_t row_bytes = l.bits == 4 ? k / 2 : k, sub = l.group == 16 ? 16 : 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = a.w + (n / 4) * 4 * row_bytes;
    const int64_t r = n % 4, sg = (n / 4) * 4 * groups;  // the group's scales start
    for (int64_t m = 0; m < a.rows; ++m) {
      float y = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const float xd = a.xd[m * nb + b];
        for (int64_t s0 = 32 * b; s0 < 32 * (b + 1); s0 += sub) {  // one scale per `sub` inputs
          int32_t dot = 0;
          for (int64_t i = s0; i < s0 + sub; ++i) dot += weight_at(w, l.bits, r, i) * a.xq[m * k + i];
          y += scale_at(a.scales, l.f16_scales, sg + 4 * (s0 / l.group) + r) * xd * static_cast<float>(dot);
        }
      }
      if (l.has_min)
        for (int64_t g = 0; g < groups; ++g) y += scale_at(a.mins, l.f16_scales, sg + 4 * g + r) * a.xs[m * groups + g];
      if (a.out_bf16) static_cast<uint16_t*>(a.out)[m * a.n + n] = bf16_bits(y);
      else static_cast<float*>(a.out)[m * a.n + n] = y;
    }
  }
}

void quantize(const float* xf, const uint16_t* xb, int64_t rows, int64_t k, int16_t* xq, float* xd, float* xs) {
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float v[32], amax = 0.0f;
      for (int i = 0; i < 32; ++i) {
        const int64_t at = r * k + 32 * b + i;
        v[i] = xf != nullptr ? xf[at] : bf16_value(xb[at]);
        amax = std::fmax(amax, std::fabs(v[i]));
      }
      const float d = amax / ember::kQActMax, id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int q = static_cast<int>(std::nearbyint(v[i] * id));  // nearest even, as vcvtps2dq
        xq[r * k + 32 * b + i] = static_cast<int16_t>(q);
        sum += q;
      }
      xd[r * nb + b] = d;
      xs[r * nb + b] = d * static_cast<float>(sum);
    }
}

}  // namespace

// No fp32 tile path: the scalar tier runs the integer reference at every row count.
ember::QLinearKernel ember::linear_q_kernel_scalar(const QLayout&) { return {run_block, quantize, nullptr}; }
