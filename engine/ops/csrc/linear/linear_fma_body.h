// The packed linear over fp32 multiply-adds, written once over a vector type V (common/simd_*.h) and included by
// linear_fma_avx2.cpp and linear_fma_avx512.cpp inside their ISA's target region. y[M, N] = x[M, K] @ W[N, K]^T with
// fp32 accumulation, for both packed formats of linear.h:
//
// fp32 weights: a block is already an fp32 [K, 32] tile, so every row count runs the register-blocked micro-kernel
// straight on the weights (tile_rows), streaming the block once per row tile.
//
// bf16 weights (widened in registers, so memory streams bf16), two paths per 32-column block:
//  - few rows (decode): stream the block's bf16 pairs once, widen each vector in registers and multiply it into
//    every row (bandwidth-bound: the widening hides under the memory stream).
//  - many rows (prefill): widen K-chunks of the block once into an fp32 tile in L2, then run a register-blocked
//    fp32 micro-kernel over all rows (compute-bound: widening once per block instead of once per row tile).
// No std:: templates here: an inline function instantiated in this ISA's region could be merged by the linker
// with the generic copy other files use, and run on a CPU without this ISA.
#pragma once

#include "linear/linear.h"

namespace {

using ember::LinearArgs;
using ember::LinearKernel;
constexpr int64_t kBlock = ember::kLinearBlock;
constexpr int64_t kPrefetchBytes = 256;  // one sequential stream per thread: the hardware prefetcher does the rest
constexpr int64_t kChunk = 512;          // K values per fp32 tile: 512 x 32 x 4 B = 64 KiB, resident in L2

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <class V>
struct LinearBody {
  using F = typename V::F;
  static constexpr int NV = kBlock / V::W;  // vectors per 32-column block
  // Rows per register tile: NV accumulators a row, plus the widened weights and a broadcast.
  static constexpr int kStreamRows = V::kRegisters == 16 ? 3 : 12;
  static constexpr int kTileRows = V::kRegisters == 16 ? 3 : 12;
  // Up to this many rows the block is streamed (a row tile at a time, re-read from L1/L2 after the first); above,
  // it is widened into a tile once. Measured on AVX2 (2 threads, SmolLM2 shapes): at 4-7 rows streaming ran at
  // 63-116 GFLOP/s against the tile's 47-78; at 8 rows the tile was ahead (81-120 against 76-103).
  static constexpr int64_t kStreamMax = V::kRegisters == 16 ? 7 : 12;

