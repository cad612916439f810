// ember::linear_gguf's integer kernel for the 16-row layout (Q4_0, Q4_1, Q8_0; linear_gguf.h), written once over a
// policy P (linear_gguf_avx2.cpp, _avx512vnni.cpp):
//   P::I / P::F   integer / float vector of P::L rows, one row a 32-bit lane (AVX-512: 16 rows, AVX2: 8, so a group
//                 is 16 / L vectors)
//   P::load(p)    L * 4 bytes: one chunk's rows; P::half(p): L fp16 -> fp32
//   P::dot(acc, w, x4)  acc + per lane the 4 products of unsigned w bytes and the 4 signed activation bytes x4
//                 (vpdpbusd; vpmaddubsw + vpmaddwd + vpaddd); P::dot8 the same for Q8_0's codes as P::q8 made them
//   P::kPairSums  the 4-bit types' dots summed as vpmaddubsw's int16 pairs first (P::pairs, P::add16, P::widen)
//   P::kQ8Offset  Q8_0 made unsigned (codes + 128, the 128 sum(x) taken off through GgufActs::off) rather than
//                 dotted signed
// Each block (32 values) costs, per activation row, 8 dots and one scale FMA (two with Q4_1's min) for all 16 rows
// of a group: the 4-row layout's per-row float work was what bound its small batches (linear_gguf.h).
// Included inside the ISA's target region, after linear_gguf_body.h.
#pragma once

#include "linear_gguf/linear_gguf_body.h"

namespace {

template <class P>
struct X16Body {
  using I = typename P::I;
  using F = typename P::F;
  static constexpr int L = P::L, H = 16 / L;

  // The weight's byte offset past the scales, and Q8_0's 8 chunks or the 4-bit types' 4.
  template <int T> static constexpr int head() { return T == ember::kQ4_1 ? 64 : 32; }
  template <int T> static constexpr int bytes() { return T == ember::kQ4_0 ? 18 : T == ember::kQ4_1 ? 20 : 34; }

  // res[m * L + l] = row 16 g + L h + l dotted with activation row m (m < MT), the group starting at g.
  template <int T, int MT>
  static void dot(const uint8_t* g, int h, const GgufActs& x, int64_t k, float* res) {
    constexpr bool q8 = T == ember::kQ8_0, min = T == ember::kQ4_1;
    constexpr bool off = T == ember::kQ4_0 || (q8 && P::kQ8Offset);
    constexpr int bb = bytes<T>(), hd = head<T>(), NW = 8;
    constexpr int NA = MT < 4 ? 2 : 1;  // independent sums a row below 4 rows, so the dependent dots overlap
    const int64_t nb = k / 32;
    F acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = P::zero();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * 16 * bb;
      if (h == 0)  // the group's whole block, once (the other half hits the cache)
        for (int o = 0; o < 16 * bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + o), _MM_HINT_T0);
      const F dw = P::half(blk + 2 * L * h);
      F mw = dw;
      if constexpr (min) mw = P::mul(P::half(blk + 32 + 2 * L * h), P::set1(8.0f));  // msum is d sum(x) / 8
      I w[NW];  // the 8 vectors of 4 values: Q8_0's chunks, or the 4-bit chunks' low then high nibbles
      for (int c = 0; c < (q8 ? 8 : 4); ++c) {
        const I q = P::load(blk + hd + 64 * c + 4 * L * h);
        if constexpr (q8) {
          w[c] = P::q8(q);
        } else {
          w[c] = P::and_(q, P::mask8(0x0F));
          w[4 + c] = P::and_(P::srli16_4(q), P::mask8(0x0F));
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x.q + m * k + 32 * b;
        // w[c] holds values 4c..4c+3 (Q8_0), or 4c.. (c < 4) and 16 + 4(c - 4).. (4-bit)
        const auto x4 = [&](int c) {
          return g_load32(reinterpret_cast<const uint8_t*>(xm + (q8 || c < 4 ? 4 * c : 16 + 4 * (c - 4))));
        };
        I s[NA];
        if constexpr (P::kPairSums && !q8) {
          // vpmaddubsw pairs of 4-bit codes are at most 2 x 15 x 127 = 3810: the 8 chunks' pairs add up in int16
          // (30480) and widen once.
          I p = P::pairs(w[0], x4(0));
          for (int c = 1; c < NW; ++c) p = P::add16(p, P::pairs(w[c], x4(c)));
          s[0] = P::widen(p);
        } else {
          for (int a = 0; a < NA; ++a) s[a] = P::izero();
          for (int c = 0; c < NW; ++c) s[c % NA] = q8 ? P::dot8(s[c % NA], w[c], x4(c)) : P::dot(s[c % NA], w[c], x4(c));
          if constexpr (NA == 2) s[0] = P::add(s[0], s[1]);
        }
        if constexpr (off) s[0] = P::sub(s[0], P::set1i(x.off[m * nb + b]));
        acc[m] = P::fma(P::cvt(s[0]), P::mul(dw, P::set1(x.d[m * nb + b])), acc[m]);
        if constexpr (min) acc[m] = P::fma(mw, P::set1(x.msum[m * nb + b]), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) P::storef(res + m * L, acc[m]);
  }

  using DotFn = void (*)(const uint8_t*, int, const GgufActs&, int64_t, float*);

  template <int T, int MT>
  static DotFn dot_for(int64_t mt) {
    if constexpr (MT == 1) return dot<T, 1>;
    else return mt == MT ? dot<T, MT> : dot_for<T, MT - 1>(mt);
  }

  // Every row of output block `block` (two groups), activation rows in tiles of kRowTile sharing each decoded chunk.
  template <int T>
  static void run_block(const GgufLinearArgs& a, int64_t block, float*) {
    const int64_t k = a.k, nb = k / 32, group_bytes = 16 * nb * bytes<T>();
    const int64_t n0 = block * ember::kGgufBlockRows, n1 = g_min64(n0 + ember::kGgufBlockRows, a.n);
    float res[kRowTile * L];
    for (int64_t m0 = 0; m0 < a.rows; m0 += kRowTile) {
      const int64_t mt = g_min64(kRowTile, a.rows - m0);
      const DotFn fn = dot_for<T, kRowTile>(mt);
      const GgufActs x{a.x.q + m0 * k, a.x.d + m0 * nb, nullptr, a.x.off + m0 * nb, a.x.msum + m0 * nb, nullptr,
                       nullptr};
      for (int64_t gi = n0 / 16; gi < (n1 + 15) / 16; ++gi)
        for (int h = 0; h < H; ++h) {
          const int64_t r0 = 16 * gi + L * h;
          if (r0 >= n1) break;
          fn(a.w + gi * group_bytes, h, x, k, res);
          for (int64_t m = 0; m < mt; ++m)
            for (int64_t l = 0; l < L && r0 + l < n1; ++l) g_store(a, (m0 + m) * a.n + r0 + l, res[m * L + l]);
        }
    }
  }
};

}  // namespace
