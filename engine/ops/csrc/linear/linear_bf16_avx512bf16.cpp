// ember::linear_bf16 block kernels for AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4+): vdpbf16ps multiplies a
// packed (W[n, 2k], W[n, 2k+1]) lane by a broadcast (x[m, 2k], x[m, 2k+1]) pair and accumulates in fp32, so the
// weights are used exactly as packed (linear_bf16.h) and x stays bf16.
//
// Why not oneDNN: at decode shapes (M = 1..32) its bf16 matrix-vector path streamed weights at ~10-12 GB/s on the
// AVX512-BF16 machine, and freezing gave every compiled batch bucket its own prepacked copy of all weights.
#include "linear/linear.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

namespace {

using ember::LinearArgs;
constexpr int64_t kBlock = ember::kLinearBlock;
constexpr int kMaxRows = 12;  // rows per micro-tile: 12 x 2 accumulators + 2 weight vectors fit the 32 zmm
// Software prefetch distance in the weight stream. With one sequential stream per thread the hardware prefetcher
// does most of the work; a short distance still covers the start of each block. Measured in the decode step:
// 0, 128, 256 and 512 within noise of each other; 1024 (best with interleaved runs) ~5 % slower.
constexpr int64_t kPrefetchBytes = 256;

// Store 32 fp32 accumulators as bf16 (round to nearest even, as torch rounds) into out[0 .. ncols).
inline void store_bf16(uint16_t* out, __m512 lo, __m512 hi, int64_t ncols) {
  const __m512i packed = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  const __m512i both = _mm512_inserti64x4(packed, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)), 1);
  const __mmask32 mask = ncols >= 32 ? ~__mmask32(0) : (__mmask32(1) << ncols) - 1;
  _mm512_mask_storeu_epi16(out, mask, both);
}

// Rows [0, MT) of x (row stride ldx in bf16 pairs) times one packed block, over all K / 2 input pairs.
// kSplit accumulator sets over alternating pairs give few-row tiles independent dependency chains, so the
// loop is bound by weight streaming rather than vdpbf16ps latency.
template <int MT>
void micro_tile(const uint32_t* x, int64_t ldx, const uint16_t* w, int64_t k2, uint16_t* out, int64_t ldo,
                int64_t ncols) {
  constexpr int kSplit = MT <= 3 ? 2 : 1;
  __m512 acc[kSplit][MT][2];
  for (int s = 0; s < kSplit; ++s)
    for (int m = 0; m < MT; ++m) acc[s][m][0] = acc[s][m][1] = _mm512_setzero_ps();
  const int64_t k2_main = k2 - k2 % kSplit;
  auto step = [&](int s, int64_t kk) {
    const uint16_t* wp = w + kk * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp + kBlock));
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[m * ldx + kk])));
      acc[s][m][0] = _mm512_dpbf16_ps(acc[s][m][0], w0, xb);
      acc[s][m][1] = _mm512_dpbf16_ps(acc[s][m][1], w1, xb);
    }
  };
  for (int64_t kk = 0; kk < k2_main; kk += kSplit)
    for (int s = 0; s < kSplit; ++s) step(s, kk + s);
  for (int64_t kk = k2_main; kk < k2; ++kk) step(0, kk);
  for (int m = 0; m < MT; ++m) {
    __m512 lo = acc[0][m][0], hi = acc[0][m][1];
    for (int s = 1; s < kSplit; ++s) {
      lo = _mm512_add_ps(lo, acc[s][m][0]);
      hi = _mm512_add_ps(hi, acc[s][m][1]);
    }
    store_bf16(out + m * ldo, lo, hi, ncols);
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
constexpr TileFn kTileFor[] = {nullptr, micro_tile<1>, micro_tile<2>, micro_tile<3>, micro_tile<4>, micro_tile<5>,
                               micro_tile<6>, micro_tile<7>, micro_tile<8>, micro_tile<9>, micro_tile<10>,
                               micro_tile<11>, micro_tile<12>};

// A block's weights (K * 64 bytes) stay in L2 while every row tile of x passes over them.
void run_block(const LinearArgs& a, int64_t b, float*) {
  const int64_t ncols = a.n - b * kBlock < kBlock ? a.n - b * kBlock : kBlock;
  const auto* xp = reinterpret_cast<const uint32_t*>(a.x);
  const int64_t k2 = a.k / 2, ldx2 = a.ldx / 2;  // ldx is even: k is, and so is the padding
  const uint16_t* wb = static_cast<const uint16_t*>(a.w) + b * a.k * kBlock;
  uint16_t* ob = static_cast<uint16_t*>(a.out) + b * kBlock;
  for (int64_t m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    const int64_t mt = a.rows - m0 < kMaxRows ? a.rows - m0 : kMaxRows;
    kTileFor[mt](xp + m0 * ldx2, ldx2, wb, k2, ob + m0 * a.n, a.n, ncols);
  }
}

int64_t no_scratch(int64_t, int64_t) { return 0; }

}  // namespace

ember::LinearKernel ember::linear_bf16_kernel_avx512bf16() { return {run_block, no_scratch, false}; }
#pragma GCC pop_options
