// Decode attention for one (request, KV head) over one chunk of its positions (a partial softmax, decode_attention.h),
// written once over a vector type V (common/simd_*.h) and included by decode_attention_avx2.cpp and
// decode_attention_avx512.cpp inside their ISA's target region.
// Scores W keys at a time (one dot product per lane, finished by one transposing reduction), softmax numerators
// with a vector exp, then probs . V with the query heads' accumulators in registers.
// Every K and V row is widened to fp32 once for all G query heads, so a key costs about G * D / W multiply-adds each
// way plus D / W widenings, and each probs . V pass has a compile-time head count, so its accumulators stay in
// registers (with a run-time count the compiler kept them on the stack).
// A bf16 row is widened two vectors at a time (V::load_pairs: the even elements of 2W in one vector, the odd in the
// next, one op each instead of two), which permutes the lanes: q is permuted the same way on entry (a dot product
// does not care) and the output back on exit.
// The int8 and fp8 caches (T = int8_t or Fp8E4M3, decode_attention.h): each row is widened to fp32 in registers and
// its scale applied once per key: to the key's score after the dot product, and to the key's probability before it
// weights the value row.
// No std:: templates here (see linear/linear_bf16_body.h for why).
#pragma once

#include "attention/decode_attention.h"

namespace {

// K/V rows sit at slots the hardware prefetcher cannot predict (and a KV head's rows are kv_heads * D apart even in
// one request's run of slots), so each stream is prefetched this many bytes ahead, into L2: 12-16 KiB into L2 ran
// 1.9x as fast as 4 KiB into L1 on a context read from DRAM (Zen 4, one thread, Llama-3.2-3B's heads, 1025
// positions), and prefetching into L1 that far was slower still.
constexpr int64_t kAheadBytes = 16384;
constexpr int64_t kHeadGroup = 8;  // query heads whose dot vectors are held at once (more: the K rows widen again)

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T1);
}

// `bytes` from each of rows 0 .. ahead - 1 of a stream at base + slot * stride (the loop then prefetches row
// l + ahead as it reaches row l).
template <typename T>
inline void prefetch_start(const T* base, const int32_t* slots, int64_t stride, int64_t bytes, int64_t ahead,
                           int64_t L) {
  for (int64_t l = 0; l < min64(ahead, L); ++l) prefetch_row(base + static_cast<int64_t>(slots[l]) * stride, bytes);
}

template <typename T>
struct IsBf16 { static constexpr bool value = false; };
template <>
struct IsBf16<Bf16> { static constexpr bool value = true; };

// Chunks of a row handled in one pass: all nc if at most `most`, else the largest even divisor of nc up to `most`
// (even: a bf16 pass must not split a pair of chunks), else all nc.
constexpr int pass_chunks(int nc, int most) {
  if (nc <= most) return nc;
  for (int d = most - (most & 1); d >= 2; d -= 2)
    if (nc % d == 0) return d;
  return nc;
}

template <class V>
struct AttentionBody {
  using F = typename V::F;
  static constexpr int W = V::W;

  // Element of the row that lane i of widened chunk c holds: for bf16, chunks 2p and 2p + 1 are the even and odd
  // elements of elements 2pW .. 2pW + 2W (a last chunk of an odd count is plain); for other types, c * W + i.
  template <int NC, typename T>
  static int64_t element(int c, int i) {
    if (IsBf16<T>::value && (c & ~1) + 1 < NC) return (c & ~1) * W + 2 * i + (c & 1);
    return c * W + i;
  }

  // Chunks c0 .. c0 + CN of row r as fp32 (c0 even, or CN == NC).
  template <int NC, int CN, typename T>
  static void widen(const T* r, int c0, F* x) {
    int c = 0;
    if constexpr (IsBf16<T>::value) {
      for (; c + 1 < CN && c0 + c + 1 < NC; c += 2)
        V::load_pairs(reinterpret_cast<const uint16_t*>(r + (c0 + c) * W), x[c], x[c + 1]);
    }
    for (; c < CN; ++c) x[c] = V::load(r + (c0 + c) * W);
  }

