// ember::linear_gguf's AMX-INT8 path for the 16-row layout (Q4_0, Q4_1, Q8_0, Q4_K; linear_gguf.h): the int8
// path's activations and its exact integer dots, made by tiles (tdpbsud for the 4-bit codes, tdpbssd for Q8_0's)
// instead of vpdpbusd, then the int8 path's own float epilogue per block (linear_gguf_x16_dots.h's scale32 /
// scale_q4k, the same operations in the same order): its outputs are the int8 path's, bit for bit, at any row
// count, so a decode batch's size never tips a near-tie (the bf16 AMX path's rounding can).
//
// Why it is cheap: a group's chunk c (16 rows x 4 bytes, values 4c..4c+3 of each row's block) is one row of AMX's
// B layout, so Q8_0's 8 chunks are a B tile as they lie in memory and the 4-bit types' split into low and high
// nibbles with 8 vector ops a block; the driver lays the quantized activations out as A tiles (GgufActs::q32). One
// tile product does 16 x 16 x 32 multiply-adds; per block and activation row what is left is the epilogue (load,
// convert, 2-3 FMAs), against 8 vpdpbusd + 8 broadcasts + the same epilogue on the int8 path. What bounds it: one
// int32 C tile stored and read back per 32-value block (each block has its own scales), and that epilogue.
// Included at the end of linear_gguf_avx512vnni.cpp, inside its target region (AMX-TILE and AMX-INT8 added), over
// that file's 16-row policy. Only run where cpu_has_amx_int8().
#pragma once

#include "linear/amx_bf16.h"
#include "linear_gguf/linear_gguf_x16_dots.h"

namespace {

// Tiles 0-3: C, 16 activation rows x 16 weight rows of int32; 4-5: A, 16 activation rows x one 32-value block
// (int8); 6-7: B, one block of a group (8 chunks of 64 bytes). Rows past the call's are zeros (GgufActs::q32 is
// padded to 16 rows) and their results are not read.
inline void amx8_begin() {
  static constexpr uint8_t kRows[8] = {16, 16, 16, 16, 16, 16, 8, 8};
  static constexpr uint16_t kColsb[8] = {64, 64, 64, 64, 32, 32, 64, 64};
  ember::amx_config(kRows, kColsb);
}

template <class P>
struct X16Amx8 {
  struct Signed : P {  // Q8_0's codes dotted signed (tdpbssd): no offset to take off, unlike vpdpbusd's +128
    static constexpr bool kQ8Offset = false;
  };
  using D = X16Dots<Signed>;
  using I = typename P::I;
  using F = typename P::F;
  static_assert(P::L == 16, "one group is one zmm of rows");
  static constexpr int kC = 4;  // C tiles: blocks (or Q4_K sub-blocks) whose products are in flight at once

  // C tiles 0..n-1 = the A blocks x[i] (16 rows, row stride ldq) times the B blocks b[i] (8 x 64 bytes), stored to
  // out[i]. Each store is issued after the next product (a store waits for its product; 2-3 % faster than each
  // store straight after its product).
  // GCC's tile intrinsics paste their tile numbers into the instruction's text: literals only, hence the macros.
#define EMBER_AMX8_PRODUCT(C, A, B, DP) \
  _tile_zero(C);                         \
  _tile_loadd(A, x[C], ldq);             \
  _tile_loadd(B, b[C], 64);              \
  DP(C, A, B)
#define EMBER_AMX8_PRODUCTS(DP)                          \
  EMBER_AMX8_PRODUCT(0, 4, 6, DP);                        \
  if (n > 1) { EMBER_AMX8_PRODUCT(1, 5, 7, DP); }         \
  _tile_stored(0, out[0], 64);                            \
  if (n > 2) { EMBER_AMX8_PRODUCT(2, 4, 6, DP); }         \
  if (n > 1) _tile_stored(1, out[1], 64);                 \
  if (n > 3) { EMBER_AMX8_PRODUCT(3, 5, 7, DP); }         \
  if (n > 2) _tile_stored(2, out[2], 64);                 \
  if (n > 3) _tile_stored(3, out[3], 64)
  template <bool kSigned>
  static void products(int n, const int8_t* const* x, int64_t ldq, const uint8_t* const* b, int32_t (*out)[256]) {
    if constexpr (kSigned) {
      EMBER_AMX8_PRODUCTS(_tile_dpbssd);
    } else {
      EMBER_AMX8_PRODUCTS(_tile_dpbsud);
    }
  }
#undef EMBER_AMX8_PRODUCTS
#undef EMBER_AMX8_PRODUCT

