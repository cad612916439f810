// ember::linear_gguf's integer dots for the 16-row layout (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; linear_gguf.h), written
// once over a policy P (linear_gguf_avx2.cpp, _avx512vnni.cpp):
//   P::I / P::F   integer / float vector of P::L rows, one row a 32-bit lane (AVX-512: 16 rows, AVX2: 8, so a group
//                 is 16 / L vectors)
//   P::load(p)    L * 4 bytes: one chunk's rows; P::half(p): L fp16 -> fp32
//   P::dot(acc, w, x4)  acc + per lane the 4 products of unsigned w bytes and the 4 signed activation bytes x4
//                 (vpdpbusd; vpmaddubsw + vpmaddwd + vpaddd); P::dot8 the same for Q8_0's codes as P::q8 made them
//   P::kPairSums  the 4-bit types' dots summed as vpmaddubsw's int16 pairs first (P::pairs, P::add16, P::widen)
//   P::kQ8Offset  Q8_0 made unsigned (codes + 128, the 128 sum(x) taken off through GgufActs::off) rather than
//                 dotted signed
//   P::shuffle, lane_idx, srli16, or_, madd16  Q4_K's per-lane 6-bit scale and min unpacking (vpshufb), the mins'
//                 dot (vpmaddwd); its scales apply in int32 (P::mullo, or the pair sums' widening vpmaddwd)
//   P::slli16, srai16, srai32, slli32  Q6_K's high code bits moved into place, its signed scales widened
// Each block (32 values) costs, per activation row, 8 dots and one scale FMA (two with Q4_1's min) for all 16 rows
// of a group: the 4-row layout's per-row float work was what bound its small batches (linear_gguf.h).
// linear_gguf_x16_both.h runs AVX2's two halves of a group in one pass; linear_gguf_x16.h drives them.
// Included inside the ISA's target region, after linear_gguf_body.h.
#pragma once

#include "linear_gguf/linear_gguf_body.h"

namespace {

template <class P>
struct X16Dots {
  using I = typename P::I;
  using F = typename P::F;
  static constexpr int L = P::L, H = 16 / L;

  template <int T> static constexpr int bytes() { return ember::gguf_type_info(T).bytes; }
  template <int T> static constexpr int values() { return ember::gguf_type_info(T).values; }