  // Rows [0, MT) of x (fp32, row stride ldx) times one block, straight from its bf16 pairs.
  template <int MT>
  static void stream_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t k2, uint16_t* out, int64_t ldo,
                          int64_t ncols) {
    // One accumulator per (row, vector), summed in input order exactly as tile_rows sums: a row's result does
    // not depend on how many rows share its call, so every decode bucket (and prefill) computes the same values.
    F acc[MT][NV];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = V::zero();
    for (int64_t kk = 0; kk < k2; ++kk) {
      const uint16_t* p = w + kk * 2 * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64, _MM_HINT_T0);
      for (int j = 0; j < NV; ++j) {
        F even, odd;
        V::load_pairs(p + j * 2 * V::W, even, odd);
        for (int m = 0; m < MT; ++m) {
          acc[m][j] = V::fma(V::set1(x[m * ldx + 2 * kk]), even, acc[m][j]);
          acc[m][j] = V::fma(V::set1(x[m * ldx + 2 * kk + 1]), odd, acc[m][j]);
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NV; ++j) {
        const int64_t left = ncols - j * V::W;
        if (left <= 0) break;
        V::store_bf16(out + m * ldo + j * V::W, acc[m][j], static_cast<int>(left));
      }
  }

  // c[MR, 32] (+)= x[MR, kc] @ t[kc, 32]: the fp32 micro-kernel over a widened tile.
  template <int MR>
  static void tile_rows(const float* x, int64_t ldx, const float* t, int64_t kc, float* c, bool first) {
    F acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = first ? V::zero() : V::load(c + m * kBlock + j * V::W);
    for (int64_t k = 0; k < kc; ++k) {
      const float* tk = t + k * kBlock;
      for (int m = 0; m < MR; ++m) {
        const F xb = V::set1(x[m * ldx + k]);
        for (int j = 0; j < NV; ++j) acc[m][j] = V::fma(xb, V::load(tk + j * V::W), acc[m][j]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NV; ++j) V::store(c + m * kBlock + j * V::W, acc[m][j]);
  }

  using StreamFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
  using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, bool);

  // The row tile for `mt` rows (1 <= mt <= MT): one instantiation per row count, chosen by one compare each.
  template <int MT>
  static StreamFn stream_for(int64_t mt) {
    if constexpr (MT == 1) return stream_tile<1>;
    else return mt == MT ? stream_tile<MT> : stream_for<MT - 1>(mt);
  }
  template <int MR>
  static TileFn tile_for(int64_t mr) {
    if constexpr (MR == 1) return tile_rows<1>;
    else return mr == MR ? tile_rows<MR> : tile_for<MR - 1>(mr);
  }

  static int64_t scratch_floats(int64_t rows, int64_t) {
    if (rows <= kStreamMax) return 0;
    return kChunk * kBlock + rows * kBlock;  // the widened tile + fp32 accumulators of every row
  }

  static void run_block(const LinearArgs& a, int64_t b, float* scratch) {
    const int64_t ncols = min64(kBlock, a.n - b * kBlock), K = a.k, k2 = K / 2;
    const uint16_t* wb = static_cast<const uint16_t*>(a.w) + b * K * kBlock;
    uint16_t* ob = static_cast<uint16_t*>(a.out) + b * kBlock;
    if (a.rows <= kStreamMax) {
      for (int64_t m0 = 0; m0 < a.rows; m0 += kStreamRows) {
        const int64_t mt = min64(kStreamRows, a.rows - m0);
        stream_for<kStreamRows>(mt)(a.xf + m0 * a.ldx, a.ldx, wb, k2, ob + m0 * a.n, a.n, ncols);
      }
      return;
    }
    float* tile = scratch;
    float* acc = scratch + kChunk * kBlock;
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t kc = min64(kChunk, K - k0);  // even: K is even and so is kChunk
      for (int64_t kk = 0; kk < kc / 2; ++kk) {
        const uint16_t* p = wb + (k0 / 2 + kk) * 2 * kBlock;
        for (int j = 0; j < NV; ++j) {
          F even, odd;
          V::load_pairs(p + j * 2 * V::W, even, odd);
          V::store(tile + (2 * kk) * kBlock + j * V::W, even);
          V::store(tile + (2 * kk + 1) * kBlock + j * V::W, odd);
        }
      }
      for (int64_t m0 = 0; m0 < a.rows; m0 += kTileRows) {
        const int64_t mr = min64(kTileRows, a.rows - m0);
        tile_for<kTileRows>(mr)(a.xf + m0 * a.ldx + k0, a.ldx, tile, kc, acc + m0 * kBlock, k0 == 0);
      }
    }
    for (int64_t m = 0; m < a.rows; ++m)
      for (int j = 0; j < NV; ++j) {
        const int64_t left = ncols - j * V::W;
        if (left <= 0) break;
        V::store_bf16(ob + m * a.n + j * V::W, V::load(acc + m * kBlock + j * V::W), static_cast<int>(left));
      }
  }

  static LinearKernel kernel() { return {run_block, scratch_floats, true}; }

  // fp32 format: row tiles of the micro-kernel over K-chunks of the block (the chunk's weights stay in L1/L2 while
  // the row tiles pass over them), accumulating in scratch, then the block's columns are copied out.
  static int64_t f32_scratch_floats(int64_t rows, int64_t) { return rows * kBlock; }

  static void f32_run_block(const LinearArgs& a, int64_t b, float* acc) {
    const int64_t ncols = min64(kBlock, a.n - b * kBlock), K = a.k;
    const float* wb = static_cast<const float*>(a.w) + b * K * kBlock;
    float* ob = static_cast<float*>(a.out) + b * kBlock;
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t kc = min64(kChunk, K - k0);
      for (int64_t m0 = 0; m0 < a.rows; m0 += kTileRows) {
        const int64_t mr = min64(kTileRows, a.rows - m0);
        tile_for<kTileRows>(mr)(a.xf + m0 * a.ldx + k0, a.ldx, wb + k0 * kBlock, kc, acc + m0 * kBlock, k0 == 0);
      }
    }
    for (int64_t m = 0; m < a.rows; ++m)
      for (int64_t c = 0; c < ncols; ++c) ob[m * a.n + c] = acc[m * kBlock + c];
  }

  static LinearKernel f32_kernel() { return {f32_run_block, f32_scratch_floats, true}; }
};

}  // namespace
