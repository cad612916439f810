// Prefill attention for one task (a request, a KV head, a block of its new tokens: prefill_attention.h), written
// once over a vector type V (common/simd_*.h) and included by prefill_attention_avx2.cpp / _avx512.cpp inside their
// ISA's target region. Flash attention's order: keys in blocks of kPrefillKeys, each block's K and V rows widened
// to fp32 once for all M query rows, scores as a small GEMM (W query rows a vector, a key's element broadcast),
// an online softmax per query row (vectorised across rows), then probs . V with the output rows in registers.
// No std:: templates here (see linear/linear_bf16_body.h for why).
#pragma once

#include "attention/prefill_attention.h"

namespace {

// Below any score: the softmax's running maximum starts here and masked scores take it. Finite, since the extension
// builds with -ffast-math (infinities may be assumed away); its exponent clamps to e^-87 and masked terms are zeroed.
constexpr float kMasked = -1e30f;

template <class V>
struct PrefillBody {
  using F = typename V::F;
  static constexpr int W = V::W;
  static constexpr int MV = 4;  // query-row vectors per score pass
  static constexpr int kRows = MV * W;  // a task's M is a multiple of this
  static constexpr int JB = V::kRegisters >= 32 ? 4 : 3;  // keys per score pass: JB * MV accumulators
  static constexpr int ACC = V::kRegisters >= 32 ? 16 : 12;  // accumulators of a probs . V pass

  // Value vectors of a row per probs . V pass: the whole row up to 6, else the largest of 4, 3, 2 dividing it.
  static constexpr int chunk(int dv) { return dv <= 6 ? dv : dv % 4 == 0 ? 4 : dv % 3 == 0 ? 3 : dv % 2 == 0 ? 2 : 1; }
  static constexpr int pow2_floor(int x) { return x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; }

  // bk rows of K or V (slots[0 .. bk)) widened to fp32 into dst [bk, D], an int8 / fp8 row's scale applied.
  template <int DV, typename T>
  static void widen_rows(const T* base, const int32_t* slots, int64_t bk, int64_t stride, int64_t kh, float* dst) {
    constexpr int64_t D = DV * W;
    const int64_t R = D + ember::row_extra<T>();
    for (int64_t j = 0; j < bk; ++j) {
      const T* row = base + static_cast<int64_t>(slots[j]) * stride + kh * R;
      float* o = dst + j * D;
      if constexpr (ember::row_extra<T>() != 0) {
        const F s = V::set1(ember::q8_scale(row, D));
        for (int c = 0; c < DV; ++c) V::store(o + c * W, V::mul(V::load(row + c * W), s));
      } else {
        for (int c = 0; c < DV; ++c) V::store(o + c * W, V::load(row + c * W));
      }
    }
  }

  // S[j, m] = kb[j] . qt[:, m] for j < bk rounded up to JB (rows past bk are never read) and every m < M.
  template <int DV>
  static void scores(const float* qt, int64_t M, const float* kb, int64_t bk, float* S) {
    constexpr int64_t D = DV * W;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      for (int64_t j = 0; j < bk; j += JB) {
        F acc[JB][MV];
        for (int r = 0; r < JB; ++r)
          for (int c = 0; c < MV; ++c) acc[r][c] = V::zero();
        const float* kj = kb + j * D;
        for (int64_t d = 0; d < D; ++d) {  // JB broadcasts live, one query vector at a time (AVX2: 16 registers)
          F kv[JB];
          for (int r = 0; r < JB; ++r) kv[r] = V::set1(kj[r * D + d]);
          for (int c = 0; c < MV; ++c) {
            const F q = V::load(qt + d * M + m0 + c * W);
            for (int r = 0; r < JB; ++r) acc[r][c] = V::fma(kv[r], q, acc[r][c]);
          }
        }
        for (int r = 0; r < JB; ++r)
          for (int c = 0; c < MV; ++c) V::store(S + (j + r) * M + m0 + c * W, acc[r][c]);
      }
    }
  }

  // The online softmax over one key block, W query rows at a time: scores become probabilities against the new
  // running maximum, alpha[m] rescales what row m had so far. diag: some key of the block lies past some row's
  // position (the causal mask applies).
  static void softmax_block(float* S, int64_t M, int64_t bk, int64_t j0, bool diag, const float* qpos, float* mx,
                            float* l, float* alpha) {
    const F masked = V::set1(kMasked), zero = V::zero();
    for (int64_t m = 0; m < M; m += W) {
      const F qp = V::load(qpos + m);
      F top = masked;
      for (int64_t j = 0; j < bk; ++j) {
        F s = V::load(S + j * M + m);
        if (diag) s = V::le_select(V::set1(static_cast<float>(j0 + j)), qp, s, masked);
        top = V::max(top, s);
      }
      const F old = V::load(mx + m), now = V::max(old, top);
      const F a = V::exp(V::sub(old, now));
      F sum = zero;
      for (int64_t j = 0; j < bk; ++j) {
        F p = V::exp(V::sub(V::load(S + j * M + m), now));
        if (diag) p = V::le_select(V::set1(static_cast<float>(j0 + j)), qp, p, zero);
        V::store(S + j * M + m, p);
        sum = V::add(sum, p);
      }
      V::store(mx + m, now);
      V::store(alpha + m, a);
      V::store(l + m, V::fma(V::load(l + m), a, sum));
    }
  }

