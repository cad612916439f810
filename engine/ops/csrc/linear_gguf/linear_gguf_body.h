// ember::linear_gguf's integer kernels, written once over a policy V (linear_gguf_avx2.cpp, _avx512vnni.cpp):
//   V::I / V::F   integer / float vector holding V::R rows' 32 bytes each (AVX2: 1 row in a ymm; AVX-512: 2 in a zmm)
//   V::rows(f)    the vector of rows f(0), f(1).. (256-bit each); V::xload(p): 32 activation bytes in every row slot
//   V::dot(w, x)  unsigned w bytes x signed x bytes -> int32 lanes, lane i = 4 products (vpmaddubsw + vpmaddwd with
//                 ones; vpdpbusd). V::dot_sc_acc(acc, w, x, s): acc + the pairs of products scaled by int16 s
//                 (vpmaddubsw + vpmaddwd + vpaddd; vpmaddubsw + vpdpwssd with VNNI)
// Lane layout, the same in both: a row's 32 bytes give 8 int32 lanes, lanes 0-3 its values 0-15, lanes 4-7 16-31.
// Offsets ride on that: subtracting sum(x) * o from each of a row's 8 lanes removes 8 o sum(x) from their total.
//
// No int16 overflow (vpmaddubsw saturates): pairs of code x |x| <= 127 are at most 2 * 63 * 127 = 16002 (Q6_K's 6
// bits; Q8_0 on AVX2 moves its sign onto x first: 2 * 128 * 127 = 32512); the int32 sums stay below 2^27.
// Included inside the ISA's target region, after every standard header; internal linkage throughout (see
// linear_fma_body.h for why no std:: templates).
#pragma once

#include "common/dtypes.h"
#include "linear_gguf/linear_gguf_decode.h"

namespace {

using ember::GgufActs;
using ember::GgufLinearArgs;

constexpr int kRowTile = ember::kGgufRowTile;
// Bytes ahead of the weight stream (one per thread) to prefetch. Measured at 1 row, 1 thread, 8 Llama-1B layers
// from DRAM (Q4_K / Q8_0, AMX Xeon): none 7.5 / 9.9 GB/s, 512: 7.7 / 9.3, 2048: 9.4 / 10.4, 4096: 8.4 / 9.7.
constexpr int kPrefetch = 2048;

inline int64_t g_min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The `bytes` of the weight stream kPrefetch ahead of p, into L1, a line at a time.
inline void g_prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + o), _MM_HINT_T0);
}

inline void g_store(const GgufLinearArgs& a, int64_t at, float y) {
  if (a.out_bf16) static_cast<uint16_t*>(a.out)[at] = bf16_bits(y);
  else static_cast<float*>(a.out)[at] = y;
}

template <class V>
struct GgufBody {
  using I = typename V::I;
  using F = typename V::F;
  static constexpr int R = V::R;

  static void prefetch(const uint8_t* p, int64_t bytes) { g_prefetch(p, bytes); }

