// ember::decode_attention on CPU: one new token per request attends over its KV in the token pool.
//
// Why C++: the decode step calls this once per layer; as a Python custom op the dispatch and the dozen
// small aten calls around the gather cost ~0.5 ms per call, more than the math at small batch sizes.
// Layout (engine/pools.py): k_cache/v_cache [num_slots + 1, kv_heads, head_dim]; req_to_token
// [rows, max_context] int32 maps (row, position) -> slot. The new K/V are written first, so a token sees itself.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

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

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& req_to_token, const at::Tensor& req_rows, const at::Tensor& seq_lens,
            at::Tensor& out, double scale) {
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

  // One task per (request, kv head): its G query heads share every K/V row they read.
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kv_row(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH;
      const int64_t L = lens[b];
      const int32_t* slots = table + rows[b] * ctx;
      scores.assign(G * L, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(qrow[d]) * fscale;
      }
      for (int64_t l = 0; l < L; ++l) {
        const T* krow = kp + (static_cast<int64_t>(slots[l]) * KVH + kh) * D;
        for (int64_t d = 0; d < D; ++d) kv_row[d] = to_f(krow[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kv_row[d];
          scores[g * L + l] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax in fp32
        float* sg = scores.data() + g * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t l = 0; l < L; ++l) m = std::max(m, sg[l]);
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) { sg[l] = std::exp(sg[l] - m); sum += sg[l]; }
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < L; ++l) sg[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const T* vrow = vp + (static_cast<int64_t>(slots[l]) * KVH + kh) * D;
        for (int64_t d = 0; d < D; ++d) kv_row[d] = to_f(vrow[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + l];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * kv_row[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = op + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& req_to_token,
                            const at::Tensor& req_rows, const at::Tensor& seq_lens, double scale) {
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "ember_decode_attention", [&] {
    write_kv<scalar_t>(kc, k_cache, slots.data_ptr<int64_t>(), slots.numel());
    write_kv<scalar_t>(vc, v_cache, slots.data_ptr<int64_t>(), slots.numel());
    attend<scalar_t>(qc, k_cache, v_cache, table, rows, lens, out, scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_slots, "
      "Tensor req_to_token, Tensor req_rows, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CPU, m) { m.impl("decode_attention", &decode_attention); }
