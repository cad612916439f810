// ember::linear_gguf in portable C++: the reference the SIMD kernels are tested against, the kernel of the scalar
// tier, and the exact dequantizer behind ember::gguf_rows. Same integer math as linear_gguf_body.h (int8
// activations, integer dots per sub-block, offsets and mins through the activations' per-16 sums), summed in a
// plain order. ISA: none (generic x86-64).
#include <cmath>
#include <cstring>

#include "common/dtypes.h"
#include "linear_gguf/linear_gguf.h"

namespace {

using ember::GgufLinearArgs;

float half_to_float(const uint8_t* p) {  // little-endian fp16 at p
  const uint16_t h = static_cast<uint16_t>(p[0] | (p[1] << 8));
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  } else {
    const uint32_t bits = (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &bits, 4);
  }
  return sign ? -f : f;
}

// One block's codes as stored (before any offset), its scales, and how values follow from them.
struct Block {
  int q[256];
  float d = 0, m = 0;  // d, and m (Q4_1 / Q5_1) or dmin (Q4_K / Q5_K)
  int sc[16] = {}, mn[8] = {};  // sub-block scales (8 per 32 values; Q6_K: 16 per 16), mins
  int off = 0;                  // code offset: value = d * (q - off)
};

// Q4_K / Q5_K's 12 bytes: sc[0..3], mn[0..3] in the low 6 bits of bytes 0-3 / 4-7; sc[4..7] (mn[4..7]) in the low
// (high) nibbles of bytes 8-11 with their top 2 bits in the top 2 bits of bytes 0-3 (4-7).
void k_scales(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

void decode(int64_t t, const uint8_t* b, Block& o) {
  using namespace ember;
  auto nibbles = [](const uint8_t* qs, int bytes, int width, int* q) {  // per width bytes: low nibbles, then high
    for (int c = 0; c < bytes / width; ++c)
      for (int i = 0; i < width; ++i) {
        q[2 * c * width + i] = qs[c * width + i] & 0xF;
        q[2 * c * width + width + i] = qs[c * width + i] >> 4;
      }
  };
  switch (t) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: {
      const bool min = t == kQ4_1 || t == kQ5_1, five = t == kQ5_0 || t == kQ5_1;
      o.d = half_to_float(b);
      o.m = min ? half_to_float(b + 2) : 0.0f;
      const uint8_t* qs = b + (min ? 4 : 2) + (five ? 4 : 0);
      nibbles(qs, 16, 16, o.q);
      if (five) {
        uint32_t qh;
        std::memcpy(&qh, b + (min ? 4 : 2), 4);
        for (int i = 0; i < 32; ++i) o.q[i] |= ((qh >> i) & 1) << 4;
      }
      o.off = min ? 0 : five ? 16 : 8;
      break;
    }
    case kQ8_0:
      o.d = half_to_float(b);
      for (int i = 0; i < 32; ++i) o.q[i] = static_cast<int8_t>(b[2 + i]);
      break;
    case kQ4_K: case kQ5_K: {
      o.d = half_to_float(b);
      o.m = half_to_float(b + 2);
      k_scales(b + 4, o.sc, o.mn);
      nibbles(b + (t == kQ5_K ? 48 : 16), 128, 32, o.q);
      if (t == kQ5_K)  // value 32 c + l: bit c of qh[l]
        for (int i = 0; i < 256; ++i) o.q[i] |= ((b[16 + i % 32] >> (i / 32)) & 1) << 4;
      break;
    }
    case kQ6_K:  // per half of 128: value 32 j + l = nibble of ql[l + 32 (j % 2)] | bits 2j.. of qh[l]
      o.d = half_to_float(b + 208);
      for (int i = 0; i < 16; ++i) o.sc[i] = static_cast<int8_t>(b[192 + i]);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l) {
            const uint8_t ql = b[64 * h + 32 * (j % 2) + l], qh = b[128 + 32 * h + l];
            o.q[128 * h + 32 * j + l] = ((j < 2 ? ql & 0xF : ql >> 4) | (((qh >> (2 * j)) & 3) << 4));
          }
      o.off = 32;
      break;
  }
}