  template <int NC, typename T>  // head_dim = NC * W
  static void attend_one(const float* qf, int64_t G, const T* kp, const T* vp, const int32_t* slots, int64_t L,
                         int64_t kv_stride, int64_t kh, float* scores, float* out, float* stats,
                         const int64_t* qlen) {
    constexpr int64_t D = NC * W;
    constexpr int64_t kQ8 = ember::row_extra<T>();  // 4: int8 / fp8 caches, each row's fp32 scale after its values
    constexpr int64_t RB = (D + kQ8) * sizeof(T);  // a row's bytes, what the prefetches cover
    constexpr int64_t kAhead = kAheadBytes / RB;
    constexpr int CQ = pass_chunks(NC, V::kRegisters / 2);  // K chunks widened at once
    const int64_t Lp = (L + 15) / 16 * 16;
    float* q = scores + G * Lp + G;  // [G, D]: qf with each chunk's lanes in widen()'s order
    for (int64_t g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c)
        for (int i = 0; i < W; ++i) q[g * D + c * W + i] = qf[g * D + element<NC, T>(c, i)];
    const T* kbase = kp + kh * (D + kQ8);  // this KV head's row of slot 0; slot s's is kv_stride * s further
    const T* vbase = vp + kh * (D + kQ8);
    auto key = [&](int64_t l) { return kbase + static_cast<int64_t>(slots[l]) * kv_stride; };

    F dots[kHeadGroup][W];
    float kscale[W];
    prefetch_start(kbase, slots, kv_stride, RB, kAhead, L);
    for (int64_t g0 = 0; g0 < G; g0 += kHeadGroup) {  // scores = q . k
      const int64_t gn = min64(kHeadGroup, G - g0);
      for (int64_t l0 = 0; l0 < L; l0 += W) {
        const int64_t n = min64(W, L - l0);
        for (int64_t j = 0; j < n; ++j) {
          const T* kr = key(l0 + j);
          if (l0 + j + kAhead < L) prefetch_row(key(l0 + j + kAhead), RB);
          if constexpr (kQ8 != 0) kscale[j] = ember::q8_scale(kr, D);
          for (int c0 = 0; c0 < NC; c0 += CQ) {
            F x[CQ];
            widen<NC, CQ>(kr, c0, x);
            for (int64_t g = 0; g < gn; ++g) {
              const float* qg = q + (g0 + g) * D + c0 * W;
              F acc = c0 == 0 ? V::mul(V::load(qg), x[0]) : V::fma(V::load(qg), x[0], dots[g][j]);
              for (int c = 1; c < CQ; ++c) acc = V::fma(V::load(qg + W * c), x[c], acc);
              dots[g][j] = acc;
            }
          }
        }
        for (int64_t g = 0; g < gn; ++g) {
          for (int64_t j = n; j < W; ++j) dots[g][j] = V::zero();
          F sc = V::reduce_lanes(dots[g]);
          if constexpr (kQ8 != 0) {
            for (int64_t j = n; j < W; ++j) kscale[j] = 0.f;
            sc = V::mul(sc, V::load(kscale));
          }
          V::store(scores + (g0 + g) * Lp + l0, sc);
        }
      }
    }
    softmax(G, scores, Lp, L, qlen, stats);
    // out = probs . V: CV chunks of up to GV heads at a time, their accumulators in registers; a pass reads only its
    // chunks' bytes of each row (a bf16 row of 128 elements is four cache lines, a pass of 4 chunks two of them).
    probs_v<NC, T>(G, scores, Lp, vbase, slots, L, kv_stride, out);
  }