  // 64 bytes of 4-bit codes to two B rows' worth: low nibbles at lo, high ones at hi.
  static void split(const uint8_t* q64, uint8_t* lo, uint8_t* hi) {
    const I q = P::load(q64), m = P::mask8(0x0F);
    _mm512_store_si512(lo, P::and_(q, m));
    _mm512_store_si512(hi, P::and_(P::srli16_4(q), m));
  }

  static void store_rows(const GgufLinearArgs& a, int64_t m0, int64_t mt, int64_t gi, int64_t n1, const F* acc) {
    alignas(64) float res[16];
    for (int64_t m = 0; m < mt; ++m) {
      P::storef(res, acc[m]);
      for (int64_t l = 0; l < 16 && 16 * gi + l < n1; ++l) g_store(a, (m0 + m) * a.n + 16 * gi + l, res[l]);
    }
  }

  // Every row of output block `block` (two groups), 16 activation rows at a time: 32-value types. Blocks go in
  // batches of kC tile products; each batch's products are issued before the previous batch's epilogue reads its
  // stored tiles, so the vector loads do not wait on the tile stores just before them (1-3 %; 1 thread, Q4_1 at 16
  // rows, 4096 x 2048 from DRAM, 704-736 -> 671-707 us).
  template <int T>
  static void run_block(const GgufLinearArgs& a, int64_t block, float*) {
    constexpr bool q8 = T == ember::kQ8_0;
    constexpr int bb = D::template bytes<T>(), hd = T == ember::kQ4_1 ? 64 : 32;
    const int64_t nb = a.k / 32, group_bytes = 16 * nb * bb, batches = (nb + kC - 1) / kC;
    const int64_t tile = 32 * a.rows_pad;  // bytes of one block's A tiles
    const int64_t n0 = block * ember::kGgufBlockRows, n1 = g_min64(n0 + ember::kGgufBlockRows, a.n);
    alignas(64) int32_t c[2][kC][256];
    alignas(64) uint8_t split_b[2][kC][512];
    amx8_begin();
    for (int64_t gi = n0 / 16; gi < (n1 + 15) / 16; ++gi) {
      const uint8_t* g = a.w + gi * group_bytes;
      for (int64_t m0 = 0; m0 < a.rows; m0 += 16) {
        const int64_t mt = g_min64(16, a.rows - m0);
        const auto issue = [&](int64_t t) {
          const int64_t b0 = t * kC;
          const int n = static_cast<int>(g_min64(kC, nb - b0));
          const int8_t* xs[kC];
          const uint8_t* bs[kC];
          for (int i = 0; i < n; ++i) {
            const uint8_t* blk = g + (b0 + i) * 16 * bb;
            if (m0 == 0) D::prefetch(blk, 16 * bb);
            xs[i] = a.x.q32 + (b0 + i) * tile + 32 * m0;
            if constexpr (q8) {
              bs[i] = blk + hd;
            } else {
              uint8_t* sp = split_b[t & 1][i];
              for (int q = 0; q < 4; ++q) split(blk + hd + 64 * q, sp + 64 * q, sp + 256 + 64 * q);
              bs[i] = sp;
            }
          }
          products<q8>(n, xs, 32, bs, c[t & 1]);
        };
        F acc[16];
        for (int m = 0; m < 16; ++m) acc[m] = P::zero();
        issue(0);
        for (int64_t t = 0; t < batches; ++t) {
          if (t + 1 < batches) issue(t + 1);
          const int64_t b0 = t * kC;
          const int n = static_cast<int>(g_min64(kC, nb - b0));
          F dw[kC], mw[kC];
          for (int i = 0; i < n; ++i) D::template dm32<T>(g + (b0 + i) * 16 * bb, 0, dw[i], mw[i]);
          // Per activation row, the batch's blocks in order (the int8 path's order of float operations): its
          // accumulator is loaded and stored once a batch, not once a block.
          for (int64_t m = 0; m < mt; ++m) {
            F r = acc[m];
            for (int i = 0; i < n; ++i)
              r = D::template scale32<T>(P::load(reinterpret_cast<const uint8_t*>(c[t & 1][i] + 16 * m)), dw[i],
                                         mw[i], a.x, (m0 + m) * nb + b0 + i, r);
            acc[m] = r;
          }
        }
        store_rows(a, m0, mt, gi, n1, acc);
      }
    }
    ember::amx_end();
  }

