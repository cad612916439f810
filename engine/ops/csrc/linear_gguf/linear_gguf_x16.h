// ember::linear_gguf's integer kernel for the 16-row layout (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; linear_gguf.h): run_block
// over linear_gguf_x16_dots.h's dots (one vector of P::L rows of a group at a time) and, on AVX2 at a few activation
// rows, linear_gguf_x16_both.h's (both halves of a group at once). Included inside the ISA's target region, after
// linear_gguf_body.h.
#pragma once

#include "linear_gguf/linear_gguf_x16_both.h"

namespace {

template <class P>
struct X16Body {
  using D = X16Dots<P>;
  using B = X16Both<P>;
  static constexpr int L = P::L, H = 16 / L;
  static constexpr int kWideTile = 16;

  using DotFn = void (*)(const uint8_t*, int, const GgufActs&, int64_t, float*);
  template <int T, int MT>
  static constexpr DotFn pick() {
    if constexpr (T == ember::kQ4_K) return D::template dot_q4k<MT>;
    else if constexpr (T == ember::kQ6_K) return D::template dot_q6k<MT>;
    else return D::template dot<T, MT>;
  }

  template <int T, int MT>
  static DotFn dot_for(int64_t mt) {
    constexpr DotFn f = pick<T, MT>();
    if constexpr (MT == 1) return f;
    else return mt == MT ? f : dot_for<T, MT - 1>(mt);
  }

  using BothFn = void (*)(const uint8_t*, const GgufActs&, int64_t, float*);
  template <int MT>
  static BothFn q6k_both_for(int64_t mt) {
    if constexpr (MT == 1) return D::template dot_q6k_both<1>;
    else return mt == MT ? D::template dot_q6k_both<MT> : q6k_both_for<MT - 1>(mt);
  }

  // res [mt, width] (width a multiple of L) into output rows m0.. and columns c0..: one vector store per L columns
  // rather than L scalar ones (they weighed most where K is short: SmolLM2's 576 is 18 blocks a group), scalar
  // stores only where the weight ends (n1) inside a vector.
  static void store_rows(const GgufLinearArgs& a, int64_t m0, int64_t mt, int64_t c0, int width, int64_t n1,
                         const float* res) {
    for (int64_t m = 0; m < mt; ++m)
      for (int c = 0; c < width; c += L) {
        const float* v = res + m * width + c;
        const int64_t at = (m0 + m) * a.n + c0 + c;
        if (c0 + c + L <= n1) {
          P::store_out(a, at, v);
        } else {
          for (int64_t l = 0; l < L && c0 + c + l < n1; ++l) g_store(a, at + l, v[l]);
        }
      }
  }

  // Every row of output block `block` (two groups), activation rows in tiles of kRowTile sharing each decoded chunk.
  template <int T>
  static void run_block(const GgufLinearArgs& a, int64_t block, float*) {
    const int64_t k = a.k, nb = k / D::template values<T>(), group_bytes = 16 * nb * D::template bytes<T>();
    const int64_t n0 = block * ember::kGgufBlockRows, n1 = g_min64(n0 + ember::kGgufBlockRows, a.n);
    constexpr bool kq = T == ember::kQ4_K || T == ember::kQ6_K;
    float res[kWideTile * 16];  // 16 rows of output a row: dot_q4k_both writes both halves
    // AVX2's Q8_0 runs every row count as both-halves passes of 4 rows (its 8 chunks a block need no nibble split,
    // so re-reading a group from the cache per 4 rows costs less than the half passes' separate broadcasts). AMX
    // Xeon, forced avx2, ms a Llama-1B layer, 8-row tiles -> 4-row both-halves tiles: Q8_0 4.56-4.62 -> 3.91-4.03
    // at 6 rows, 5.33-5.37 -> 4.97-5.07 at 8, 18.2-18.4 -> 17.2-17.7 at 32, 70.9-71.6 -> 67.1-69.3 at 128; the
    // 4-bit types lost (Q4_K 3.2-3.4 -> 3.6-3.7 at 8 rows, 44.9-47.4 -> 53.5-54.9 at 128) or tied (Q4_0).
    // AVX-512 (a group in one vector) runs the 32-value types 16 rows a tile: their dots hold 16 accumulators and the
    // block's 8 decoded chunks in 32 registers, and each chunk decoded serves twice the rows. Zen 4, 2 threads, the
    // two tile sizes in turn on the same weights (a one-off script, 10 passes over 30 SmolLM2-shaped or 2 1B-shaped
    // layers), 8 -> 16: SmolLM2's Q4_1 0.95x at 16 rows, 0.97x at 24, 0.96x at 244; Q8_0 0.86x at 16, 0.90x at 32,
    // 1.00x at 244; the 1B's Q4_0 / Q4_1 / Q8_0 0.92 / 0.91 / 0.82x at 16, 0.96 / 0.96 / 0.88x at 32, 1.03 / 1.00 /
    // 0.97x at 128. Q4_K's and Q6_K's dots hold 16 decoded chunks and their scales: 8 rows. A row's dots are the
    // same either way. AVX2's Q6_K runs both halves a block at a time at every row count (dot_q6k_both): with a pass
    // per half, a compiled batch-1 step of a 1B Q4_K_M (its Q6_K ~30 % of the bytes) took 28.7 and 23.6 ms against
    // the former 4-row layout's 25.7 and 18.6, one pass 32.6 / 21.3 / 22.1 against 25.9 / 24.6 / 25.6 (Zen 4,
    // EMBER_ISA=avx2, scripts/profile_decode.py FILE --batch 1 --context 256, trees in turn).
    constexpr int64_t tile = H == 2 && T == ember::kQ8_0 ? B::kBothRows : H == 1 && !kq ? kWideTile : kRowTile;
    for (int64_t m0 = 0; m0 < a.rows; m0 += tile) {
      const int64_t mt = g_min64(tile, a.rows - m0);
      const DotFn fn = dot_for<T, static_cast<int>(tile)>(mt);
      const GgufActs x{a.x.q + m0 * a.x.ldq, a.x.d + m0 * nb, a.x.bsum + m0 * (k / 16),
                       kq ? nullptr : a.x.off + m0 * nb, kq ? nullptr : a.x.msum + m0 * nb, nullptr, nullptr,
                       T == ember::kQ4_K ? a.x.s32 + m0 * (k / 32) : nullptr, a.x.ldq};
      for (int64_t gi = n0 / 16; gi < (n1 + 15) / 16; ++gi) {
        if constexpr (H == 2 && T == ember::kQ6_K) {
          q6k_both_for<static_cast<int>(tile)>(mt)(a.w + gi * group_bytes, x, k, res);
          store_rows(a, m0, mt, 16 * gi, 16, n1, res);
          continue;
        }
        if constexpr (H == 2 && T != ember::kQ6_K) {
          if (mt <= B::kBothRows) {
            B::template both_for<T, B::kBothRows>(mt)(a.w + gi * group_bytes, x, k, res);
            store_rows(a, m0, mt, 16 * gi, 16, n1, res);
            continue;
          }
        }
        for (int h = 0; h < H; ++h) {
          const int64_t r0 = 16 * gi + L * h;
          if (r0 >= n1) break;
          fn(a.w + gi * group_bytes, h, x, k, res);
          store_rows(a, m0, mt, r0, L, n1, res);
        }
      }
    }
  }
};

}  // namespace