  // res[r * MT + m] = row r0 + r of group g (NR rows) dotted with activation rows 0..MT-1, 32-value types.
  template <int T, int MT, int NR>
  static void dot32(const uint8_t* g, int64_t r0, const GgufActs& x, int64_t k, float* res) {
    using L = Layout32<T>;
    constexpr int NV = NR / R, bb = L::bytes;
    constexpr bool off = L::code_offset != 0 || (T == ember::kQ8_0 && V::kQ8Offset);
    const int64_t nb = k / 32;
    F acc[NV][MT];
    for (int v = 0; v < NV; ++v)
      for (int m = 0; m < MT; ++m) acc[v][m] = V::zero();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + (4 * b + r0) * bb;
      if (r0 == 0) prefetch(blk, 4 * bb);  // the group's whole stride, once (the other passes hit the cache)
      for (int v = 0; v < NV; ++v) {
        const uint8_t* rb = blk + v * R * bb;
        const I w = V::rows([&](int r) { return g_decode32<T, V>(rb + r * bb); });
        const F dw = V::rowsf([&](int r) { return g_half(rb + r * bb); });
        const F mw = L::min ? V::rowsf([&](int r) { return g_half(rb + r * bb + 2); }) : dw;
        for (int m = 0; m < MT; ++m) {
          const I xv = V::xload(x.q + m * x.ldq + 32 * b);
          I dot = T == ember::kQ8_0 ? V::dot_s8(w, xv) : V::dot(w, xv);
          if constexpr (off) dot = V::sub(dot, V::set1i(x.off[m * nb + b]));
          acc[v][m] = V::fma(V::cvt(dot), V::mul(dw, V::set1(x.d[m * nb + b])), acc[v][m]);
          if constexpr (L::min) acc[v][m] = V::fma(mw, V::set1(x.msum[m * nb + b]), acc[v][m]);
        }
      }
    }
    for (int v = 0; v < NV; ++v)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) res[(v * R + r) * MT + m] = V::hsum_row(acc[v][m], r);
  }

  // The same for K-quants: integer sums over a 256-value block (sub-scales in vpmaddwd), then one float scaling.
  // W, the wide path (256-bit policy, many rows): each block's sums are first totalled exactly, as integers, and
  // every output takes the same two FMAs a block whatever its tile: y += float(sum) (d xd) + float(mins sum)
  // (-dmin xd). A full 8-row tile does them with the rows in the lanes (8 integer sums reduced to one vector, the
  // mins sums from GgufActs::ktp's pairs, the scales from kt): one float accumulator instead of 8 vectors, so the
  // sums and the decoded weights stay in registers. A smaller tile (the tail) does them on scalars, with the same
  // result, so a row's result does not depend on its batch on this path either.
  template <int T, int MT, int NR, bool W>
  static void dotk(const uint8_t* g, int64_t r0, const GgufActs& x, int64_t k, float* res) {
    constexpr int NV = NR / R, bb = T == ember::kQ4_K ? 144 : T == ember::kQ5_K ? 176 : 210;
    constexpr bool exact = W && R == 1, lanes = exact && NR == 1 && MT == kRowTile;
    const int64_t nsb = k / 256;
    F acc[NV][MT];
    for (int v = 0; v < NV; ++v)
      for (int m = 0; m < MT; ++m) acc[v][m] = V::zero();
    F acc_m = V::zero();        // lanes: lane m, row r0's output for activation row m
    float acc_s[NV][MT] = {};   // exact, smaller tiles
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = g + (4 * sb + r0) * bb;
      // The group's block is prefetched a piece at a time as it is read (Q6_K's 840 bytes in quarters, Q5_K's 704
      // in 4 NV pieces), not in one burst at its start: see the Q6_K branch.
      const int8_t* xq = x.q + 256 * sb;
      const int16_t* xs = x.bsum + 16 * sb;
      for (int v = 0; v < NV; ++v) {
        const uint8_t* rb = blk + v * R * bb;
        // Two accumulators a row below 4 rows, so the dependent sub-scaled dots (one vpdpwssd each on AVX512-VNNI)
        // overlap; from 4 rows the rows themselves give the overlap and the registers are needed.
        constexpr int NA = MT < 4 ? 2 : 1;
        I isum[NA][MT];
        for (int a = 0; a < NA; ++a)
          for (int m = 0; m < MT; ++m) isum[a][m] = V::izero();
        if constexpr (T == ember::kQ6_K) {
          const I table = V::rows([&](int r) { return g_q6_table(rb + r * bb + 192); });
          for (int h = 0; h < 2; ++h) {
            // The group's 840 bytes a block in quarters, one as each (rows, half) starts, not in one burst: AMX
            // Xeon, ms a layer of Llama-3B shapes, one row, against the burst: AVX2 3.68-4.00 -> 3.14-3.59,
            // AVX-512 3.21-3.61 -> 3.17-3.54 (Llama-1B shapes 2.36 -> 2.00 and 2.11 -> 2.01).
            if (r0 == 0) prefetch(blk + (2 * v + h) * (2 * bb / NV), 2 * bb / NV);
            I c[4];
            V::q6_half(rb, bb, h, c);
            for (int j = 0; j < 4; ++j) {
              const I s = V::shuffle(table, V::pick(4 * h + j));
              for (int m = 0; m < MT; ++m)
                isum[j % NA][m] = V::dot_sc_acc(isum[j % NA][m], c[j], V::xload(xq + m * x.ldq + 128 * h + 32 * j), s);
            }
          }
          if constexpr (NA == 2)
            for (int m = 0; m < MT; ++m) isum[0][m] = V::add(isum[0][m], isum[1][m]);
          // codes are q + 32: take 32 sum_s sc_s bsum_s off
          const I scn = V::rows([&](int r) { return g_q6_natural(rb + r * bb + 192); });
          const F d = V::rowsf([&](int r) { return g_half(rb + r * bb + 208); });
          for (int m = 0; m < MT; ++m) {
            const I o = V::madd16(V::xload(reinterpret_cast<const int8_t*>(xs + m * (k / 16))), scn);
            isum[0][m] = V::sub(isum[0][m], V::slli32_5(o));
            if constexpr (!exact)
              acc[v][m] = V::fma(V::cvt(isum[0][m]), V::mul(d, V::set1(x.d[m * nsb + sb])), acc[v][m]);
          }
          if constexpr (lanes) {
            acc_m = V::fma(V::cvt(V::reduce8(isum[0])), V::mul(d, V::loadf(x.kt + 8 * sb)), acc_m);
          } else if constexpr (exact) {
            const float ds = g_half(rb + 208);
            for (int m = 0; m < MT; ++m)
              acc_s[v][m] = __builtin_fmaf(static_cast<float>(V::hsum_i(isum[0][m])), ds * x.d[m * nsb + sb],
                                           acc_s[v][m]);
          }
        } else {
          constexpr int qs = T == ember::kQ5_K ? 48 : 16;
          uint64_t sc[R], mn[R];
          for (int r = 0; r < R; ++r) g_k_scales(rb + r * bb + 4, sc[r], mn[r]);
          const I table = V::rows([&](int r) { return g_k_table(sc[r]); });
          I qh = V::izero();
          if constexpr (T == ember::kQ5_K) qh = V::rows([&](int r) { return g_load256(rb + r * bb + 16); });
          for (int j = 0; j < 4; ++j) {
            if (r0 == 0) prefetch(blk + (4 * v + j) * (bb / NV), bb / NV);
            const I q = V::rows([&](int r) { return g_load256(rb + r * bb + qs + 32 * j); });
            I lo = V::and_(q, V::mask8(0x0F)), hi = V::and_(V::srli16_4(q), V::mask8(0x0F));
            if constexpr (T == ember::kQ5_K) {
              lo = V::or_(lo, V::k5_high(qh, 2 * j));
              hi = V::or_(hi, V::k5_high(qh, 2 * j + 1));
            }
            const I s_lo = V::shuffle(table, V::pick(2 * j)), s_hi = V::shuffle(table, V::pick(2 * j + 1));
            for (int m = 0; m < MT; ++m) {
              const int8_t* xm = xq + m * x.ldq + 64 * j;
              isum[0][m] = V::dot_sc_acc(isum[0][m], lo, V::xload(xm), s_lo);
              isum[NA - 1][m] = V::dot_sc_acc(isum[NA - 1][m], hi, V::xload(xm + 32), s_hi);
            }
          }
          if constexpr (NA == 2)
            for (int m = 0; m < MT; ++m) isum[0][m] = V::add(isum[0][m], isum[1][m]);
          const F d = V::rowsf([&](int r) { return g_half(rb + r * bb); });
          const F dmin = V::rowsf([&](int r) { return -g_half(rb + r * bb + 2); });
          if constexpr (lanes) {
            const I m16 = g_k_table(mn[0]);  // the 8 mins as int16, in both halves
            const int16_t* pairs = x.ktp + 64 * sb;
            I ms = V::izero();
            for (int p = 0; p < 4; ++p)
              ms = V::add(ms, V::madd16(V::xload(reinterpret_cast<const int8_t*>(pairs + 16 * p)), V::pair(m16, p)));
            const F xd = V::loadf(x.kt + 8 * sb);
            acc_m = V::fma(V::cvt(V::reduce8(isum[0])), V::mul(d, xd), acc_m);
            acc_m = V::fma(V::cvt(ms), V::mul(dmin, xd), acc_m);
            continue;
          }
          const I mins = V::rows([&](int r) { return g_k_mins(mn[r]); });
          if constexpr (exact) {
            const float ds = g_half(rb), dmins = -g_half(rb + 2);
            for (int m = 0; m < MT; ++m) {
              const float xd = x.d[m * nsb + sb];
              const I ms = V::madd16(V::xload(reinterpret_cast<const int8_t*>(xs + m * (k / 16))), mins);
              const float y = __builtin_fmaf(static_cast<float>(V::hsum_i(isum[0][m])), ds * xd, acc_s[v][m]);
              acc_s[v][m] = __builtin_fmaf(static_cast<float>(V::hsum_i(ms)), dmins * xd, y);
            }
          } else {
            for (int m = 0; m < MT; ++m) {
              const F xd = V::set1(x.d[m * nsb + sb]);
              const I ms = V::madd16(V::xload(reinterpret_cast<const int8_t*>(xs + m * (k / 16))), mins);
              acc[v][m] = V::fma(V::cvt(isum[0][m]), V::mul(d, xd), acc[v][m]);
              acc[v][m] = V::fma(V::cvt(ms), V::mul(dmin, xd), acc[v][m]);
            }
          }
        }
      }
    }
    if constexpr (lanes) {
      V::storef(res, acc_m);
    } else if constexpr (exact) {
      for (int v = 0; v < NV; ++v)
        for (int m = 0; m < MT; ++m) res[v * MT + m] = acc_s[v][m];
    } else {
      for (int v = 0; v < NV; ++v)
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < MT; ++m) res[(v * R + r) * MT + m] = V::hsum_row(acc[v][m], r);
    }
  }

  using DotFn = void (*)(const uint8_t*, int64_t, const GgufActs&, int64_t, float*);

  template <int T, int MT, bool W>
  static DotFn dot_for(int64_t mt) {
    constexpr int nr = V::rows_per_pass(MT);
    DotFn f;
    // One activation row of a 32-value type: V's 256-bit sibling. On AVX512-VNNI, ymm vpdpbusd ran Q4_0 at 16 GB/s
    // per thread against 12 for zmm (L3-warm, 1 thread), whose inserts of two rows' decoded blocks and scales
    // cost more than the halved dots save; K-quants (one insert per 32 values of 4 rows) measured the same either way.
    using S = GgufBody<typename V::Single>;
    constexpr bool kq = T == ember::kQ4_K || T == ember::kQ5_K || T == ember::kQ6_K;
    if constexpr (MT == 1 && !kq) f = S::template dot32<T, 1, nr>;
    else if constexpr (kq) f = dotk<T, MT, nr, W>;
    else f = dot32<T, MT, nr>;
    if constexpr (MT == 1) return f;
    else return mt == MT ? f : dot_for<T, MT - 1, W>(mt);
  }

  // Every row of output block `block`, rows of x in tiles of kRowTile sharing each decoded weight vector; W: the
  // wide path (dotk).
  template <int T, bool W = false>
  static void run_block(const GgufLinearArgs& a, int64_t block, float*) {
    const ember::GgufTypeInfo ti = ember::gguf_type_info(T);
    const int64_t k = a.k, nblk = k / ti.values, row_bytes = nblk * ti.bytes;
    const int64_t n0 = block * ember::kGgufBlockRows, n1 = g_min64(n0 + ember::kGgufBlockRows, a.n);
    float res[4 * kRowTile];
    for (int64_t m0 = 0; m0 < a.rows; m0 += kRowTile) {
      const int64_t mt = g_min64(kRowTile, a.rows - m0), nr = V::rows_per_pass(static_cast<int>(mt));
      const DotFn dot = dot_for<T, kRowTile, W>(mt);
      const bool k32 = ti.values == 32;
      const GgufActs x{a.x.q + m0 * a.x.ldq, a.x.d + m0 * nblk, a.x.bsum + m0 * (k / 16),
                       k32 ? a.x.off + m0 * nblk : nullptr, k32 ? a.x.msum + m0 * nblk : nullptr,
                       W && mt == kRowTile ? a.x.kt + m0 * nblk : nullptr,
                       W && mt == kRowTile ? a.x.ktp + m0 * nblk * 8 : nullptr, nullptr, a.x.ldq};
      for (int64_t gi = n0 / 4; gi < (n1 + 3) / 4; ++gi) {
        for (int64_t r0 = 0; r0 < 4; r0 += nr) dot(a.w + gi * 4 * row_bytes, r0, x, k, res + r0 * mt);
        for (int64_t r = 0; r < 4 && gi * 4 + r < n1; ++r)
          for (int64_t m = 0; m < mt; ++m) g_store(a, (m0 + m) * a.n + gi * 4 + r, res[r * mt + m]);
      }
    }
  }
};

}  // namespace
