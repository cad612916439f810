// ember::decode_attention's AMX-BF16 kernel (decode_attention.h attend_amx_bf16): bf16 queries over a bf16 cache,
// head size 64 or 128, up to 16 query rows a task. ISA: AMX-TILE + AMX-BF16 + AVX512-BF16 (Sapphire Rapids on).
//
// Why: a verify step's rows of one request (engine/speculative.py) share every K/V row, so the vector kernel's cost
// is its multiply-adds, ~11 vector ops per (key, query head) each way; at 4 merged rows of SmolLM2 (12 query heads a
// KV head) that made attention a third of a 32-row step. Tile products do the multiply-adds of all query rows at
// once; what is left per key is moving bytes: the K rows as they lie (or gathered), the V rows interleaved in pairs.
//
// Scores as S^T = K Q^T: A = 16 keys x 32 head values of K (a tile load straight from the cache when the 16 slots
// are consecutive, as a prompt's are), B = Q^T in the VNNI pair layout (built once a task), C = 16 keys x 16 query
// rows; each query's column is gathered into its row of `scores`. Softmax numerators in fp32, rounded to bf16 (the
// values the tile product multiplies) and summed as rounded, so the partial softmax stays self-consistent. Values as
// out = P V: A = 16 query rows x 32 keys of P, B = 32 keys x 16 head values of V, pairs of keys interleaved.
// Each query's output depends on its own row of Q and P only, so a row has the same bits alone as beside the other
// rows of its run (the driver's verify-row contract, tests/ops/test_attention_ops.py).
#include "attention/decode_attention.h"

#include <immintrin.h>

#include <cstring>

#include "linear/amx_bf16.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "attention/amx_tiles.h"

namespace {

constexpr int64_t kMaxHeadDim = 128;

// K rows l0 .. l0 + 15 as A tiles 5 (one per 32 head values), times the Q^T tiles 1.. into C tile 0.
inline void score_block(const uint16_t* kbase, const int32_t* slots, int64_t n, int64_t kv_stride, int64_t D,
                        uint16_t* gathered) {
  bool consecutive = n == 16;
  for (int64_t r = 1; consecutive && r < 16; ++r) consecutive = slots[r] == slots[0] + r;
  const uint16_t* a = kbase + static_cast<int64_t>(slots[0]) * kv_stride;
  int64_t lda = kv_stride * 2;
  if (!consecutive) {
    for (int64_t r = 0; r < 16; ++r) {
      uint16_t* row = gathered + r * D;
      if (r < n) std::memcpy(row, kbase + static_cast<int64_t>(slots[r]) * kv_stride, D * 2);
      else std::memset(row, 0, D * 2);
    }
    a = gathered;
    lda = D * 2;
  }
  _tile_zero(0);
  _tile_loadd(5, a, lda);
  _tile_dpbf16ps(0, 5, 1);
  _tile_loadd(5, a + 32, lda);
  _tile_dpbf16ps(0, 5, 2);
  if (D == 128) {
    _tile_loadd(5, a + 64, lda);
    _tile_dpbf16ps(0, 5, 3);
    _tile_loadd(5, a + 96, lda);
    _tile_dpbf16ps(0, 5, 4);
  }
}

}  // namespace

