// ember::decode_attention on CPU: one new token per request attends over its KV in the token pool. This file checks
// the arguments, writes the new K/V, picks the kernel of the active ISA tier (common/cpu_isa.h) and spreads
// (request, KV head) tasks over the threads; it also holds the portable loop. ISA: none (generic x86-64).
//
// Why C++: the decode step calls this once per layer; as a Python custom op the dispatch and the dozen
// small aten calls around the gather cost ~0.5 ms per call, more than the math at small batch sizes.
// Layout (engine/pools.py): k_cache/v_cache [num_slots + 1, kv_heads, head_dim]; req_to_token
// [rows, max_context] int32 maps (row, position) -> slot. The new K/V are written first, so a token sees itself.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <limits>
#include <vector>

#include "attention/decode_attention.h"
#include "common/cpu_isa.h"

namespace ember {
namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
void write_kv(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t n) {
  const int64_t row = src.size(1) * src.size(2);
  const T* s = src.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(s + i * row, s + (i + 1) * row, c + slots[i] * row);
  }
}

// The portable path (the scalar tier, or a head size without a vector kernel): same math, one element at a time.
template <typename T>
void attend_scalar(const float* qf, int64_t G, int64_t D, const T* kp, const T* vp, const int32_t* slots, int64_t L,
                   int64_t KVH, int64_t kh, std::vector<float>& scores, float* kv_row, float* acc) {
  scores.assign(G * L, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    const T* krow = kp + (static_cast<int64_t>(slots[l]) * KVH + kh) * D;
    for (int64_t d = 0; d < D; ++d) kv_row[d] = to_f(krow[d]);
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
    const T* vrow = vp + (static_cast<int64_t>(slots[l]) * KVH + kh) * D;
    for (int64_t d = 0; d < D; ++d) kv_row[d] = to_f(vrow[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + l];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * kv_row[d];
    }
  }
}

// The tier's vector kernel for this storage type and head size, or nullptr (the portable loop).
template <typename T>
auto vector_kernel(Isa isa, int64_t D) {
  AttentionKernels table{nullptr, nullptr, nullptr};
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) table = attention_kernels_avx512();
  else if (isa == Isa::kAvx2) table = attention_kernels_avx2();
  if constexpr (std::is_same_v<T, float>) return table.f32 ? table.f32(D) : nullptr;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return table.bf16 ? table.bf16(D) : nullptr;
  else return table.f16 ? table.f16(D) : nullptr;
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& req_to_token, const at::Tensor& req_rows, const at::Tensor& seq_lens,
            at::Tensor& out, double scale, Isa isa) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), G = H / KVH, ctx = req_to_token.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const auto fast = vector_kernel<T>(isa, D);
  // The kernels see c10's 2-byte types as the layout-identical Bf16 / Half of common/dtypes.h.
  using Raw = std::conditional_t<std::is_same_v<T, float>, float,
                                 std::conditional_t<std::is_same_v<T, c10::BFloat16>, Bf16, Half>>;
  const Raw* kraw = reinterpret_cast<const Raw*>(kp);
  const Raw* vraw = reinterpret_cast<const Raw*>(vp);

  // One task per (request, kv head): its G query heads share every K/V row they read.
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kv_row(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH;
      const int64_t L = lens[b];
      const int32_t* slots = table + rows[b] * ctx;
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(qrow[d]) * fscale;
      }
      if (fast != nullptr) {
        scores.resize(G * ((L + 15) / 16 * 16) + G);
        fast(qf.data(), G, kraw, vraw, slots, L, KVH * D, kh, scores.data(), acc.data());
      } else {
        attend_scalar<T>(qf.data(), G, D, kp, vp, slots, L, KVH, kh, scores, kv_row.data(), acc.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = op + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& out_slots, const at::Tensor& req_to_token, const at::Tensor& req_rows,
               const at::Tensor& seq_lens, double scale, Isa isa) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [B, heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt, "req_to_token must be int32");
  TORCH_CHECK(out_slots.scalar_type() == at::kLong && req_rows.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "slots, rows and lengths must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor slots = out_slots.contiguous(), rows = req_rows.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor table = req_to_token.contiguous();
  at::Tensor out = at::empty_like(qc);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    write_kv<T>(kc, k_cache, slots.data_ptr<int64_t>(), slots.numel());
    write_kv<T>(vc, v_cache, slots.data_ptr<int64_t>(), slots.numel());
    attend<T>(qc, k_cache, v_cache, table, rows, lens, out, scale, isa);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
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