  // out[m] = out[m] * alpha[m] + sum_j S[j, m] * vb[j] for the first `rows` query rows (first block: no out yet).
  template <int DV>
  static void values(const float* S, int64_t M, int64_t rows, int64_t bk, const float* vb, const float* alpha,
                     float* out, bool first) {
    constexpr int DC = chunk(DV), RB = pow2_floor(ACC / DC);
    constexpr int64_t D = DV * W;
    for (int64_t m = 0; m < rows; m += RB) {
      for (int c0 = 0; c0 < DV; c0 += DC) {
        F acc[RB][DC];
        for (int r = 0; r < RB; ++r) {
          const F a = V::set1(alpha[m + r]);
          for (int c = 0; c < DC; ++c)
            acc[r][c] = first ? V::zero() : V::mul(V::load(out + (m + r) * D + (c0 + c) * W), a);
        }
        for (int64_t j = 0; j < bk; ++j) {  // RB broadcasts live, one value vector at a time
          F p[RB];
          for (int r = 0; r < RB; ++r) p[r] = V::set1(S[j * M + m + r]);
          for (int c = 0; c < DC; ++c) {
            const F x = V::load(vb + j * D + (c0 + c) * W);
            for (int r = 0; r < RB; ++r) acc[r][c] = V::fma(p[r], x, acc[r][c]);
          }
        }
        for (int r = 0; r < RB; ++r)
          for (int c = 0; c < DC; ++c) V::store(out + (m + r) * D + (c0 + c) * W, acc[r][c]);
      }
    }
  }

  template <int DV, typename T>
  static void run(const float* qt, int64_t M, int64_t G, int64_t nq, int64_t first_pos, const T* k, const T* v,
                  const int32_t* slots, int64_t stride, int64_t kh, float* scratch, float* out) {
    constexpr int64_t D = DV * W;
    constexpr int RB = pow2_floor(ACC / chunk(DV));
    float* kb = scratch;
    float* vb = kb + ember::kPrefillKeys * D;
    float* S = vb + ember::kPrefillKeys * D;
    float* mx = S + (ember::kPrefillKeys + 4) * M;
    float* l = mx + M;
    float* alpha = l + M;
    float* qpos = alpha + M;
    const int64_t used = G * nq, rows = (used + RB - 1) / RB * RB;  // rows <= M: M is a multiple of kRows
    for (int64_t m = 0; m < M; ++m) {
      mx[m] = kMasked;
      l[m] = 0.f;
      qpos[m] = static_cast<float>(first_pos + (m < used ? m / G : nq - 1));  // a padding row sees every key
    }
    const int64_t L = first_pos + nq;
    for (int64_t j0 = 0; j0 < L; j0 += ember::kPrefillKeys) {
      const int64_t bk = L - j0 < ember::kPrefillKeys ? L - j0 : ember::kPrefillKeys;
      widen_rows<DV>(k, slots + j0, bk, stride, kh, kb);
      widen_rows<DV>(v, slots + j0, bk, stride, kh, vb);
      scores<DV>(qt, M, kb, bk, S);
      softmax_block(S, M, bk, j0, j0 + bk - 1 > first_pos, qpos, mx, l, alpha);
      values<DV>(S, M, rows, bk, vb, alpha, out, j0 == 0);
    }
    for (int64_t m = 0; m < used; ++m) {
      const F inv = V::set1(1.0f / l[m]);
      for (int c = 0; c < DV; ++c) V::store(out + m * D + c * W, V::mul(V::load(out + m * D + c * W), inv));
    }
  }

  template <typename T>
  static ember::PrefillOne<T> for_head_dim(int64_t D) {
    if (D % W != 0) return nullptr;
    switch (D / W) {  // head sizes 32, 64, 80, 96, 128, 256 on either vector width
      case 2: return run<2, T>;
      case 4: return run<4, T>;
      case 5: return run<5, T>;
      case 6: return run<6, T>;
      case 8: return run<8, T>;
      case 10: return run<10, T>;
      case 12: return run<12, T>;
      case 16: return run<16, T>;
      case 32: return run<32, T>;
      default: return nullptr;
    }
  }

  static ember::PrefillKernels kernels() {
    return {for_head_dim<float>, for_head_dim<Bf16>, for_head_dim<Half>, for_head_dim<int8_t>, for_head_dim<Fp8E4M3>};
  }
};

}  // namespace
