// ember::rms_norm's and ember::rope's bf16 row kernels over a vector policy V (common/simd_<isa>.h: W fp32 lanes,
// load, round_bf16, store_bf16). Include inside the ISA's target region, after <cmath> and simd_<isa>.h. The scalar
// tails round as the vector lanes do.
#pragma once

#include "elementwise/norm_rope.h"

namespace {

inline float round_f32(float f) { return bf16_value(bf16_bits(f)); }  // (common/dtypes.h)

template <class V>
struct NormRope {
  using F = typename V::F;
  static constexpr int W = V::W;

  static F load(const uint16_t* p) { return V::load(reinterpret_cast<const Bf16*>(p)); }

  static void rms_norm(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
    F a0 = V::zero(), a1 = V::zero();
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
      const F v0 = load(x + i), v1 = load(x + i + W);
      a0 = V::fma(v0, v0, a0);
      a1 = V::fma(v1, v1, a1);
    }
    for (; i + W <= n; i += W) {
      const F v = load(x + i);
      a0 = V::fma(v, v, a0);
    }
    float ss = V::hsum(V::add(a0, a1));
    for (int64_t j = i; j < n; ++j) ss += bf16_value(x[j]) * bf16_value(x[j]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const F vinv = V::set1(inv);
    for (i = 0; i + W <= n; i += W)
      V::store_bf16(out + i, V::mul(load(w + i), V::round_bf16(V::mul(load(x + i), vinv))), W);
    for (; i < n; ++i) out[i] = bf16_bits(bf16_value(w[i]) * round_f32(bf16_value(x[i]) * inv));
  }

  static void rope(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* o, int64_t rot, int64_t d) {
    const int64_t half = rot / 2;
    for (int h = 0; h < 2; ++h) {  // h = 0: rot_half(x)[i] = -x[i + half]; h = 1: x[i - half]
      const int64_t at = h * half, from = h == 0 ? half : -half;
      int64_t i = 0;
      for (; i + W <= half; i += W) {
        const int64_t k = at + i;
        const F a = V::round_bf16(V::mul(load(x + k), load(c + k)));
        F r = load(x + k + from);
        if (h == 0) r = V::mul(r, V::set1(-1.0f));  // -x, zeros' signs included
        V::store_bf16(o + k, V::add(a, V::round_bf16(V::mul(r, load(s + k)))), W);
      }
      for (; i < half; ++i) {
        const int64_t k = at + i;
        const float r = h == 0 ? -bf16_value(x[k + from]) : bf16_value(x[k + from]);
        o[k] = bf16_bits(round_f32(bf16_value(x[k]) * bf16_value(c[k])) + round_f32(r * bf16_value(s[k])));
      }
    }
    for (int64_t i = rot; i < d; ++i) o[i] = x[i];
  }
};

}  // namespace