void run_block(const GgufLinearArgs& a, int64_t block, float*) {
  using namespace ember;
  const GgufTypeInfo ti = gguf_type_info(a.qtype);
  const int64_t k = a.k, nb = k / ti.values, row_bytes = nb * ti.bytes, n0 = block * kGgufBlockRows;
  const int64_t n1 = n0 + kGgufBlockRows < a.n ? n0 + kGgufBlockRows : a.n;
  const bool kq = ti.values == 256;
  Block blk;
  uint8_t tmp[256];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < a.rows; ++m) {
      const int8_t* xq = a.x.q + m * a.x.ldq;
      const int16_t* bs = a.x.bsum + m * (k / 16);
      float y = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        decode(a.qtype, gguf_row_block(a.qtype, a.w, row_bytes, n, b, tmp), blk);
        const int8_t* x = xq + b * ti.values;
        const int16_t* s = bs + b * ti.values / 16;
        const float xd = a.x.d[m * nb + b];
        if (!kq) {
          const int sum = s[0] + s[1];
          int dot = 0;
          for (int i = 0; i < 32; ++i) dot += blk.q[i] * x[i];
          y += blk.d * xd * static_cast<float>(dot - blk.off * sum);
          if (a.qtype == kQ4_1 || a.qtype == kQ5_1) y += blk.m * (xd * static_cast<float>(sum));
        } else if (a.qtype == kQ6_K) {
          int isum = 0;
          for (int j = 0; j < 16; ++j) {
            int dot = 0;
            for (int i = 16 * j; i < 16 * j + 16; ++i) dot += blk.q[i] * x[i];
            isum += blk.sc[j] * (dot - 32 * s[j]);
          }
          y += blk.d * xd * static_cast<float>(isum);
        } else {
          int isum = 0, msum = 0;
          for (int j = 0; j < 8; ++j) {
            int dot = 0;
            for (int i = 32 * j; i < 32 * j + 32; ++i) dot += blk.q[i] * x[i];
            isum += blk.sc[j] * dot;
            msum += blk.mn[j] * (s[2 * j] + s[2 * j + 1]);
          }
          y += blk.d * xd * static_cast<float>(isum) - blk.m * xd * static_cast<float>(msum);
        }
      }
      if (a.out_bf16) static_cast<uint16_t*>(a.out)[m * a.n + n] = bf16_bits(y);
      else static_cast<float*>(a.out)[m * a.n + n] = y;
    }
  }
}

}  // namespace

void ember::gguf_dequant_row(int64_t qtype, const uint8_t* w, int64_t n, int64_t k, float* out) {
  const GgufTypeInfo ti = gguf_type_info(qtype);
  Block blk;
  uint8_t tmp[256];
  for (int64_t b = 0; b < k / ti.values; ++b) {
    decode(qtype, gguf_row_block(qtype, w, k / ti.values * ti.bytes, n, b, tmp), blk);
    float* o = out + b * ti.values;
    for (int i = 0; i < ti.values; ++i) {  // gguf's operand order; every product here is exact in fp32
      const float q = static_cast<float>(blk.q[i] - blk.off);
      switch (qtype) {
        case kQ4_1: case kQ5_1: o[i] = blk.d * q + blk.m; break;
        case kQ4_K: case kQ5_K:
          o[i] = blk.d * static_cast<float>(blk.sc[i / 32]) * q - blk.m * static_cast<float>(blk.mn[i / 32]);
          break;
        case kQ6_K: o[i] = blk.d * static_cast<float>(blk.sc[i / 16]) * q; break;
        default: o[i] = blk.d * q;
      }
    }
  }
}

// No fp32 tile path: the scalar tier runs the integer reference at every row count.
ember::GgufKernel ember::linear_gguf_kernel_scalar(int64_t) {
  return {run_block, nullptr, 0, ember::kGgufTileMinRows};  // offsets applied to whole dots, not per lane
}