  // Softmax numerators in place of the scores [G, Lp]; the driver divides by the sum once every chunk is in.
  // Positions past a query's own length get 0, so the values pass adds exact zeros for them: a row's output has the
  // same bits as when it runs alone. stats [G, 2]: (max, sum) per query.
  static void softmax(int64_t G, float* scores, int64_t Lp, int64_t L, const int64_t* qlen, float* stats) {
    const F neg_inf = V::set1(-__builtin_inff());
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * Lp;
      const int64_t Lg = qlen != nullptr ? qlen[g] : L;
      F m = neg_inf;
      for (int64_t l0 = 0; l0 < Lg; l0 += W) m = V::max(m, V::first_n(V::load(sg + l0), Lg - l0, neg_inf));
      const F mx = V::set1(V::hmax(m));
      F sum = V::zero();
      for (int64_t l0 = 0; l0 < L; l0 += W) {
        const F e = V::first_n(V::exp(V::sub(V::load(sg + l0), mx)), Lg > l0 ? Lg - l0 : 0, V::zero());
        V::store(sg + l0, e);
        sum = V::add(sum, e);
      }
      stats[2 * g] = V::hmax(m);
      stats[2 * g + 1] = V::hsum(sum);
    }
  }

  // out [G, D] = probs [G, Lp] . the V rows at slots (vbase: this KV head's row of slot 0).
  template <int NC, typename T>
  static void probs_v(int64_t G, const float* probs, int64_t Lp, const T* vbase, const int32_t* slots, int64_t L,
                      int64_t kv_stride, float* out) {
    constexpr int64_t D = NC * W;
    constexpr int CV = pass_chunks(NC, 4);  // V chunks per pass, so GV heads' accumulators fit in registers
    constexpr int GV = (V::kRegisters - 8) / CV > 0 ? (V::kRegisters - 8) / CV : 1;
    for (int c0 = 0; c0 < NC; c0 += CV)
      for (int64_t g0 = 0; g0 < G; g0 += GV)
        values<NC, CV, GV, T>(min64(GV, G - g0), probs + g0 * Lp, Lp, vbase, slots, L, kv_stride, c0, g0 == 0,
                              out + g0 * D);
  }

  // One pass of probs . V: chunks c0 .. c0 + CV of GN heads' outputs (GN <= GMAX picked at run time, so that every
  // pass has its accumulators in registers: a run-time head count makes the compiler keep them on the stack).
  // first: the first head group of these chunks, which starts their prefetch stream.
  template <int NC, int CV, int GMAX, typename T>
  static void values(int64_t gn, const float* probs, int64_t Lp, const T* vbase, const int32_t* slots, int64_t L,
                     int64_t kv_stride, int c0, bool first, float* out) {
    if constexpr (GMAX > 1) {
      if (gn < GMAX) return values<NC, CV, GMAX - 1, T>(gn, probs, Lp, vbase, slots, L, kv_stride, c0, first, out);
    }
    constexpr int GN = GMAX;
    constexpr int64_t D = NC * W;
    constexpr int64_t kQ8 = ember::row_extra<T>();
    constexpr int64_t kPassBytes = kQ8 != 0 ? (D + kQ8) * int64_t(sizeof(T)) : CV * W * int64_t(sizeof(T));
    constexpr int64_t kAhead = kAheadBytes / ((D + kQ8) * int64_t(sizeof(T)));
    const T* pass = vbase + (kQ8 != 0 ? 0 : c0 * W);  // where this pass's bytes of a row start
    if (first) prefetch_start(pass, slots, kv_stride, kPassBytes, kAhead, L);
    F acc[GN][CV];
    for (int g = 0; g < GN; ++g)
      for (int c = 0; c < CV; ++c) acc[g][c] = V::zero();
    for (int64_t l = 0; l < L; ++l) {
      if (l + kAhead < L) prefetch_row(pass + static_cast<int64_t>(slots[l + kAhead]) * kv_stride, kPassBytes);
      const T* vr = vbase + static_cast<int64_t>(slots[l]) * kv_stride;
      float vscale = 1.f;
      if constexpr (kQ8 != 0) vscale = ember::q8_scale(vr, D);
      F x[CV];
      widen<NC, CV>(vr, c0, x);
      for (int g = 0; g < GN; ++g) {
        const F p = V::set1(kQ8 != 0 ? probs[g * Lp + l] * vscale : probs[g * Lp + l]);
        for (int c = 0; c < CV; ++c) acc[g][c] = V::fma(p, x[c], acc[g][c]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      float* og = out + g * D;
      for (int c = 0; c < CV; ++c) {
        if constexpr (IsBf16<T>::value) {
          alignas(64) float lanes[W];
          V::store(lanes, acc[g][c]);
          for (int i = 0; i < W; ++i) og[element<NC, T>(c0 + c, i)] = lanes[i];
        } else {
          V::store(og + (c0 + c) * W, acc[g][c]);
        }
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
