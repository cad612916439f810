// Decode attention for one (request, KV head), written once over a vector type V (common/simd_*.h) and included by
// decode_attention_avx2.cpp and decode_attention_avx512.cpp inside their ISA's target region.
// Scores W keys at a time (one dot product per lane, finished by one transposing reduction), softmax numerators
// with a vector exp, then probs . V with the G query heads' accumulators in registers.
// The int8 and fp8 caches (T = int8_t or Fp8E4M3, decode_attention.h): each row is widened to fp32 in registers and
// its scale applied once per key: to the key's score after the dot product, and to the key's probability before it
// weights the value row.
// No std:: templates here (see linear/linear_bf16_body.h for why).
#pragma once

#include "attention/decode_attention.h"

namespace {

constexpr int64_t kAhead = 16;  // rows prefetched ahead: K/V rows sit at scattered slots the hardware can't predict

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T0);
}

template <class V>
struct AttentionBody {
  using F = typename V::F;
  static constexpr int W = V::W;

  template <int NC, typename T>  // head_dim = NC * W
  static void attend_one(const float* qf, int64_t G, const T* kp, const T* vp, const int32_t* slots, int64_t L,
                         int64_t kv_stride, int64_t kh, float* scores, float* out) {
    constexpr int64_t D = NC * W;
    constexpr int64_t kQ8 = ember::row_extra<T>();  // 4: int8 / fp8 caches, each row's fp32 scale after its values
    constexpr int64_t RB = (D + kQ8) * sizeof(T);  // a row's bytes, what the prefetches cover
    const int64_t Lp = (L + 15) / 16 * 16;
    auto row = [&](const T* base, int64_t l) {
      return base + static_cast<int64_t>(slots[l]) * kv_stride + kh * (D + kQ8);
    };
    F dots[W];
    float kscale[W];
    for (int64_t l0 = 0; l0 < L; l0 += W) {  // scores = q . k, W keys at a time
      const int64_t n = min64(W, L - l0);
      if constexpr (kQ8 != 0) {
        for (int64_t j = 0; j < W; ++j) kscale[j] = j < n ? ember::q8_scale(row(kp, l0 + j), D) : 0.f;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        for (int64_t j = 0; j < W; ++j) {
          if (j >= n) { dots[j] = V::zero(); continue; }
          const T* kr = row(kp, l0 + j);
          if (g == 0 && l0 + j + kAhead < L) prefetch_row(row(kp, l0 + j + kAhead), RB);
          F acc = V::mul(V::load(qg), V::load(kr));
          for (int c = 1; c < NC; ++c) acc = V::fma(V::load(qg + W * c), V::load(kr + W * c), acc);
          dots[j] = acc;
        }
        F sc = V::reduce_lanes(dots);
        if constexpr (kQ8 != 0) sc = V::mul(sc, V::load(kscale));
        V::store(scores + g * Lp + l0, sc);
      }
    }
    float* inv = scores + G * Lp;
    const F neg_inf = V::set1(-__builtin_inff());
    for (int64_t g = 0; g < G; ++g) {  // softmax numerators in place; the 1 / sum is applied to the output
      float* sg = scores + g * Lp;
      F m = neg_inf;
      for (int64_t l0 = 0; l0 < L; l0 += W) m = V::max(m, V::first_n(V::load(sg + l0), L - l0, neg_inf));
      const F mx = V::set1(V::hmax(m));
      F sum = V::zero();
      for (int64_t l0 = 0; l0 < L; l0 += W) {
        const F e = V::first_n(V::exp(V::sub(V::load(sg + l0), mx)), L - l0, V::zero());
        V::store(sg + l0, e);
        sum = V::add(sum, e);
      }
      inv[g] = 1.0f / V::hsum(sum);
    }
    // out = probs . V, for GC heads at a time so their accumulators stay in registers.
    constexpr int64_t kAccRegs = V::kRegisters / 2;
    constexpr int64_t GC = NC >= kAccRegs ? 1 : kAccRegs / NC;
    for (int64_t g0 = 0; g0 < G; g0 += GC) {
      const int64_t gn = min64(GC, G - g0);
      F acc[GC][NC];
      for (int64_t g = 0; g < GC; ++g)
        for (int c = 0; c < NC; ++c) acc[g][c] = V::zero();
      for (int64_t l = 0; l < L; ++l) {
        if (l + kAhead < L) prefetch_row(row(vp, l + kAhead), RB);
        const T* vr = row(vp, l);
        float vscale = 1.f;
        if constexpr (kQ8 != 0) vscale = ember::q8_scale(vr, D);
        for (int64_t g = 0; g < GC; ++g) {
          if (g >= gn) break;
          const F p = V::set1(kQ8 != 0 ? scores[(g0 + g) * Lp + l] * vscale : scores[(g0 + g) * Lp + l]);
          for (int c = 0; c < NC; ++c) acc[g][c] = V::fma(p, V::load(vr + W * c), acc[g][c]);
        }
      }
      for (int64_t g = 0; g < gn; ++g) {
        const F s = V::set1(inv[g0 + g]);
        for (int c = 0; c < NC; ++c) V::store(out + (g0 + g) * D + W * c, V::mul(acc[g][c], s));
      }
    }
  }

  template <typename T>
  static ember::AttendOne<T> for_head_dim(int64_t D) {
    if (D % W != 0) return nullptr;
    switch (D / W) {  // the head sizes of the model families Ember serves: 32, 64, 80, 96, 128, 256
      case 2: return attend_one<2, T>;
      case 4: return attend_one<4, T>;
      case 5: return attend_one<5, T>;
      case 6: return attend_one<6, T>;
      case 8: return attend_one<8, T>;
      case 10: return attend_one<10, T>;
      case 12: return attend_one<12, T>;
      case 16: return attend_one<16, T>;
      case 32: return attend_one<32, T>;
      default: return nullptr;  // other head sizes take the portable loop
    }
  }

  static ember::AttentionKernels kernels() {
    return {for_head_dim<float>, for_head_dim<Bf16>, for_head_dim<Half>, for_head_dim<int8_t>, for_head_dim<Fp8E4M3>};
  }
};

}  // namespace
