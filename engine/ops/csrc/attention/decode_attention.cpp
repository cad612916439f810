// ember::decode_attention on CPU: one new token per request attends over its KV in the token pool. This file checks
// the arguments, writes the new K/V, picks the kernel of the active ISA tier (common/cpu_isa.h) and spreads
// (request, KV head) tasks over the threads; it also holds the portable loop. ISA: none (generic x86-64).
//
// Why C++: the decode step calls this once per layer; as a Python custom op the dispatch and the dozen
// small aten calls around the gather cost ~0.5 ms per call, more than the math at small batch sizes.
// Layout (engine/pools.py): k_cache/v_cache [num_slots + 1, kv_heads, head_dim]; req_to_token
// [rows, max_context] int32 maps (row, position) -> slot. The new K/V are written first, so a token sees itself.
// An int8 or fp8 cache ([num_slots + 1, kv_heads, head_dim + 4], decode_attention.h) is told apart by its dtype: the
// new K/V are quantized into it (attention/kv_write.h, as engine/ops/kv_quant.py) and the kernels read it as is.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <limits>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/kv_types.h"
#include "common/cpu_isa.h"

namespace ember {
namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename C>
constexpr int64_t extra() { return kScaled<C> ? kQ8ScaleBytes : 0; }  // row_extra of c10's types
template <typename C>
inline float row_scale(const C* row, int64_t D) {
  if constexpr (kScaled<C>) return q8_scale(reinterpret_cast<const int8_t*>(row), D);
  else return 1.f;
}

// The portable path (the scalar tier, or a head size without a vector kernel): same math, one element at a time.
// C: the cache's storage type (T, another float type, or int8 / fp8, whose rows are D + 4 bytes and carry a scale).
template <typename C>
void attend_scalar(const float* qf, int64_t G, int64_t D, const C* kp, const C* vp, const int32_t* slots, int64_t L,
                   int64_t KVH, int64_t kh, std::vector<float>& scores, float* kv_row, float* acc) {
  const int64_t R = D + extra<C>();
  scores.assign(G * L, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    const C* krow = kp + (static_cast<int64_t>(slots[l]) * KVH + kh) * R;
    const float ks = row_scale(krow, D);
    for (int64_t d = 0; d < D; ++d) kv_row[d] = to_f(krow[d]) * ks;
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * kv_row[d];
      scores[g * L + l] = s;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax in fp32
    float* sg = scores.data() + g * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < L; ++l) m = std::max(m, sg[l]);
    float sum = 0.f;
    for (int64_t l = 0; l < L; ++l) { sg[l] = std::exp(sg[l] - m); sum += sg[l]; }
    for (int64_t l = 0; l < L; ++l) sg[l] /= sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    const C* vrow = vp + (static_cast<int64_t>(slots[l]) * KVH + kh) * R;
    const float vs = row_scale(vrow, D);
    for (int64_t d = 0; d < D; ++d) kv_row[d] = to_f(vrow[d]) * vs;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + l];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * kv_row[d];
    }
  }
}

// Rows of one request at consecutive positions that share one task (decode_attention.h's AttendOne): enough that a
// verify step's K/V rows are read a few times rather than once per row, few enough that a one-request step still
// has tasks for every thread.
constexpr int64_t kMergeRows = 4;

