// ember::prefill_attention on CPU: each request's new tokens attend causally over its whole context in the token
// pool (the prefix already cached, then the chunk itself). This file checks the arguments, writes the new K/V,
// cuts the work into tasks (prefill_attention.h) and spreads them over the threads; the kernels are per ISA tier.
// ISA: none (generic x86-64).
//
// Why not SDPA: per layer it wants dense [heads, tokens, D] K/V (a gather from the pool, a repeat per query head
// under GQA, int8 rows dequantized into a copy) and ran at 56-77 GFLOP/s for 256-512-token prompts on two Zen 4 cores.
// Here each block of keys is widened once for all the query heads and tokens of a task, straight from the pool.
// The scalar tier has no kernel: engine/ops/attention.py runs its SDPA reference there (and for head sizes without
// one, prefill_kernel_ready says which).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/kv_types.h"
#include "attention/prefill_attention.h"
#include "common/cpu_isa.h"
#include "common/parallel_blocks.h"

namespace ember {
namespace {

struct Task {
  int64_t request, kh, tok0, nq, first_pos;  // tok0: the block's first row of q; first_pos: its position
};

int64_t rows_per_pass(Isa isa) {
  return isa == Isa::kAvx2 ? prefill_rows_avx2() : prefill_rows_avx512();
}

template <typename C>
PrefillOne<RawOf<C>> kernel_for(Isa isa, int64_t D) {
  return kernel_in<C>(tier_table(isa, prefill_kernels_avx512, prefill_kernels_avx2), D);
}

// Tokens per task: as many as one pass of rows holds (at least one).
int64_t task_tokens(Isa isa, int64_t G) { return std::max<int64_t>(1, rows_per_pass(isa) / G); }

template <typename T, typename C>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& req_to_token,
            const std::vector<Task>& tasks, const std::vector<int64_t>& req_rows, at::Tensor& out, double scale,
            Isa isa) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH, ctx = req_to_token.size(1);
  const int64_t stride = KVH * k_cache.size(2);
  const auto kernel = kernel_for<C>(isa, D);  // (run checked that the head size has kernels)
  const int64_t unit = rows_per_pass(isa), M = (G * task_tokens(isa, G) + unit - 1) / unit * unit;  // task rows
  // bf16 queries over a bf16 cache on an AMX CPU: tile products (prefill_attention_amx.cpp).
  const bool amx = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> &&
                   isa == Isa::kAvx512Bf16 && D % 64 == 0 && D <= 256 && M <= kPrefillAmxRows && cpu_has_amx_bf16();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const auto* kp = reinterpret_cast<const RawOf<C>*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const RawOf<C>*>(v_cache.data_ptr());
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const auto write_rows = [&](const Task& t, const float* acc) {
    for (int64_t i = 0; i < t.nq; ++i)
      for (int64_t g = 0; g < G; ++g) {
        T* row = op + ((t.tok0 + i) * H + t.kh * G + g) * D;
        const float* src = acc + (i * G + g) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<T>(src[d]);
      }
  };
  // Per thread: the task's queries (transposed, pre-scaled fp32 [D, M]; AMX: as they are, bf16 [M, D]), its output
  // rows [M, D], then the vector kernel's scratch.
  const int64_t floats = 2 * M * D + prefill_scratch_floats(M, D);
  parallel_blocks(static_cast<int64_t>(tasks.size()), floats, [&](int64_t b, float* scratch) {
    const Task& t = tasks[b];
    float* qt = scratch;
    float* acc = qt + M * D;
    const int32_t* slots = table + req_rows[t.request] * ctx;
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
      if (amx) {
        auto* qb = reinterpret_cast<uint16_t*>(qt);
        const int64_t rows = G * t.nq, padded = (rows + 15) / 16 * 16;
        for (int64_t i = 0; i < t.nq; ++i)  // the G query heads of a token are consecutive rows of q
          std::memcpy(qb + i * G * D, qp + ((t.tok0 + i) * H + t.kh * G) * D, G * D * sizeof(uint16_t));
        std::memset(qb + rows * D, 0, (padded - rows) * D * sizeof(uint16_t));
        prefill_amx_bf16(qb, G, t.nq, t.first_pos, D, fscale, reinterpret_cast<const uint16_t*>(kp),
                         reinterpret_cast<const uint16_t*>(vp), slots, stride, t.kh, acc);
        write_rows(t, acc);
        return;
      }
    }
    std::fill(qt, qt + M * D, 0.f);
    for (int64_t i = 0; i < t.nq; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const T* row = qp + ((t.tok0 + i) * H + t.kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qt[d * M + i * G + g] = static_cast<float>(row[d]) * fscale;
      }
    kernel(qt, M, G, t.nq, t.first_pos, kp, vp, slots, stride, t.kh, acc + M * D, acc);
    write_rows(t, acc);
  });
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& out_slots, const at::Tensor& req_to_token, const at::Tensor& req_rows,
               const at::Tensor& prefix_lens, const at::Tensor& prefill_lens, double scale, Isa isa) {
  check_kv(q, k, v, k_cache, v_cache, req_to_token);
  TORCH_CHECK(out_slots.scalar_type() == at::kLong && req_rows.scalar_type() == at::kLong &&
              prefix_lens.scalar_type() == at::kLong && prefill_lens.scalar_type() == at::kLong,
              "slots, rows and lengths must be int64");
  TORCH_CHECK(isa != Isa::kScalar, "prefill_attention has no scalar kernel (engine/ops/attention.py runs SDPA there)");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor slots = out_slots.contiguous(), table = req_to_token.contiguous();
  const at::Tensor rows_t = req_rows.contiguous(), prefix_t = prefix_lens.contiguous();
  const at::Tensor ext_t = prefill_lens.contiguous();
  const int64_t N = rows_t.numel(), G = q.size(1) / k_cache.size(1), KVH = k_cache.size(1);
  TORCH_CHECK(prefix_t.numel() == N && ext_t.numel() == N, "one prefix and one prefill length per request");
  TORCH_CHECK(kernel_for<float>(isa, q.size(2)) != nullptr, "prefill_attention has no ", isa_name(isa),
              " kernel for head size ", q.size(2));  // before the caches are written: an error changes nothing
  const int64_t nq_max = task_tokens(isa, G);
  std::vector<int64_t> rows(rows_t.data_ptr<int64_t>(), rows_t.data_ptr<int64_t>() + N);
  std::vector<Task> tasks;
  int64_t tok = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t prefix = prefix_t.data_ptr<int64_t>()[n], ext = ext_t.data_ptr<int64_t>()[n];
    TORCH_CHECK(prefix >= 0 && ext >= 0 && prefix + ext <= table.size(1), "request ", n, " runs past the context");
    for (int64_t i0 = 0; i0 < ext; i0 += nq_max)
      for (int64_t kh = 0; kh < KVH; ++kh)
        tasks.push_back({n, kh, tok + i0, std::min(nq_max, ext - i0), prefix + i0});
    tok += ext;
  }
  TORCH_CHECK(tok == q.size(0) && slots.numel() == tok, "the prefill lengths must add up to the tokens of q");
  at::Tensor out = at::empty_like(qc);
  with_kv_types(qc, kc, vc, k_cache, v_cache, slots.data_ptr<int64_t>(), tok, "prefill_attention",
                [&](auto t, auto c) {
                  attend<decltype(t), decltype(c)>(qc, k_cache, v_cache, table, tasks, rows, out, scale, isa);
                });
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& req_to_token,
                             const at::Tensor& req_rows, const at::Tensor& prefix_lens, const at::Tensor& prefill_lens,
                             double scale) {
  return run(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows, prefix_lens, prefill_lens, scale,
             active_isa());
}

// One named tier, whatever is active: how the tests run every tier the CPU supports.
at::Tensor prefill_attention_isa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                 at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& req_to_token,
                                 const at::Tensor& req_rows, const at::Tensor& prefix_lens,
                                 const at::Tensor& prefill_lens, double scale, const std::string& isa) {
  return run(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows, prefix_lens, prefill_lens, scale,
             parse_isa(isa));
}

// Whether the active tier has a kernel for this head size (engine/ops/attention.py runs SDPA where not).
bool prefill_kernel_ready(int64_t head_dim) {
  return kernel_for<float>(active_isa(), head_dim) != nullptr;
}

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_slots, "
      "Tensor req_to_token, Tensor req_rows, Tensor prefix_lens, Tensor prefill_lens, float scale) -> Tensor");
  m.def(
      "prefill_attention_isa(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_slots, "
      "Tensor req_to_token, Tensor req_rows, Tensor prefix_lens, Tensor prefill_lens, float scale, str isa) -> Tensor");
  m.def("prefill_kernel_ready(int head_dim) -> bool", &ember::prefill_kernel_ready);
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("prefill_attention", &ember::prefill_attention);
  m.impl("prefill_attention_isa", &ember::prefill_attention_isa);
}
