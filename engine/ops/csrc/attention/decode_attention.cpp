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
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <limits>
#include <memory>
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
// has tasks for every thread (8 rows in one task measured slower than two tasks of 4 for SmolLM2's 3 KV heads).
constexpr int64_t kMergeRows = 4;

// Positions one kernel call covers at most. A query's output is combined from its chunks' partial softmaxes, always
// in chunk order by one function (combine), so its bits depend on its own positions alone, not on how the chunks
// were spread over threads nor on its batch mates: a verify row still equals the same row decoded alone. Each
// chunk restarts the kernel's prefetch stream, which cost 5-15 % at 8-32 requests with 256-position chunks.
constexpr int64_t kChunkKeys = 1024;
// Below this many (run, KV head) tasks a thread, chunks become tasks of their own: a lone request of a model with
// 3 KV heads (SmolLM2) otherwise keeps one of two threads idle a third of the time, and one long request a KV head
// runs on one thread.
constexpr int64_t kTasksPerThread = 4;

// out [GQ, D] = sum over chunks of acc_c e^(m_c - M) / sum of s_c e^(m_c - M), chunks in order, M the largest m_c
// of the chunks the query sees. Chunk c's partials: acc + c * acc_stride ([GQ, D]) and stats + c * stats_stride
// ([GQ, 2] = (m, s); s = 0: it sees none of that chunk, skipped, so no infinity is ever computed with: the build has
// -ffast-math). One body (noinline), so every caller rounds alike.
__attribute__((noinline)) void combine(int64_t nch, int64_t GQ, int64_t D, const float* acc, int64_t acc_stride,
                                       const float* stats, int64_t stats_stride, float* out) {
  for (int64_t g = 0; g < GQ; ++g) {
    float M = 0.f;
    bool any = false;
    for (int64_t c = 0; c < nch; ++c) {
      const float* st = stats + c * stats_stride + g * 2;
      if (st[1] > 0.f) M = any ? std::max(M, st[0]) : st[0], any = true;
    }
    float S = 0.f;
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < nch; ++c) {
      const float* st = stats + c * stats_stride + g * 2;
      if (!(st[1] > 0.f)) continue;
      const float w = std::exp(st[0] - M);
      S += st[1] * w;
      const float* a = acc + c * acc_stride + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += a[d] * w;
    }
    const float inv = 1.f / S;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

// T: the activations' type (q, out); C: the cache's (T itself, or int8_t for the int8 cache).
template <typename T, typename C>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& req_to_token, const at::Tensor& req_rows, const at::Tensor& seq_lens,
            at::Tensor& out, double scale, Isa isa, bool force_dot) {
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
  // bf16 queries over a bf16 cache on the avx512bf16 tier: tile products on an AMX CPU (decode_attention_amx.cpp),
  // else vdpbf16ps (decode_attention_dpbf16.cpp; force_dot: on an AMX CPU too, for its tests), for every run alike (a
  // verify row must have the same bits alone as in its run), so runs are capped at 16 query rows.
  const bool bf16_pair = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && fast != nullptr &&
                         isa == Isa::kAvx512Bf16 && G <= 16;
  const bool amx = bf16_pair && !force_dot && (D == 64 || D == 128) && cpu_has_amx_bf16();
  const AttendBf16 dot = bf16_pair && !amx ? attend_dpbf16_kernel(D) : nullptr;
  const bool bf16k = amx || dot != nullptr;  // a kernel that reads the queries as they are (bf16), scale apart
  const int64_t merge_rows = bf16k ? std::min<int64_t>(kMergeRows, 16 / G) : kMergeRows;

  // Runs: one row, or up to kMergeRows rows of one request at consecutive positions (a verify step's last token and
  // drafts, engine/speculative.py), whose G query heads each share every K/V row they read. The portable loop takes
  // rows one at a time. first_chunk[r]: run r's first chunk of kChunkKeys positions, counted over all runs.
  std::vector<int64_t> run_start, first_chunk{0};
  for (int64_t b = 0; b < B; ++b) {
    const bool joins = fast != nullptr && b > 0 && rows[b] == rows[b - 1] && lens[b] == lens[b - 1] + 1 &&
                       b - run_start.back() < merge_rows;
    if (joins) {
      first_chunk.back() = first_chunk[first_chunk.size() - 2] + (lens[b] + kChunkKeys - 1) / kChunkKeys;
    } else {
      run_start.push_back(b);
      first_chunk.push_back(first_chunk.back() + (lens[b] + kChunkKeys - 1) / kChunkKeys);
    }
  }
  const int64_t runs = static_cast<int64_t>(run_start.size()), chunks = first_chunk.back();
  run_start.push_back(B);
  // A task: (run, KV head), all its chunks, combined on the spot; or, with few of those, (chunk, KV head), its
  // partials kept in acc_all / stats_all and combined once all tasks are done.
  const bool spread = fast != nullptr && chunks > runs && runs * KVH < kTasksPerThread * at::get_num_threads();
  const int64_t GQmax = G * kMergeRows;
  std::unique_ptr<float[]> acc_all(spread ? new float[chunks * KVH * GQmax * D] : nullptr);
  std::unique_ptr<float[]> stats_all(spread ? new float[chunks * KVH * GQmax * 2] : nullptr);
  // spread: the run of each chunk, and the chunks in the order threads take them: every full chunk before the
  // shorter last ones, so that the threads finish together (taken one at a time, see below).
  std::vector<int64_t> chunk_run, order;
  for (int64_t r = 0; spread && r < runs; ++r) {
    chunk_run.insert(chunk_run.end(), first_chunk[r + 1] - first_chunk[r], r);
    for (int64_t c = first_chunk[r]; c < first_chunk[r + 1] - 1; ++c) order.push_back(c);
  }
  for (int64_t r = 0; spread && r < runs; ++r) order.push_back(first_chunk[r + 1] - 1);

  // Run r's query heads of KV head kh as fp32 (pre-scaled; not for the bf16 kernels, which read them as they are)
  // and each one's length.
  const auto gather_q = [&](int64_t r, int64_t kh, std::vector<float>& qf, std::vector<int64_t>& qlen) {
    const int64_t b0 = run_start[r], nr = run_start[r + 1] - b0;
    qf.resize(bf16k ? 0 : G * nr * D);
    qlen.resize(G * nr);
    for (int64_t i = 0; i < nr; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + ((b0 + i) * H + kh * G + g) * D;
        if (!bf16k)
          for (int64_t d = 0; d < D; ++d) qf[(i * G + g) * D + d] = to_f(qrow[d]) * fscale;
        qlen[i * G + g] = lens[b0 + i];
      }
  };
  // Chunk c (of run r's) of KV head kh into acc / stats ([GQ, D], [GQ, 2]).
  const auto chunk = [&](int64_t r, int64_t kh, int64_t c, const std::vector<float>& qf,
                         const std::vector<int64_t>& qlen, std::vector<int64_t>& qc, std::vector<float>& scores,
                         float* acc, float* stats) {
    const int64_t b0 = run_start[r], nr = run_start[r + 1] - b0, GQ = G * nr;
    const int64_t L = lens[b0 + nr - 1], l0 = c * kChunkKeys, Lc = std::min(kChunkKeys, L - l0);
    qc.resize(GQ);
    for (int64_t i = 0; i < GQ; ++i) qc[i] = std::clamp<int64_t>(qlen[i] - l0, 0, Lc);
    scores.resize(GQ * ((Lc + 15) / 16 * 16) + GQ + GQ * D);
    if (bf16k) {
      uint16_t qb[16 * 128];  // the run's queries of this KV head as they are (bf16), [GQ, D]
      for (int64_t i = 0; i < nr; ++i)
        std::memcpy(qb + i * G * D, qp + ((b0 + i) * H + kh * G) * D, G * D * sizeof(uint16_t));
      const auto* kb = reinterpret_cast<const uint16_t*>(kp);
      const auto* vb = reinterpret_cast<const uint16_t*>(vp);
      if (amx)
        attend_amx_bf16(qb, GQ, D, fscale, kb, vb, table + rows[b0] * ctx + l0, Lc, KVH * R, kh, scores.data(), acc,
                        stats, nr > 1 ? qc.data() : nullptr);
      else
        dot(qb, GQ, fscale, kb, vb, table + rows[b0] * ctx + l0, Lc, KVH * R, kh, scores.data(), acc, stats,
            nr > 1 ? qc.data() : nullptr);
      return;
    }
    fast(qf.data(), GQ, kraw, vraw, table + rows[b0] * ctx + l0, Lc, KVH * R, kh, scores.data(), acc, stats,
         nr > 1 ? qc.data() : nullptr);
  };
  // res: [GQ, D], normalised, or (stats given) one chunk's partial, whose combine is res / sum: the same bits.
  const auto write_out = [&](int64_t r, int64_t kh, const float* res, const float* stats) {
    const int64_t b0 = run_start[r], nr = run_start[r + 1] - b0;
    for (int64_t i = 0; i < nr; ++i)
      for (int64_t g = 0; g < G; ++g) {
        T* orow = op + ((b0 + i) * H + kh * G + g) * D;
        const float* x = res + (i * G + g) * D;
        if (stats != nullptr) {
          const float inv = 1.f / stats[(i * G + g) * 2 + 1];
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(x[d] * inv);
        } else {
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(x[d]);
        }
      }
  };

  if (spread) {  // few tasks of unequal sizes: each thread takes the next chunk until none is left
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      std::vector<float> qf, scores;
      std::vector<int64_t> qlen, qc;
      for (int64_t t = next++; t < chunks * KVH; t = next++) {
        const int64_t c = order[t / KVH], kh = t % KVH, r = chunk_run[c], at = c * KVH + kh;
        gather_q(r, kh, qf, qlen);
        chunk(r, kh, c - first_chunk[r], qf, qlen, qc, scores, acc_all.get() + at * GQmax * D,
              stats_all.get() + at * GQmax * 2);
      }
    });
  }
  at::parallel_for(0, spread ? 0 : runs * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, stats, res, scores, kv_row(D);
    std::vector<int64_t> qlen, qc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kh = task % KVH, r = task / KVH, b0 = run_start[r], nr = run_start[r + 1] - b0, GQ = G * nr;
      gather_q(r, kh, qf, qlen);
      res.resize(GQ * D);
      if (fast == nullptr) {
        attend_scalar<C>(qf.data(), G, D, kp, vp, table + rows[b0] * ctx, lens[b0], KVH, kh, scores, kv_row.data(),
                         res.data());
        write_out(r, kh, res.data(), nullptr);
        continue;
      }
      const int64_t nch = first_chunk[r + 1] - first_chunk[r];
      acc.resize(nch * GQ * D);
      stats.resize(nch * GQ * 2);
      for (int64_t c = 0; c < nch; ++c)
        chunk(r, kh, c, qf, qlen, qc, scores, acc.data() + c * GQ * D, stats.data() + c * GQ * 2);
      if (nch == 1) {  // (most calls: contexts up to kChunkKeys)
        write_out(r, kh, acc.data(), stats.data());
      } else {
        combine(nch, GQ, D, acc.data(), GQ * D, stats.data(), GQ * 2, res.data());
        write_out(r, kh, res.data(), nullptr);
      }
    }
  });
  if (!spread) return;
  // The spread chunks' partials, per (run, KV head), combined where they lie (a chunk's are KVH slots apart).
  std::vector<float> res;
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t nch = first_chunk[r + 1] - first_chunk[r], GQ = G * (run_start[r + 1] - run_start[r]);
    res.resize(GQ * D);
    for (int64_t kh = 0; kh < KVH; ++kh) {
      const int64_t at = first_chunk[r] * KVH + kh;
      combine(nch, GQ, D, acc_all.get() + at * GQmax * D, KVH * GQmax * D, stats_all.get() + at * GQmax * 2,
              KVH * GQmax * 2, res.data());
      write_out(r, kh, res.data(), nullptr);
    }
  }
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& out_slots, const at::Tensor& req_to_token, const at::Tensor& req_rows,
               const at::Tensor& seq_lens, double scale, Isa isa, bool force_dot = false) {
  check_kv(q, k, v, k_cache, v_cache, req_to_token);
  TORCH_CHECK(out_slots.scalar_type() == at::kLong && req_rows.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "slots, rows and lengths must be int64");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor slots = out_slots.contiguous(), rows = req_rows.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor table = req_to_token.contiguous();
  at::Tensor out = at::empty_like(qc);
  with_kv_types(qc, kc, vc, k_cache, v_cache, slots.data_ptr<int64_t>(), slots.numel(), "decode_attention",
                [&](auto t, auto c) {
                  attend<decltype(t), decltype(c)>(qc, k_cache, v_cache, table, rows, lens, out, scale, isa, force_dot);
                });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& req_to_token,
                            const at::Tensor& req_rows, const at::Tensor& seq_lens, double scale) {
  return run(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows, seq_lens, scale, active_isa());
}

// One named tier, whatever is active: how the tests run every tier the CPU supports. "avx512bf16:dot" is that tier
// with the AVX512-BF16 kernel even on an AMX CPU (which otherwise takes tile products), so both are tested there.
at::Tensor decode_attention_isa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& req_to_token,
                                const at::Tensor& req_rows, const at::Tensor& seq_lens, double scale,
                                const std::string& isa) {
  const bool dot = isa == "avx512bf16:dot";
  return run(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows, seq_lens, scale,
             parse_isa(dot ? "avx512bf16" : isa), dot);
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
