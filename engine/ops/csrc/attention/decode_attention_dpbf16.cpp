// ember::decode_attention's AVX512-BF16 kernel (decode_attention.h attend_dpbf16_kernel): bf16 queries over a bf16
// cache of head size 64, on the avx512bf16 tier of a CPU without AMX (Zen 4, Zen 5), up to 16 query rows a task.
// ISA: AVX-512 F + BW + VL + DQ + BF16.
//
// Why: a verify step's rows of one request (engine/speculative.py) share every K/V row, so what bounds the vector
// kernel (decode_attention_body.h) there is its per-(key, query head) work, and most of that is the scores: widened
// fp32 multiply-adds, then a 16-way transposing reduction per 16 keys and query head. Here each block of 16 K rows is
// transposed once, as 32-bit pairs of head values (16 x 16 at a time), so the keys sit in the lanes; a query's 16
// scores are then D / 2 vdpbf16ps (both products of a pair added into an fp32 lane) against its pairs broadcast, with
// no reduction, and the transpose is shared by every query row of the task. The softmax and probs . V are the vector
// kernel's own, in fp32.
// Tried and left out: probs . V by vdpbf16ps too (two V rows interleaved against pairs of probabilities rounded to
// bf16) cut a verify step's values pass further, but read the V rows in two passes of a cache line each, and one row
// a request at 2048 positions got 15-45 % slower than the vector kernel (scripts/bench_attention.py, Zen 4).
// Numerics: the queries as they are (bf16; the scale applied to the fp32 score), so a score is the exact products
// summed in fp32, in an order that depends on the head values only. Each query's output depends on its own row of Q
// (a probability past its length is an exact 0), so a row has the same bits alone as beside the other rows of its
// run (the driver's verify-row contract, tests/ops/test_attention_ops.py).
#include "attention/decode_attention.h"

#include <immintrin.h>

#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "attention/decode_attention_body.h"
#include "common/transpose16.h"

namespace {

inline __m512bh bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }
inline __m512i pair_of(const uint16_t* p) {  // two bf16 at p, broadcast as one 32-bit pair
  uint32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(static_cast<int>(x));
}

template <int64_t DD>  // head size: a multiple of 32
struct DotBf16 {
  static constexpr int64_t D = DD;
  static constexpr int NC = D / Avx512::W;  // the vector kernel's chunks of a row
  // K rows are prefetched kAheadBytes ahead into L2, as the vector kernel's (decode_attention_body.h measured why).
  static constexpr int64_t kAheadKeys = kAheadBytes / (2 * D);
  static constexpr int kScoreRows = 8;  // query rows a scores pass: 8 accumulators beside the 16 transposed keys

  // scores[g, 0 .. 15] = scale * q_g . k_l for the block's n keys (zeros past n). pre: how many of the keys
  // kAheadKeys further on exist; each is prefetched as the row kAheadKeys back is loaded (one at a time: a burst of
  // a block's 32 lines stalls the loads behind it, as in linear_gguf_x16_dots.h).
  template <int GN>
  static void score_block(const uint16_t* q, int64_t G, const uint16_t* kbase, const int32_t* slots, int64_t n,
                          int64_t pre, int64_t kv_stride, __m512 scale, float* scores, int64_t Lp) {
    for (int64_t g0 = 0; g0 < G; g0 += GN) {
      const int64_t gn = G - g0 < GN ? G - g0 : GN;
      __m512 acc[GN];
      for (int g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
      for (int h = 0; h < D / 32; ++h) {  // 16 pairs of head values a half
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j) {
          if (g0 == 0 && h == 0 && j < pre)
            prefetch_row(kbase + static_cast<int64_t>(slots[kAheadKeys + j]) * kv_stride, 2 * D);
          r[j] = j < n ? _mm512_loadu_si512(kbase + static_cast<int64_t>(slots[j]) * kv_stride + 32 * h)
                       : _mm512_setzero_si512();
        }
        __m512i t[16];
        transpose16(r, t);  // t[p]: pair 16 h + p of the 16 keys
        for (int g = 0; g < GN && g < gn; ++g) {
          const uint16_t* qg = q + (g0 + g) * D + 32 * h;
          for (int p = 0; p < 16; ++p) acc[g] = _mm512_dpbf16_ps(acc[g], bh(t[p]), bh(pair_of(qg + 2 * p)));
        }
      }
      for (int g = 0; g < GN && g < gn; ++g) _mm512_storeu_ps(scores + (g0 + g) * Lp, _mm512_mul_ps(acc[g], scale));
    }
  }

  static void attend(const uint16_t* q, int64_t G, float scale, const uint16_t* k, const uint16_t* v,
                     const int32_t* slots, int64_t L, int64_t kv_stride, int64_t kh, float* scores, float* out,
                     float* stats, const int64_t* qlen) {
    using Body = AttentionBody<Avx512>;
    const int64_t Lp = (L + 15) / 16 * 16;
    const uint16_t* kbase = k + kh * D;
    const __m512 vscale = _mm512_set1_ps(scale);
    prefetch_start(kbase, slots, kv_stride, 2 * D, kAheadKeys, L);
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
      const int64_t pre = L - l0 - kAheadKeys;
      score_block<kScoreRows>(q, G, kbase, slots + l0, L - l0 < 16 ? L - l0 : 16, pre < 0 ? 0 : pre, kv_stride,
                              vscale, scores + l0, Lp);
    }
    Body::softmax(G, scores, Lp, L, qlen, stats);
    Body::template probs_v<NC>(G, scores, Lp, reinterpret_cast<const Bf16*>(v + kh * D), slots, L, kv_stride, out);
  }
};

}  // namespace

// Head size 64 (SmolLM2, Llama-3.2-1B) only. Zen 4, 2 threads, bf16 KV, this kernel against the vector one called in
// turn on the same data, one KV pool a layer, median of 10 passes over the layers (us a layer): SmolLM2 one row a
// request 19.6 -> 17.6 (1 request, 320 positions) .. 634 -> 653 (8, 2048), 4 rows a request 33.7 -> 32.5 ..
// 1367 -> 1286 (251 -> 217 at 8 x 4 rows, 320); Llama-1B one row 41.6 -> 39.6 .. 1928 -> 1944, 4 rows 111 -> 98
// .. 4650 -> 3624. At head size 128 (Llama-3.1-8B's shape) one row a request got 4-32 % slower (8 requests at 2048
// positions 3188 -> 4215: a K row is four transposes), so it keeps the vector kernel.
ember::AttendBf16 ember::attend_dpbf16_kernel(int64_t head_dim) {
  return head_dim == 64 ? DotBf16<64>::attend : nullptr;
}
#pragma GCC pop_options