  // The same for Q4_K: per 256-value block, its 8 sub-blocks as two batches of tile products (chunks 8j.. of the
  // block hold sub-block 2j in their low nibbles and 2j + 1 in their high ones), each times its per-row 6-bit scale
  // in int32 as the int8 path's sum8_scaled, then scale_q4k; batches pipelined as above.
  static void run_block_q4k(const GgufLinearArgs& a, int64_t block, float*) {
    constexpr int bb = 144;
    const int64_t nsb = a.k / 256, group_bytes = 16 * nsb * bb, tile = 32 * a.rows_pad;  // a sub-block's A tiles
    const int64_t n0 = block * ember::kGgufBlockRows, n1 = g_min64(n0 + ember::kGgufBlockRows, a.n);
    alignas(64) int32_t c[2][kC][256];
    alignas(64) uint8_t split_b[2][8][512];
    amx8_begin();
    for (int64_t gi = n0 / 16; gi < (n1 + 15) / 16; ++gi) {
      const uint8_t* g = a.w + gi * group_bytes;
      for (int64_t m0 = 0; m0 < a.rows; m0 += 16) {
        const int64_t mt = g_min64(16, a.rows - m0);
        I scp[2][8], mnp[2][4];
        const auto issue = [&](int64_t t) {  // batch t: sub-blocks 4 (t % 2) .. of block t / 2
          const int64_t sb = t / 2, h = t % 2;
          const uint8_t* blk = g + sb * 16 * bb;
          if (h == 0) {
            if (m0 == 0) D::prefetch(blk, 16 * bb);
            D::q4k_scales(blk + 64, scp[sb & 1], mnp[sb & 1]);
            const uint8_t* qs = blk + 64 + 3 * 64;
            for (int j = 0; j < 4; ++j)
              for (int q = 0; q < 8; ++q)
                split(qs + 64 * (8 * j + q), split_b[sb & 1][2 * j] + 64 * q, split_b[sb & 1][2 * j + 1] + 64 * q);
          }
          const int8_t* xs[kC];
          const uint8_t* bs[kC];
          for (int i = 0; i < kC; ++i) {
            xs[i] = a.x.q32 + (8 * sb + 4 * h + i) * tile + 32 * m0;
            bs[i] = split_b[sb & 1][4 * h + i];
          }
          products<false>(kC, xs, 32, bs, c[t & 1]);
        };
        F acc[16];
        I isum[16];
        for (int m = 0; m < 16; ++m) acc[m] = P::zero();
        issue(0);
        for (int64_t t = 0; t < 2 * nsb; ++t) {
          if (t + 1 < 2 * nsb) issue(t + 1);
          const int64_t sb = t / 2, h = t % 2;
          const I* sc = scp[sb & 1] + 4 * h;
          for (int64_t m = 0; m < mt; ++m) {
            I s = P::mullo(P::load(reinterpret_cast<const uint8_t*>(c[t & 1][0] + 16 * m)), sc[0]);
            for (int i = 1; i < kC; ++i)
              s = P::add(s, P::mullo(P::load(reinterpret_cast<const uint8_t*>(c[t & 1][i] + 16 * m)), sc[i]));
            isum[m] = h == 0 ? s : P::add(isum[m], s);
          }
          if (h == 1) {
            const uint8_t* blk = g + sb * 16 * bb;
            const F d = P::half(blk), dmin = P::half(blk + 32);
            for (int64_t m = 0; m < mt; ++m)
              acc[m] = D::scale_q4k(isum[m], d, dmin, mnp[sb & 1], a.x.s32 + (m0 + m) * (a.k / 32) + 8 * sb,
                                    a.x.d[(m0 + m) * nsb + sb], acc[m]);
          }
        }
        store_rows(a, m0, mt, gi, n1, acc);
      }
    }
    ember::amx_end();
  }
};

}  // namespace
