// ember::linear_gguf's activation quantizer (quantize_acts.h): a portable version, and AVX-512 and AVX2 ones, each
// in its own target region and called only on its tiers, that do the same IEEE operations in the same order.
// ISA: none outside those two regions.
#include "linear_gguf/quantize_acts.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/dtypes.h"
#include "common/row_stride.h"
#include "linear_gguf/linear_gguf.h"

namespace ember {
namespace {

// Activation values a thread quantizes at least (a call of fewer stays on one: waking the other costs more).
constexpr int64_t kQuantizeGrainValues = 1 << 15;

// A quantized block's sums: per 16 (bsum), and per 32 as each type's kernels take them.
template <int QB>
inline void block_sums(const int* sums, float d, int64_t j, int lane_offset, QuantizedActs& o) {
  for (int s = 0; s < QB / 16; ++s) o.bsum[j * QB / 16 + s] = static_cast<int16_t>(sums[s]);
  if constexpr (QB == 256) {
    for (int s = 0; s < 8; ++s)  // |sum over 32| <= 32 x 127: an int16
      o.s32[j * 8 + s] = static_cast<int16_t>(sums[2 * s] + sums[2 * s + 1]);
  } else {
    const int sum = sums[0] + sums[1];
    o.off[j] = sum * lane_offset;
    o.msum[j] = d * static_cast<float>(sum) * 0.125f;
  }
}

// A block's scale d = max|x| / 127 and its inverse (0 for an all-zero block): one expression for every version.
inline void block_scale(float amax, float& d, float& id) {
  d = amax / kGgufActMax;
  id = d != 0.0f ? 1.0f / d : 0.0f;
}

// Per row, per block of QB (32 or 256): d = max|x| / 127, q = round(x / d), sums per 16; x in fp32 or (xb) bf16,
// widened exactly on the way. Rows [r0, r1) of o, sized by quantize_acts(). The SIMD versions below do the same
// IEEE operations in the same order (t = x id, then t + copysign(0.5, t), each rounded), so every CPU and every
// forced variant sees the same int8 values.
template <int QB>
void quantize_rows(const float* xf, const uint16_t* xb, int64_t r0, int64_t r1, int64_t k, int lane_offset,
                   QuantizedActs& o) {
  const int64_t nb = k / QB;
  for (int64_t j = r0 * nb; j < r1 * nb; ++j) {
    float v[QB];
    for (int i = 0; i < QB; ++i) v[i] = xb != nullptr ? bf16_value(xb[j * QB + i]) : xf[j * QB + i];
    float amax = 0.0f;
    for (int i = 0; i < QB; ++i) amax = std::fmax(amax, std::fabs(v[i]));
    float d, id;
    block_scale(amax, d, id);
    int8_t* q = o.q.data() + j / nb * o.ldq + j % nb * QB;
    int sums[QB / 16] = {};
    // Round half away from zero: |v id| <= 127 (+ an ulp), so |q| <= 127 without a clamp.
    for (int i = 0; i < QB; ++i) {
      const float t = v[i] * id;
      q[i] = static_cast<int8_t>(static_cast<int>(t + std::copysign(0.5f, t)));
      sums[i / 16] += q[i];
    }
    o.d[j] = d;
    block_sums<QB>(sums, d, j, lane_offset, o);
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
template <int QB>
void quantize_rows_avx512(const float* xf, const uint16_t* xb, int64_t r0, int64_t r1, int64_t k, int lane_offset,
                          QuantizedActs& o) {
  constexpr int C = QB / 16;
  const int64_t nb = k / QB;
  const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f);
  for (int64_t j = r0 * nb; j < r1 * nb; ++j) {
    __m512 v[C];
    __m512 amax = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      if (xb != nullptr) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + j * QB + 16 * c));
        v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        v[c] = _mm512_loadu_ps(xf + j * QB + 16 * c);
      }
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v[c]));
    }
    float d, id;
    block_scale(_mm512_reduce_max_ps(amax), d, id);
    int8_t* q = o.q.data() + j / nb * o.ldq + j % nb * QB;
    int sums[C];
    for (int c = 0; c < C; ++c) {
      const __m512 t = _mm512_mul_round_ps(v[c], _mm512_set1_ps(id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 r = _mm512_add_round_ps(t, _mm512_or_ps(_mm512_and_ps(t, sign), half),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qi = _mm512_cvttps_epi32(r);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * c), _mm512_cvtepi32_epi8(qi));
      sums[c] = _mm512_reduce_add_epi32(qi);
    }
    o.d[j] = d;
    block_sums<QB>(sums, d, j, lane_offset, o);
  }
}
#pragma GCC pop_options