  static void prefetch(const uint8_t* p, int bytes) { g_prefetch(p, bytes); }
  // Q6_K's lines, 4 KiB ahead into L2 (g_prefetch: 2 KiB into L1). Its blocks are 3360 bytes a group, and with
  // g_prefetch the kernel stalled on the prefetches themselves (perf: ~45 % of its samples after them, the L1's
  // outstanding misses full): Zen 4, 2 threads, ms a Llama-1B layer (scripts/bench_linear.py --types Q6_K) at 1 / 4
  // / 8 rows, 2.60 / 3.08 / 3.42 -> 1.35 / 1.69 / 2.36 (6 KiB: 1.69 / 1.81 / 2.22; none: 3.53 / 4.97 / 5.38).
  static void prefetch_l2(const uint8_t* p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + 4096 + o), _MM_HINT_T1);
  }

  static uint32_t x4(const int8_t* x, int c) { return g_load32(reinterpret_cast<const uint8_t*>(x + 4 * c)); }

  // kPairSums: per lane two int16 halves that add up to sum8's lane. vpmaddubsw pairs of 4-bit codes are at most
  // 2 x 15 x 127 = 3810, so 8 chunks' pairs add up in int16 (30480).
  static I pair_sum8(const I* w, const int8_t* x) {
    I p = P::pairs(w[0], x4(x, 0));
    for (int c = 1; c < 8; ++c) p = P::add16(p, P::pairs(w[c], x4(x, c)));
    return p;
  }

  // Per lane, the sum over c < 8 of unsigned w[c]'s 4 bytes times x[4c..4c+3] (4-bit codes: w <= 15), in int32.
  template <int NA>
  static I sum8(const I* w, const int8_t* x) {
    if constexpr (P::kPairSums) {
      return P::widen(pair_sum8(w, x));
    } else {
      I s[NA];
      for (int a = 0; a < NA; ++a) s[a] = P::izero();
      for (int c = 0; c < 8; ++c) s[c % NA] = P::dot(s[c % NA], w[c], x4(x, c));
      for (int a = 1; a < NA; ++a) s[0] = P::add(s[0], s[a]);
      return s[0];
    }
  }

  // sum8 times per-lane scales, exact in int32. kPairSums: the scale rides in the widening vpmaddwd (`sp` holds each
  // lane's scale in both int16 halves: no instruction more than sum8); else one vpmulld (`sp`: the scale).
  template <int NA>
  static I sum8_scaled(const I* w, const int8_t* x, I sp) {
    if constexpr (P::kPairSums) return P::madd16(pair_sum8(w, x), sp);
    else return P::mullo(sum8<NA>(w, x), sp);
  }

  // vpshufb index: in every 32-bit lane, byte i picks byte (pat >> 8 i) & 0xFF of that lane (0x80: a zero byte).
  static I lane_idx(uint32_t pat) { return P::add8(P::set1i(static_cast<int32_t>(pat)), P::lane_base()); }
  // A sub-block scale's 6 bits from byte b of each lane: as int16 pairs (b, b) for kPairSums, else as int32 b.
  static constexpr uint32_t scale_pat(uint32_t b) {
    return P::kPairSums ? b | 0x80u << 8 | b << 16 | 0x80u << 24 : b | 0x808080u << 8;
  }
  static constexpr uint32_t pair_pat(uint32_t b) { return b | 0x80u << 8 | (b + 1) << 16 | 0x80u << 24; }

  // ggml's get_scale_min_k4, per lane, from a half's 3 chunks of scale bytes at sc: sc[0..3] / mn[0..3] the low 6
  // bits of bytes 0-3 / 4-7; sc[4..7] (mn[4..7]) the low (high) nibbles of bytes 8-11 with the top 2 bits of bytes
  // 0-3 (4-7) above them. Each byte is moved into place by vpshufb, then masked; the upper scales and mins shift
  // their top 2 bits, from bits 6-7 of a 16-bit unit to 4-5. scp[8]: the scales as sum8_scaled takes them; mnp[4]:
  // int16 pairs (mn[2p], mn[2p + 1]) per lane, against the activations' (sum[2p], sum[2p + 1]).
  static void q4k_scales(const uint8_t* sc, I* scp, I* mnp) {
    const I u0 = P::load(sc), u1 = P::load(sc + 64), u2 = P::load(sc + 128);
    const I m6 = P::set1i(0x003F003F), m4 = P::set1i(0x000F000F), m2 = P::set1i(0x00300030);
    for (int b = 0; b < 4; ++b) {
      const I ib = lane_idx(scale_pat(b));
      scp[b] = P::and_(P::shuffle(u0, ib), m6);
      scp[4 + b] = P::or_(P::and_(P::shuffle(u2, ib), m4), P::and_(P::srli16(P::shuffle(u0, ib), 2), m2));
    }
    for (int p = 0; p < 2; ++p) {
      const I ip = lane_idx(pair_pat(2 * p));
      mnp[p] = P::and_(P::shuffle(u1, ip), m6);
      mnp[2 + p] = P::or_(P::and_(P::srli16(P::shuffle(u2, ip), 4), m4),
                          P::and_(P::srli16(P::shuffle(u1, ip), 2), m2));
    }
  }

  // Q4_K: acc + a block's share for one activation row: its exactly scaled integer sum isum times d xd, then the
  // mins term, dmin (-xd) sum_p mnp[p] . (the row's sums over 32 values, xs32).
  static F scale_q4k(I isum, F d, F dmin, const I* mnp, const int16_t* xs32, float xd, F acc) {
    acc = P::fma(P::cvt(isum), P::mul(d, P::set1(xd)), acc);
    const uint8_t* xs = reinterpret_cast<const uint8_t*>(xs32);
    const auto pair = [&](int p) { return P::madd16(mnp[p], P::set1i(static_cast<int32_t>(g_load32(xs + 4 * p)))); };
    I ms = pair(0);
    for (int p = 1; p < 4; ++p) ms = P::add(ms, pair(p));
    return P::fma(P::cvt(ms), P::mul(dmin, P::set1(-xd)), acc);
  }

  // A 32-value block's per-row fp16 d, and Q4_1's m times 8 (GgufActs::msum is d sum(x) / 8), of half h.
  template <int T>
  static void dm32(const uint8_t* blk, int h, F& dw, F& mw) {
    dw = mw = P::half(blk + 2 * L * h);
    if constexpr (T == ember::kQ4_1) mw = P::mul(P::half(blk + 32 + 2 * L * h), P::set1(8.0f));
  }

  // A 32-value block: acc + its share for one activation row (at: the row's block index) from the int32 dot s, less
  // Q4_0's offset (and Q8_0's, where P made its codes unsigned), times d_w d_x; plus Q4_1's min.
  template <int T>
  static F scale32(I s, F dw, F mw, const GgufActs& x, int64_t at, F acc) {
    if constexpr (T == ember::kQ4_0 || (T == ember::kQ8_0 && P::kQ8Offset)) s = P::sub(s, P::set1i(x.off[at]));
    acc = P::fma(P::cvt(s), P::mul(dw, P::set1(x.d[at])), acc);
    if constexpr (T == ember::kQ4_1) acc = P::fma(mw, P::set1(x.msum[at]), acc);
    return acc;
  }

  // res[m * L + l] = row 16 g + L h + l dotted with activation row m (m < MT), the group starting at g. 32-value
  // types: chunk c of a block holds values 4c.. (Q8_0), or 4c.. in its low nibbles and 16 + 4c.. in its high ones.
  template <int T, int MT>
  static void dot(const uint8_t* g, int h, const GgufActs& x, int64_t k, float* res) {
    constexpr bool q8 = T == ember::kQ8_0;
    constexpr int bb = bytes<T>(), hd = T == ember::kQ4_1 ? 64 : 32;
    constexpr int NA = MT < 4 ? 2 : 1;  // independent sums a row below 4 rows, so the dependent dots overlap
    const int64_t nb = k / 32;
    F acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = P::zero();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * 16 * bb;
      // The block's lines prefetched one at a time as its chunks are read (the other half hits the cache), as
      // dot_q4k does. AMX Xeon, ms a Llama-1B layer, against the whole block at its start: Q4_1 1.45-1.51 ->
      // 1.38-1.40 at 1 row, 1.84-2.00 -> 1.78-1.82 at 4 (AVX2 1.67-1.69 -> 1.55-1.59, 2.71 -> 2.44-2.50); Q8_0
      // 2.76-2.85 -> 2.67-2.70 at 4, 3.26-3.38 -> 3.13-3.24 at 8 (AVX2 3.42-3.45 -> 3.59-3.64 at 4, 5.46-5.53
      // -> 5.30-5.39 at 8).
      if (h == 0) prefetch(blk, hd);
      F dw, mw;
      dm32<T>(blk, h, dw, mw);
      I w[8];  // values 4c.. of the block: Q8_0's chunks, or the 4-bit chunks' low then high nibbles
      for (int c = 0; c < (q8 ? 8 : 4); ++c) {
        if (h == 0) prefetch(blk + hd + 64 * c, 64);
        const I q = P::load(blk + hd + 64 * c + 4 * L * h);
        if constexpr (q8) {
          w[c] = P::q8(q);
        } else {
          w[c] = P::and_(q, P::mask8(0x0F));
          w[4 + c] = P::and_(P::srli16_4(q), P::mask8(0x0F));
        }
      }
      if constexpr (!P::kPairSums && MT >= 4) {
        // Two rows at a time, their dots interleaved: a row's 8 dots are one dependent chain, and a row at a time
        // leaves the out-of-order window few independent dots (a loop of this shape alone: 1.43 -> 2.31 G dots/s on
        // a Zen 4 core). In the kernel, with the vector stores of linear_gguf_x16.h: 0.89-0.94x the time at 8-244
        // rows on SmolLM2's shapes, 0.89-1.00x on Llama-1B's (Zen 4, 2 threads, alternated in one process).
        // Each row's sum is the same chain as alone, so its bits do not change.
#pragma GCC unroll 16
        for (int m = 0; m < MT - 1; m += 2) {
          const int8_t* x0 = x.q + m * x.ldq + 32 * b;
          const int8_t* x1 = x0 + x.ldq;
          I s0 = P::izero(), s1 = P::izero();
          for (int c = 0; c < 8; ++c) {
            s0 = P::dot8(s0, w[c], g_load32(reinterpret_cast<const uint8_t*>(x0 + 4 * c)));
            s1 = P::dot8(s1, w[c], g_load32(reinterpret_cast<const uint8_t*>(x1 + 4 * c)));
          }
          acc[m] = scale32<T>(s0, dw, mw, x, m * nb + b, acc[m]);
          acc[m + 1] = scale32<T>(s1, dw, mw, x, (m + 1) * nb + b, acc[m + 1]);
        }
        if constexpr (MT % 2 == 1) {
          const int8_t* xm = x.q + (MT - 1) * x.ldq + 32 * b;
          I s = P::izero();
          for (int c = 0; c < 8; ++c) s = P::dot8(s, w[c], g_load32(reinterpret_cast<const uint8_t*>(xm + 4 * c)));
          acc[MT - 1] = scale32<T>(s, dw, mw, x, (MT - 1) * nb + b, acc[MT - 1]);
        }
        continue;
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x.q + m * x.ldq + 32 * b;
        I s;
        if constexpr (q8) {
          I t[NA];
          for (int a = 0; a < NA; ++a) t[a] = P::izero();
          for (int c = 0; c < 8; ++c)
            t[c % NA] = P::dot8(t[c % NA], w[c], g_load32(reinterpret_cast<const uint8_t*>(xm + 4 * c)));
          s = NA == 2 ? P::add(t[0], t[NA - 1]) : t[0];
        } else {
          s = sum8<NA>(w, xm);
        }
        acc[m] = scale32<T>(s, dw, mw, x, m * nb + b, acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) P::storef(res + m * L, acc[m]);
  }

  // The same for Q4_K: per 256-value block the rows' d and dmin, 3 chunks of their 12 scale bytes, then 32 chunks of
  // nibbles, chunk c's low nibbles values 64 (c / 8) + 4 (c % 8).. (sub-block 2 (c / 8)) and its high ones 32
  // further (sub-block 2 (c / 8) + 1). y = xd (d sum_s sc_s dot_s - dmin sum_s mn_s xsum_s): the dots and their
  // scaling are exact integers; the mins go through vpmaddwd with the activations' per-32 sums.
  template <int MT>
  static void dot_q4k(const uint8_t* g, int h, const GgufActs& x, int64_t k, float* res) {
    constexpr int bb = 144, NA = MT < 4 ? 2 : 1;
    // Each row's 8 scaled sub-block dots are summed exactly in int32 (|dot| <= 32 x 15 x 127, scales <= 63: under
    // 2^25 in all), then one conversion and one FMA a block instead of one of each per sub-block. Zen 4, 2 threads,
    // GFLOP/s over a 1B layer (scripts/bench_linear.py --types Q4_K): 438-452 -> 455-494 at 32 rows, 475-493 ->
    // 543-545 at 128, 300-322 -> 334-347 at 8, 366-373 -> 350-355 at 4. With the vpshufb unpacking (AMX Xeon, ms a
    // layer): AVX2 3.45-3.53 -> 3.20-3.41 at 8 rows, 12.97-13.05 -> 11.50-12.10 at 32; AVX-512 unchanged to 8
    // rows, 7.12-7.36 -> 6.67-7.04 at 32; one row unchanged on both. Every row count takes the same path: a row's
    // result must not depend on how many rows share its call.
    const int64_t nsb = k / 256;
    F acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = P::zero();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = g + sb * 16 * bb;
      // The group's 36 lines a block are prefetched as they are read, one line per chunk below, not in one burst
      // at the block's start: a burst of 36 outruns the core's line fill buffers and stalls the loads behind it.
      // AMX Xeon, 2 threads, Llama-1B layer from DRAM (scripts/bench_linear.py --types Q4_K): 1.49-1.51 ->
      // 1.26-1.39 ms at 1 row, 1.86 -> 1.50 at 4, 2.50-2.60 -> 2.07-2.14 at 8. Further ahead was slower: the
      // burst at 4096 or 8192 bytes ahead, 1.73-2.08 ms at 1 row; no prefetch at all 1.67.
      if (h == 0) prefetch(blk, 4 * 64);  // d, dmin and the scales
      const F d = P::half(blk + 2 * L * h), dmin = P::half(blk + 32 + 2 * L * h);
      I scp[8], mnp[4];
      q4k_scales(blk + 64 + 4 * L * h, scp, mnp);
      I isum[MT];
      const uint8_t* qs = blk + 64 + 3 * 64 + 4 * L * h;
      for (int j = 0; j < 4; ++j) {
        I w[16];  // the 8 chunks' low nibbles (sub-block 2j), then their high ones (2j + 1)
        for (int c = 0; c < 8; ++c) {
          if (h == 0) prefetch(qs + 64 * (8 * j + c), 64);
          const I q = P::load(qs + 64 * (8 * j + c));
          w[c] = P::and_(q, P::mask8(0x0F));
          w[8 + c] = P::and_(P::srli16_4(q), P::mask8(0x0F));
        }
        for (int m = 0; m < MT; ++m) {
          const int8_t* xm = x.q + m * x.ldq + 256 * sb + 64 * j;
          const I t = P::add(sum8_scaled<NA>(w, xm, scp[2 * j]), sum8_scaled<NA>(w + 8, xm + 32, scp[2 * j + 1]));
          isum[m] = j == 0 ? t : P::add(isum[m], t);
        }
      }
      for (int m = 0; m < MT; ++m)
        acc[m] = scale_q4k(isum[m], d, dmin, mnp, x.s32 + m * (k / 32) + 8 * sb, x.d[m * nsb + sb], acc[m]);
    }
    for (int m = 0; m < MT; ++m) P::storef(res + m * L, acc[m]);
  }

  // Q6_K's 16 int8 sub-block scales per lane, from its 4 scale chunks at sc (chunk c: scales 4c..4c+3): scp[s] as
  // sum4_scaled takes them (int32, or int16 pairs (s, s) for kPairSums), scpair[p] as int16 pairs (sc[2p],
  // sc[2p + 1]) for the offset's vpmaddwd. Each byte is moved to the top of its unit by vpshufb, then shifted down
  // arithmetically (the scales are signed).
  static void q6k_scales(const uint8_t* sc, I* scp, I* scpair) {
    for (int c = 0; c < 4; ++c) {
      const I u = P::load(sc + 64 * c);
      for (uint32_t i = 0; i < 4; ++i) {
        if constexpr (P::kPairSums)
          scp[4 * c + i] = P::srai16(P::shuffle(u, lane_idx(0x800080u | i << 8 | i << 24)), 8);
        else
          scp[4 * c + i] = P::srai32(P::shuffle(u, lane_idx(0x808080u | i << 24)), 24);
      }
      for (uint32_t p = 0; p < 2; ++p)
        scpair[2 * c + p] = P::srai16(P::shuffle(u, lane_idx(0x800080u | (2 * p) << 8 | (2 * p + 1) << 24)), 8);
    }
  }

  // Per lane, sc times the sum over c < 4 of w[c]'s 4 bytes (6-bit codes) times xs[4c..4c+3], exact in int32.
  // kPairSums: vpmaddubsw pairs two chunks at a time (2 x 2 x 63 x 127 = 32004 fits int16, four chunks would not),
  // each widened by the scale in vpmaddwd.
  static I sum4_scaled(const I* w, const int8_t* xs, I sc) {
    if constexpr (P::kPairSums) {
      const I a = P::add16(P::pairs(w[0], x4(xs, 0)), P::pairs(w[1], x4(xs, 1)));
      const I b = P::add16(P::pairs(w[2], x4(xs, 2)), P::pairs(w[3], x4(xs, 3)));
      return P::add(P::madd16(a, sc), P::madd16(b, sc));
    } else {
      I s = P::dot(P::izero(), w[0], x4(xs, 0));
      for (int c = 1; c < 4; ++c) s = P::dot(s, w[c], x4(xs, c));
      return P::mullo(s, sc);
    }
  }

  // Q6_K: acc + a block's share for one activation row, xd d (isum - 32 sum_s sc_s xsum_s), the offset's sums
  // (bs: the row's sums over 16 values) through vpmaddwd against the scale pairs.
  static F scale_q6k(I isum, F d, const I* scpair, const int16_t* bs, float xd, F acc) {
    const uint8_t* xs = reinterpret_cast<const uint8_t*>(bs);
    I off = P::madd16(scpair[0], P::set1i(static_cast<int32_t>(g_load32(xs))));
    for (int p = 1; p < 8; ++p)
      off = P::add(off, P::madd16(scpair[p], P::set1i(static_cast<int32_t>(g_load32(xs + 4 * p)))));
    return P::fma(P::cvt(P::sub(isum, P::slli32(off, 5))), P::mul(d, P::set1(xd)), acc);
  }

  // Q6_K, one 256-value block of half h of a group: acc[m] + its share for activation row m. The block holds the
  // rows' d, then 52 chunks: 4 of the scales, then per half hh of the block 16 of the low-nibble bytes ql and 8 of
  // the high-bit bytes qh (linear_gguf.h). Value 128 hh + 32 j + l is ql[64 hh + 32 (j % 2) + l]'s low (j < 2) or
  // high nibble with bits 2j, 2j + 1 of qh[32 hh + l] above it, so chunk 4 + 24 hh + 8 (j % 2) + l / 4 with chunk
  // 20 + 24 hh + l / 4 gives four values of j and of j + 2. y = xd d sum_s sc_s (dot_s - 32 xsum_s), all but the
  // last product exact in int32 (|dot_s| <= 16 x 63 x 127, |sc_s| <= 128: under 2^29 for the block), as the scalar
  // reference computes it.
  template <int MT>
  static void q6k_block(const uint8_t* blk, int h, const GgufActs& x, int64_t k, int64_t sb, F* acc) {
    const I m4 = P::mask8(0x0F), m30 = P::mask8(0x30);
    const uint8_t* q = blk + 32 + 4 * L * h;  // chunk c at q + 64 c
    // Lines prefetched one at a time as they are read (a burst stalls the loads behind it, as dot_q4k found).
    if (h == 0) prefetch_l2(blk, 32);  // the rows' d
    const F d = P::half(blk + 2 * L * h);
    if (h == 0) prefetch_l2(blk + 32, 4 * 64);
    I scp[16], scpair[8];
    q6k_scales(q, scp, scpair);
    I isum[MT];
    for (int hh = 0; hh < 2; ++hh)
      for (int jj = 0; jj < 2; ++jj) {
        I w[16];  // values 128 hh + 32 jj + 4 l.. (w[l], l < 8), and 64 further (w[8 + l]): j = jj and jj + 2
        for (int l = 0; l < 8; ++l) {
          const uint8_t* lo = q + 64 * (4 + 24 * hh + 8 * jj + l);
          const uint8_t* hi = q + 64 * (20 + 24 * hh + l);
          if (h == 0) prefetch_l2(lo, 64);
          if (h == 0 && jj == 0) prefetch_l2(hi, 64);
          const I a = P::load(lo), qh = P::load(hi);
          const I bits_lo = jj == 0 ? P::slli16(qh, 4) : P::slli16(qh, 2);  // bits 2j.. to 4..5
          const I bits_hi = jj == 0 ? qh : P::srli16(qh, 2);
          w[l] = P::or_(P::and_(a, m4), P::and_(bits_lo, m30));
          w[8 + l] = P::or_(P::and_(P::srli16_4(a), m4), P::and_(bits_hi, m30));
        }
        const int s0 = 8 * hh + 2 * jj;  // the sub-block of w[0..3]; w[4..7]'s is s0 + 1, w[8..]'s s0 + 4, s0 + 5
        for (int m = 0; m < MT; ++m) {
          const int8_t* xm = x.q + m * x.ldq + 256 * sb + 128 * hh + 32 * jj;
          const I t = P::add(P::add(sum4_scaled(w, xm, scp[s0]), sum4_scaled(w + 4, xm + 16, scp[s0 + 1])),
                             P::add(sum4_scaled(w + 8, xm + 64, scp[s0 + 4]),
                                    sum4_scaled(w + 12, xm + 80, scp[s0 + 5])));
          isum[m] = hh == 0 && jj == 0 ? t : P::add(isum[m], t);
        }
      }
    const int64_t nsb = k / 256;
    for (int m = 0; m < MT; ++m)
      acc[m] = scale_q6k(isum[m], d, scpair, x.bsum + m * (k / 16) + 16 * sb, x.d[m * nsb + sb], acc[m]);
  }

  // res[m * L + l]: as dot's, for Q6_K.
  template <int MT>
  static void dot_q6k(const uint8_t* g, int h, const GgufActs& x, int64_t k, float* res) {
    F acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = P::zero();
    for (int64_t sb = 0; sb < k / 256; ++sb) q6k_block<MT>(g + sb * 16 * bytes<ember::kQ6_K>(), h, x, k, sb, acc);
    for (int m = 0; m < MT; ++m) P::storef(res + m * L, acc[m]);
  }

  // Both halves of a group a block at a time (AVX2: H = 2), res [MT, 16]: each line read once.
  template <int MT>
  static void dot_q6k_both(const uint8_t* g, const GgufActs& x, int64_t k, float* res) {
    F acc[2][MT];
    for (int m = 0; m < MT; ++m) acc[0][m] = acc[1][m] = P::zero();
    for (int64_t sb = 0; sb < k / 256; ++sb)
      for (int h = 0; h < 2; ++h) q6k_block<MT>(g + sb * 16 * bytes<ember::kQ6_K>(), h, x, k, sb, acc[h]);
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < 2; ++h) P::storef(res + 16 * m + L * h, acc[h][m]);
  }
};

}  // namespace