void ember::attend_amx_bf16(const uint16_t* q, int64_t G, int64_t D, float scale, const uint16_t* k,
                            const uint16_t* v, const int32_t* slots, int64_t L, int64_t kv_stride, int64_t kh,
                            float* scores, float* out, float* stats, const int64_t* qlen) {
  const int64_t Lp = (L + 31) / 32 * 32;
  const uint16_t* kbase = k + kh * D;
  const uint16_t* vbase = v + kh * D;
  alignas(64) uint32_t bq[4][16][16];  // Q^T tiles: [32 head values / 2][query] pairs
  alignas(64) uint16_t gathered[16 * kMaxHeadDim];
  alignas(64) float c[16][16];
  alignas(64) uint16_t pa[16][32];
  alignas(64) uint16_t bv[4][16 * 32];
  std::memset(bq, 0, sizeof(bq));
  for (int64_t gq = 0; gq < G; ++gq) {
    const uint16_t* qrow = q + gq * D;
    for (int64_t t = 0; t < D / 32; ++t)
      for (int64_t i = 0; i < 16; ++i) std::memcpy(&bq[t][i][gq], qrow + 32 * t + 2 * i, 4);
  }
  ember::amx_begin();
  _tile_loadd(1, bq[0], 64);
  _tile_loadd(2, bq[1], 64);
  if (D == 128) {
    _tile_loadd(3, bq[2], 64);
    _tile_loadd(4, bq[3], 64);
  }
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale);
  prefetch_rows(kbase, slots, 0, L < kAheadKeys ? L : kAheadKeys, kv_stride, D);
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    if (l0 + kAheadKeys < L)
      prefetch_rows(kbase, slots, l0 + kAheadKeys, L < l0 + kAheadKeys + 16 ? L : l0 + kAheadKeys + 16, kv_stride, D);
    score_block(kbase, slots + l0, L - l0 < 16 ? L - l0 : 16, kv_stride, D, gathered);
    _tile_stored(0, c, 64);
    for (int64_t gq = 0; gq < G; ++gq)  // column gq of C: query gq's scores of these 16 keys
      _mm512_storeu_ps(scores + gq * Lp + l0,
                       _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(gq)), c, 4),
                                     vscale));
  }
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (int64_t gq = 0; gq < G; ++gq) {
    float* sg = scores + gq * Lp;
    const int64_t Lg = qlen != nullptr ? qlen[gq] : L;
    __m512 m = neg_inf;
    for (int64_t l0 = 0; l0 < Lg; l0 += 16)
      m = _mm512_max_ps(m, Avx512::first_n(_mm512_loadu_ps(sg + l0), Lg - l0, neg_inf));
    const float mx = _mm512_reduce_max_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l0 = 0; l0 < Lp; l0 += 16) {
      __m512 e = _mm512_setzero_ps();
      if (l0 < Lg) {
        e = Avx512::first_n(Avx512::exp(_mm512_sub_ps(_mm512_loadu_ps(sg + l0), _mm512_set1_ps(mx))), Lg - l0,
                            _mm512_setzero_ps());
        const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);  // the bf16 value the tile product multiplies
        e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      }
      _mm512_storeu_ps(sg + l0, e);
      sum = _mm512_add_ps(sum, e);
    }
    stats[2 * gq] = mx;
    stats[2 * gq + 1] = _mm512_reduce_add_ps(sum);
  }
  std::memset(pa, 0, sizeof(pa));
  for (int64_t e0 = 0; e0 < D / 16; e0 += 4) {  // 64 head values a pass: C tiles 0-3
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (e0 == 0) prefetch_rows(vbase, slots, 0, L < kAheadKeys ? L : kAheadKeys, kv_stride, D);
    for (int64_t l0 = 0; l0 < L; l0 += 32) {
      if (e0 == 0 && l0 + kAheadKeys < L)
        prefetch_rows(vbase, slots, l0 + kAheadKeys, L < l0 + kAheadKeys + 32 ? L : l0 + kAheadKeys + 32, kv_stride, D);
      for (int64_t gq = 0; gq < G; ++gq) {
        const float* sg = scores + gq * Lp + l0;
        _mm512_store_si512(pa[gq], (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sg + 16), _mm512_loadu_ps(sg)));
      }
      value_tiles(vbase, slots + l0, L - l0 < 32 ? L - l0 : 32, kv_stride, e0, bv);
      dp_four(pa, 64, bv);
    }
    for (int e = 0; e < 4; ++e) {
      store_c(e, c);
      for (int64_t gq = 0; gq < G; ++gq) _mm512_storeu_ps(out + gq * D + 16 * (e0 + e), _mm512_load_ps(c[gq]));
    }
  }
  ember::amx_end();
}
#pragma GCC pop_options