// The same on AVX2 (no FMA in this region, so t = x id and the add round separately here too).
#pragma GCC push_options
#pragma GCC target("avx2")
template <int QB>
void quantize_rows_avx2(const float* xf, const uint16_t* xb, int64_t r0, int64_t r1, int64_t k, int lane_offset,
                        QuantizedActs& o) {
  constexpr int C = QB / 8;
  const int64_t nb = k / QB;
  const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
  // The low byte of each int32 lane, gathered into the low 8 bytes (|q| <= 127: the byte is the value).
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i join = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
  for (int64_t j = r0 * nb; j < r1 * nb; ++j) {
    __m256 v[C];
    __m256 amax = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
      if (xb != nullptr) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + j * QB + 8 * c));
        v[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        v[c] = _mm256_loadu_ps(xf + j * QB + 8 * c);
      }
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float d, id;
    block_scale(_mm_cvtss_f32(m4), d, id);
    int8_t* q = o.q.data() + j / nb * o.ldq + j % nb * QB;
    int sums[QB / 16];
    for (int c = 0; c < C; c += 2) {
      __m256i qi[2];
      for (int e = 0; e < 2; ++e) {
        const __m256 t = _mm256_mul_ps(v[c + e], _mm256_set1_ps(id));
        qi[e] = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_or_ps(_mm256_and_ps(t, sign), half)));
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(qi[e], low_bytes), join);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 8 * (c + e)), _mm256_castsi256_si128(b));
      }
      const __m256i s8 = _mm256_add_epi32(qi[0], qi[1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      sums[c / 2] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1)));
    }
    o.d[j] = d;
    block_sums<QB>(sums, d, j, lane_offset, o);
  }
}
#pragma GCC pop_options

}  // namespace

// quantize_rows (or its tier's version) over all rows, split over the threads where there are enough values to pay
// for waking them.
void quantize_acts(const float* xf, const uint16_t* xb, int64_t rows, int64_t k, int64_t qb, int lane_offset, Isa isa,
                   QuantizedActs& o) {
  o.ldq = row_stride(rows, k, sizeof(int8_t));
  o.q.resize(rows * o.ldq);
  o.d.resize(rows * k / qb);
  o.bsum.resize(rows * k / 16);
  if (qb == 32) {
    o.off.resize(rows * k / 32);
    o.msum.resize(rows * k / 32);
  } else {
    o.s32.resize(rows * k / 32);
  }
  // By the tier, so that the tests comparing tiers compare the versions too.
  using Fn = void (*)(const float*, const uint16_t*, int64_t, int64_t, int64_t, int, QuantizedActs&);
  const Fn fn = isa >= Isa::kAvx512 ? (qb == 32 ? quantize_rows_avx512<32> : quantize_rows_avx512<256>)
                : isa == Isa::kAvx2 ? (qb == 32 ? quantize_rows_avx2<32> : quantize_rows_avx2<256>)
                                    : (qb == 32 ? quantize_rows<32> : quantize_rows<256>);
  at::parallel_for(0, rows, std::max<int64_t>(1, kQuantizeGrainValues / k),
                   [&](int64_t r0, int64_t r1) { fn(xf, xb, r0, r1, k, lane_offset, o); });
}

}  // namespace ember
