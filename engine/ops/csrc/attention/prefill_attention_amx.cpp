// ember::prefill_attention's AMX-BF16 kernel (prefill_attention.h prefill_amx_bf16): bf16 queries over a bf16 cache,
// head size 64, 128 or 256, a task's M <= 64 query rows. ISA: AMX-TILE + AMX-BF16 + AVX512-BF16 (Sapphire Rapids on).
//
// Why: the vector kernel (prefill_attention_body.h) spends two fp32 FMAs per (query row, key, 16 head values), so a
// 256-token prompt's attention was ~19 % of SmolLM2's prefill and most of a 2048-token one's beyond the linears.
// Here the products are tiles; what is left per query row is the softmax and rescaling the output, and per key
// moving bytes (K^T and V laid out as B tiles once a block, for all the task's rows).
//
// Flash attention's order, 128 keys a block (32 measured ~20 % slower: the per-row reductions and rescales, paid per
// block, dominate): S = Q K^T (A = 16 query rows x 32 head values as they are in q, B = K^T in the VNNI pair layout:
// a 16 x 16 transpose of 32-bit pairs), an online softmax per query row whose numerators are rounded to bf16 and
// summed as rounded (the values the next product multiplies), then P V (A = P, 16 rows x 32 keys; B = pairs of V
// rows interleaved) into fresh C tiles, added to the fp32 output rows after their rescale. 2048-token SmolLM2-shaped
// prompt, 2 threads, AMX Xeon: 8.5-9.3 ms a layer against the vector kernel's 21.2 (scripts/bench_attention.py
// --prefill).
#include "attention/prefill_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "linear/amx_bf16.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include "common/simd_avx512.h"
#include "attention/amx_tiles.h"
#include "common/transpose16.h"

namespace {

constexpr int64_t kBlockKeys = 128;  // a multiple of 32
constexpr float kMaskedScore = -1e30f;  // as prefill_attention_body.h: finite under -ffast-math

// e^x for x <= 0 to well within bf16's rounding (the numerators are rounded to bf16 next): 2^n e^f, |f| <= ln 2 / 2,
// a degree-4 Taylor polynomial for e^f (relative error < 5e-5, bf16's half ulp is 2e-3). Avx512::exp's degree 7
// cost this kernel ~7 % (2048-token SmolLM2-shaped prompt: 7.6-8.4 against 8.2-8.7 ms, three alternated runs).
inline __m512 exp_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// K rows l0 .. l0 + 31 (zeros past n) as B tiles kt[t][h]: head values 32 t .. 32 t + 31 of keys 16 h .. 16 h + 15,
// row i holding each key's pair (2 i, 2 i + 1).
inline void key_tiles(const uint16_t* kbase, const int32_t* slots, int64_t n, int64_t kv_stride, int64_t D,
                      uint16_t (*kt)[2][16 * 32]) {
  for (int h = 0; h < 2; ++h)
    for (int64_t t = 0; t < D / 32; ++t) {
      __m512i r[16], c[16];
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t l = 16 * h + j;
        r[j] = l < n ? _mm512_loadu_si512(kbase + static_cast<int64_t>(slots[l]) * kv_stride + 32 * t)
                     : _mm512_setzero_si512();
      }
      transpose16(r, c);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(kt[t][h] + 32 * i, c[i]);
    }
}

}  // namespace

