// AVX2's 16-row kernels at a few activation rows, over linear_gguf_x16_dots.h's policy with two 8-row halves a
// group: both halves in one pass, so each 64-byte line is used whole as it arrives (the two half passes streamed the
// lines from memory in the first and re-read them from the cache in the second, the memory stream idle meanwhile)
// and each activation broadcast serves 16 rows. The integers and float operations per half are dot's / dot_q4k's, in
// their order: the same output bits. Included inside the ISA's target region, after linear_gguf_x16_dots.h.
#pragma once

#include "linear_gguf/linear_gguf_x16_dots.h"

namespace {

template <class P>
struct X16Both {
  using D = X16Dots<P>;
  using I = typename P::I;
  using F = typename P::F;
  static constexpr int L = P::L;

  // Q4_K, activation rows m < MT: res[16 m + r] = group row r (both halves) dotted with row m, with dot_q4k's
  // integers and float operations per half, in its order: the same bits as dot_q4k<MT> for h = 0 and 1.
  template <int MT>
  static void dot_q4k_both(const uint8_t* g, const GgufActs& x, int64_t k, float* res) {
    static_assert(L == 8 && P::kPairSums, "the 8-row-half (AVX2) policy");
    const int64_t nsb = k / 256;
    F acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = P::zero();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = g + sb * 16 * 144;
      D::prefetch(blk, 4 * 64);
      I scp[2][8], mnp[2][4];
      for (int h = 0; h < 2; ++h) D::q4k_scales(blk + 64 + 4 * L * h, scp[h], mnp[h]);
      I isum[MT][2];
      const uint8_t* qs = blk + 64 + 3 * 64;
      for (int j = 0; j < 4; ++j) {
        I plo[MT][2], phi[MT][2];  // vpmaddubsw pair sums of sub-blocks 2j / 2j + 1 (at most 8 x 3810: int16)
        for (int c = 0; c < 8; ++c) {
          const uint8_t* ch = qs + 64 * (8 * j + c);
          D::prefetch(ch, 64);
          for (int h = 0; h < 2; ++h) {
            const I q = P::load(ch + 4 * L * h);
            const I wl = P::and_(q, P::mask8(0x0F)), wh = P::and_(P::srli16_4(q), P::mask8(0x0F));
            for (int m = 0; m < MT; ++m) {
              const int8_t* xm = x.q + m * x.ldq + 256 * sb + 64 * j;
              const I lo = P::pairs(wl, D::x4(xm, c)), hi = P::pairs(wh, D::x4(xm + 32, c));
              plo[m][h] = c == 0 ? lo : P::add16(plo[m][h], lo);
              phi[m][h] = c == 0 ? hi : P::add16(phi[m][h], hi);
            }
          }
        }
        for (int m = 0; m < MT; ++m)
          for (int h = 0; h < 2; ++h) {
            const I t = P::add(P::madd16(plo[m][h], scp[h][2 * j]), P::madd16(phi[m][h], scp[h][2 * j + 1]));
            isum[m][h] = j == 0 ? t : P::add(isum[m][h], t);
          }
      }
      for (int h = 0; h < 2; ++h) {
        const F d = P::half(blk + 2 * L * h), dmin = P::half(blk + 32 + 2 * L * h);
        for (int m = 0; m < MT; ++m)
          acc[m][h] = D::scale_q4k(isum[m][h], d, dmin, mnp[h], x.s32 + m * (k / 32) + 8 * sb, x.d[m * nsb + sb],
                                   acc[m][h]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      P::storef(res + 16 * m, acc[m][0]);
      P::storef(res + 16 * m + L, acc[m][1]);
    }
  }

  // The same for the 32-value types (dot's integers and float operations per half, in its order).
  template <int T, int MT>
  static void dot_both(const uint8_t* g, const GgufActs& x, int64_t k, float* res) {
    static_assert(L == 8 && P::kPairSums, "the 8-row-half (AVX2) policy");
    constexpr bool q8 = T == ember::kQ8_0;
    constexpr int bb = D::template bytes<T>(), hd = T == ember::kQ4_1 ? 64 : 32;
    const int64_t nb = k / 32;
    F acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = P::zero();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * 16 * bb;
      D::prefetch(blk, hd);
      I s[MT][2];  // Q8_0: int32 dots; the 4-bit types: vpmaddubsw pair sums (at most 8 x 3810: int16)
      for (int c = 0; c < (q8 ? 8 : 4); ++c) {
        D::prefetch(blk + hd + 64 * c, 64);
        for (int h = 0; h < 2; ++h) {
          const I q = P::load(blk + hd + 64 * c + 4 * L * h);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xm = x.q + m * x.ldq + 32 * b;
            if constexpr (q8) {
              s[m][h] = P::dot8(c == 0 ? P::izero() : s[m][h], P::q8(q), D::x4(xm, c));
            } else {
              const I t = P::add16(P::pairs(P::and_(q, P::mask8(0x0F)), D::x4(xm, c)),
                                   P::pairs(P::and_(P::srli16_4(q), P::mask8(0x0F)), D::x4(xm, 4 + c)));
              s[m][h] = c == 0 ? t : P::add16(s[m][h], t);
            }
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        F dw, mw;
        D::template dm32<T>(blk, h, dw, mw);
        for (int m = 0; m < MT; ++m)
          acc[m][h] = D::template scale32<T>(q8 ? s[m][h] : P::widen(s[m][h]), dw, mw, x, m * nb + b, acc[m][h]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      P::storef(res + 16 * m, acc[m][0]);
      P::storef(res + 16 * m + L, acc[m][1]);
    }
  }

  using BothFn = void (*)(const uint8_t*, const GgufActs&, int64_t, float*);
  // Activation rows up to which the both-halves dots run (AVX2). AMX Xeon, forced avx2, ms a Llama-1B layer against
  // the two half passes (scripts/bench_linear.py --types Q4_K): 1.56-1.61 -> 1.33-1.43 at 1 row, 1.84-1.87 ->
  // 1.35-1.40 at 2, 2.11-2.15 -> 1.59-1.61 at 3, 2.33-2.38 -> 1.88-1.94 at 4; at 5 / 6 rows 3-7 % faster, at 8
  // rows 20 % slower (its accumulators no longer fit the 16 registers). The 32-value types gained likewise to 4.
  static constexpr int kBothRows = 4;

  template <int T, int MT>
  static constexpr BothFn pick_both() {
    if constexpr (T == ember::kQ4_K) return dot_q4k_both<MT>;
    else return dot_both<T, MT>;
  }

  template <int T, int MT>
  static BothFn both_for(int64_t mt) {
    if constexpr (MT == 1) return pick_both<T, 1>();
    else return mt == MT ? pick_both<T, MT>() : both_for<T, MT - 1>(mt);
  }

};

}  // namespace