// T: the activations' type (q, out); C: the cache's (T itself, or int8_t for the int8 cache).
template <typename T, typename C>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& req_to_token, const at::Tensor& req_rows, const at::Tensor& seq_lens,
            at::Tensor& out, double scale, Isa isa) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), G = H / KVH, ctx = req_to_token.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t R = D + extra<C>();  // a cache row's elements
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // the tier's vector kernel for this storage type and head size, or nullptr (the portable loop)
  const auto fast = kernel_in<C>(tier_table(isa, attention_kernels_avx512, attention_kernels_avx2), D);
  using Raw = RawOf<C>;
  const Raw* kraw = reinterpret_cast<const Raw*>(kp);
  const Raw* vraw = reinterpret_cast<const Raw*>(vp);

  // One task per (run of rows, kv head): a run is one row, or up to kMergeRows rows of one request at consecutive
  // positions (a verify step's last token and drafts, engine/speculative.py), whose G query heads each share every
  // K/V row they read. The portable loop takes rows one at a time.
  std::vector<int64_t> run_start;
  for (int64_t b = 0; b < B; ++b) {
    const bool joins = fast != nullptr && b > 0 && rows[b] == rows[b - 1] && lens[b] == lens[b - 1] + 1 &&
                       b - run_start.back() < kMergeRows;
    if (!joins) run_start.push_back(b);
  }
  const int64_t runs = static_cast<int64_t>(run_start.size());
  run_start.push_back(B);
  at::parallel_for(0, runs * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, kv_row(D);
    std::vector<int64_t> qlen;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / KVH, kh = task % KVH, b0 = run_start[r], nr = run_start[r + 1] - b0;
      const int64_t L = lens[b0 + nr - 1], GQ = G * nr;  // the run's last row sees the most positions
      const int32_t* slots = table + rows[b0] * ctx;
      qf.resize(GQ * D);
      acc.resize(GQ * D);
      qlen.resize(GQ);
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const T* qrow = qp + ((b0 + i) * H + kh * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qf[(i * G + g) * D + d] = to_f(qrow[d]) * fscale;
          qlen[i * G + g] = lens[b0 + i];
        }
      if (fast != nullptr) {
        scores.resize(GQ * ((L + 15) / 16 * 16) + GQ + GQ * D);
        fast(qf.data(), GQ, kraw, vraw, slots, L, KVH * R, kh, scores.data(), acc.data(),
             nr > 1 ? qlen.data() : nullptr);
      } else {
        attend_scalar<C>(qf.data(), G, D, kp, vp, slots, L, KVH, kh, scores, kv_row.data(), acc.data());
      }
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t g = 0; g < G; ++g) {
          T* orow = op + ((b0 + i) * H + kh * G + g) * D;
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[(i * G + g) * D + d]);
        }
    }
  });
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& out_slots, const at::Tensor& req_to_token, const at::Tensor& req_rows,
               const at::Tensor& seq_lens, double scale, Isa isa) {
  check_kv(q, k, v, k_cache, v_cache, req_to_token);
  TORCH_CHECK(out_slots.scalar_type() == at::kLong && req_rows.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "slots, rows and lengths must be int64");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor slots = out_slots.contiguous(), rows = req_rows.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor table = req_to_token.contiguous();
  at::Tensor out = at::empty_like(qc);
  with_kv_types(qc, kc, vc, k_cache, v_cache, slots.data_ptr<int64_t>(), slots.numel(), "decode_attention",
                [&](auto t, auto c) {
                  attend<decltype(t), decltype(c)>(qc, k_cache, v_cache, table, rows, lens, out, scale, isa);
                });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& req_to_token,
                            const at::Tensor& req_rows, const at::Tensor& seq_lens, double scale) {
  return run(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows, seq_lens, scale, active_isa());
}

// One named tier, whatever is active: how the tests run every tier the CPU supports.
at::Tensor decode_attention_isa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& req_to_token,
                                const at::Tensor& req_rows, const at::Tensor& seq_lens, double scale,
                                const std::string& isa) {
  return run(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows, seq_lens, scale, parse_isa(isa));
}

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_slots, "
      "Tensor req_to_token, Tensor req_rows, Tensor seq_lens, float scale) -> Tensor");
  m.def(
      "decode_attention_isa(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_slots, "
      "Tensor req_to_token, Tensor req_rows, Tensor seq_lens, float scale, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("decode_attention", &ember::decode_attention);
  m.impl("decode_attention_isa", &ember::decode_attention_isa);
}