void ember::prefill_amx_bf16(const uint16_t* q, int64_t G, int64_t nq, int64_t first_pos, int64_t D, float scale,
                             const uint16_t* k, const uint16_t* v, const int32_t* slots, int64_t kv_stride,
                             int64_t kh, float* out) {
  constexpr int NB = kBlockKeys / 32;         // 32-key sub-blocks: one P tile, 2 K^T tiles per 32 head values
  alignas(64) uint16_t kt[NB][8][2][16 * 32];  // K^T tiles: [sub-block][32 head values][16 keys]
  alignas(64) uint16_t bv[NB][16][16 * 32];    // V tiles: [sub-block][16 head values]
  constexpr int64_t QB = kPrefillAmxRows / 16;  // query blocks of 16 rows
  alignas(64) float s[QB][16][kBlockKeys];
  alignas(64) uint16_t pa[QB][16][kBlockKeys];
  alignas(64) float c[16][16];
  float mx[kPrefillAmxRows], sum[kPrefillAmxRows], alpha[kPrefillAmxRows];
  const int64_t used = G * nq, L = first_pos + nq, blocks = (used + 15) / 16;
  const auto rows_of = [used](int64_t b) { return used - 16 * b < 16 ? used - 16 * b : 16; };  // in query block b
  const uint16_t* kbase = k + kh * D;
  const uint16_t* vbase = v + kh * D;
  for (int64_t m = 0; m < used; ++m) {
    mx[m] = kMaskedScore;
    sum[m] = 0.f;
  }
  std::memset(out, 0, sizeof(float) * blocks * 16 * D);
  const __m512 vscale = _mm512_set1_ps(scale), masked = _mm512_set1_ps(kMaskedScore);
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  ember::amx_begin();
  for (int64_t j0 = 0; j0 < L; j0 += kBlockKeys) {
    const int64_t n = L - j0 < kBlockKeys ? L - j0 : kBlockKeys, nsub = (n + 31) / 32;
    for (int64_t u = 0; u < nsub; ++u) {
      const int64_t nu = n - 32 * u < 32 ? n - 32 * u : 32;
      key_tiles(kbase, slots + j0 + 32 * u, nu, kv_stride, D, kt[u]);
      for (int64_t e0 = 0; e0 < D / 16; e0 += 4) value_tiles(vbase, slots + j0 + 32 * u, nu, kv_stride, e0, bv[u] + e0);
    }
    // Three passes over the query blocks, so that no tile load reads what vector stores wrote just before (a
    // stall measured at ~15 % of the kernel when each block ran its scores, softmax and products in turn).
    bool live[QB];
    for (int64_t b = 0; b < blocks; ++b) {
      // Row m sees keys up to position first_pos + m / G: a block whose last row sees none of these keys is done.
      const int64_t rows = rows_of(b);
      live[b] = first_pos + (16 * b + rows - 1) / G >= j0;
      if (!live[b]) continue;
      const uint16_t* qb = q + 16 * b * D;
      for (int64_t u = 0; u < nsub; ++u) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t t = 0; t < D / 32; ++t) {
          _tile_loadd(4, qb + 32 * t, D * 2);
          _tile_loadd(5, kt[u][t][0], 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, kt[u][t][1], 64);
          _tile_dpbf16ps(1, 4, 5);
        }
        _tile_stored(0, &s[b][0][32 * u], kBlockKeys * 4);
        _tile_stored(1, &s[b][0][32 * u + 16], kBlockKeys * 4);
      }
    }
    const int64_t nv = 2 * nsub;  // score vectors a row: keys past n are masked below (they lie past L)
    for (int64_t b = 0; b < blocks; ++b) {
      if (!live[b]) continue;
      const int64_t rows = rows_of(b);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = 16 * b + r;
        // Keys past the row's position (and so past L) are masked: lane j of vector w is key j0 + 16 w + j.
        const int64_t seen = first_pos + m / G - j0;  // the row's last key in the block
        const bool diag = seen < 16 * nv - 1;
        __m512 x[2 * NB];
        __mmask16 keep[2 * NB];
        __m512 top = masked;
        for (int64_t w = 0; w < nv; ++w) {
          keep[w] = diag ? _mm512_cmp_ps_mask(_mm512_add_ps(lane, _mm512_set1_ps(16.f * w)),
                                              _mm512_set1_ps(static_cast<float>(seen)), _CMP_LE_OQ)
                         : static_cast<__mmask16>(0xFFFF);
          x[w] = _mm512_mask_mul_ps(masked, keep[w], _mm512_load_ps(s[b][r] + 16 * w), vscale);
          top = _mm512_max_ps(top, x[w]);
        }
        const float now = std::max(mx[m], _mm512_reduce_max_ps(top));
        const __m512 shift = _mm512_set1_ps(now);
        __m512 total = _mm512_setzero_ps();
        for (int64_t w = 0; w < nv; w += 2) {
          const __m512 p1 = _mm512_maskz_mov_ps(keep[w + 1], exp_bf16(_mm512_sub_ps(x[w + 1], shift)));
          const __m512 p0 = _mm512_maskz_mov_ps(keep[w], exp_bf16(_mm512_sub_ps(x[w], shift)));
          const __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
          _mm512_store_si512(pa[b][r] + 16 * w, bits);
          // The sum of the rounded numerators: each bf16 widened back (a shift or a mask) and added.
          total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
          total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(-65536))));
        }
        for (int64_t w = nv; w < 2 * NB; w += 2) _mm512_store_si512(pa[b][r] + 16 * w, _mm512_setzero_si512());
        alpha[m] = std::exp(mx[m] - now);
        sum[m] = sum[m] * alpha[m] + _mm512_reduce_add_ps(total);
        mx[m] = now;
      }
      for (int64_t r = rows; r < 16; ++r) std::memset(pa[b][r], 0, sizeof(pa[b][r]));
    }
    for (int64_t b = 0; b < blocks; ++b) {
      if (!live[b]) continue;
      const int64_t rows = rows_of(b);
      for (int64_t e0 = 0; e0 < D / 16; e0 += 4) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t u = 0; u < nsub; ++u) dp_four(pa[b][0] + 32 * u, kBlockKeys * 2, bv[u] + e0);
        for (int e = 0; e < 4; ++e) {
          store_c(e, c);
          for (int64_t r = 0; r < rows; ++r) {
            float* o = out + (16 * b + r) * D + 16 * (e0 + e);
            const __m512 a = _mm512_set1_ps(alpha[16 * b + r]);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), a, _mm512_load_ps(c[r])));
          }
        }
      }
    }
  }
  ember::amx_end();
  for (int64_t m = 0; m < used; ++m) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[m]);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(out + m * D + d, _mm512_mul_ps(_mm512_loadu_ps(out + m * D + d), inv));
  }
}
#pragma GCC pop_options
