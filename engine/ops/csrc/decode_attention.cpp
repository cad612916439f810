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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
// 16 lanes of a K/V/q row as fp32. bf16 -> fp32 is a 16-bit left shift of the raw bits.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// scores[g * L + l] = q_g . k_l for the G heads sharing this KV head (qf is fp32, pre-scaled).
template <typename T>
void qk_avx512(const float* qf, const T* kp, const int32_t* slots, int64_t L, int64_t G, int64_t D,
               int64_t kv_stride, int64_t kh, float* scores) {
  for (int64_t l = 0; l < L; ++l) {
    const T* krow = kp + static_cast<int64_t>(slots[l]) * kv_stride + kh * D;
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(load16(qf + g * D + d), load16(krow + d), acc);
      scores[g * L + l] = _mm512_reduce_add_ps(acc);
    }
  }
}

// acc[g] += p[g, l] * v_l over all l.
template <typename T>
void pv_avx512(const float* probs, const T* vp, const int32_t* slots, int64_t L, int64_t G, int64_t D,
               int64_t kv_stride, int64_t kh, float* acc) {
  for (int64_t l = 0; l < L; ++l) {
    const T* vrow = vp + static_cast<int64_t>(slots[l]) * kv_stride + kh * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = load16(vrow + d);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * D + d;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(probs[g * L + l]), v, _mm512_loadu_ps(a)));
      }
    }
  }
}
#endif

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
  const bool vec = D % 16 == 0;  // the AVX-512 paths work in whole 16-lane chunks
  (void)vec;

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
#if defined(__AVX512F__)
      if (vec) {
        qk_avx512<T>(qf.data(), kp, slots, L, G, D, KVH * D, kh, scores.data());
      } else
#endif
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
#if defined(__AVX512F__)
      if (vec) {
        pv_avx512<T>(scores.data(), vp, slots, L, G, D, KVH * D, kh, acc.data());
      } else
#endif
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
  auto run = [&](auto tag) {
    using T = decltype(tag);
    write_kv<T>(kc, k_cache, slots.data_ptr<int64_t>(), slots.numel());
    write_kv<T>(vc, v_cache, slots.data_ptr<int64_t>(), slots.numel());
    attend<T>(qc, k_cache, v_cache, table, rows, lens, out, scale);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_slots, "
      "Tensor req_to_token, Tensor req_rows, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CPU, m) { m.impl("decode_attention", &decode_attention); }
