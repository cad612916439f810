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

constexpr int64_t kAhead = 16;  // rows prefetched ahead: K/V rows sit at scattered slots the hardware can't predict

template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T0);
}

// e^x for x <= 0 (scores minus their max): 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-7
// Taylor series (relative error < 1e-7, below fp32 rounding of the sums it feeds).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane j of the result = the sum of all 16 lanes of v[j]: 16 dot products finished with 15 shuffle+add pairs
// instead of 16 full horizontal reductions.
inline __m512 reduce16(const __m512* v) {
  __m512 r[8], s[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: partial sums of keys 4i .. 4i+3
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // [s0.L0+L2, s0.L1+L3, s1.L0+L2, s1.L1+L3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// One request and one KV head (head_dim = 16 * NC): the G query heads sharing that KV head attend over its L
// positions. qf: [G, D] fp32, pre-scaled. scores: scratch of G * Lp floats (Lp = L rounded up to 16).
// out: [G, D] fp32, normalised.
template <int NC, typename T>
void attend_one(const float* qf, int64_t G, const T* kp, const T* vp, const int32_t* slots, int64_t L,
                int64_t kv_stride, int64_t kh, float* scores, float* out) {
  constexpr int64_t D = 16 * NC;
  const int64_t Lp = (L + 15) / 16 * 16;
  auto row = [&](const T* base, int64_t l) { return base + static_cast<int64_t>(slots[l]) * kv_stride + kh * D; };
  __m512 dots[16];
  for (int64_t l0 = 0; l0 < L; l0 += 16) {  // scores = q . k, 16 keys at a time
    const int64_t n = std::min<int64_t>(16, L - l0);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= n) { dots[j] = _mm512_setzero_ps(); continue; }
        const T* kr = row(kp, l0 + j);
        if (g == 0 && l0 + j + kAhead < L) prefetch_row(row(kp, l0 + j + kAhead), D * sizeof(T));
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(kr));
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), load16(kr + 16 * c), acc);
        dots[j] = acc;
      }
      _mm512_storeu_ps(scores + g * Lp + l0, reduce16(dots));
    }
  }
  float* inv = scores + G * Lp;  // the caller's scratch holds G * Lp + G floats
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators in place; the 1 / sum is applied to the output
    float* sg = scores + g * Lp;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t l0 = 0; l0 < L; l0 += 16)
      m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail_mask(L - l0), sg + l0));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
      const __mmask16 mask = tail_mask(L - l0);
      const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + l0), mx)));
      _mm512_storeu_ps(sg + l0, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // out = probs . V, for GC heads at a time so their accumulators stay in registers.
  constexpr int64_t GC = NC >= 16 ? 1 : 16 / NC;
  for (int64_t g0 = 0; g0 < G; g0 += GC) {
    const int64_t gn = std::min(GC, G - g0);
    __m512 acc[GC][NC];
    for (int64_t g = 0; g < GC; ++g)
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      if (l + kAhead < L) prefetch_row(row(vp, l + kAhead), D * sizeof(T));
      const T* vr = row(vp, l);
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = load16(vr + 16 * c);
      for (int64_t g = 0; g < GC; ++g) {
        if (g >= gn) break;
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * Lp + l]);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < gn; ++g) {
      const __m512 s = _mm512_set1_ps(inv[g0 + g]);
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + (g0 + g) * D + 16 * c, _mm512_mul_ps(acc[g][c], s));
    }
  }
}

template <typename T>
using AttendOne = void (*)(const float*, int64_t, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t,
                           float*, float*);

template <typename T>
AttendOne<T> attend_one_for(int64_t D) {
  switch (D) {
    case 32: return attend_one<2, T>;
    case 64: return attend_one<4, T>;
    case 80: return attend_one<5, T>;
    case 96: return attend_one<6, T>;
    case 128: return attend_one<8, T>;
    case 256: return attend_one<16, T>;
    default: return nullptr;  // other head sizes take the scalar loop
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

// The portable path (no AVX-512, or an unusual head size): same math, one element at a time.
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
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(qrow[d]) * fscale;
      }
#if defined(__AVX512F__)
      if (const auto fast = attend_one_for<T>(D)) {
        scores.resize(G * ((L + 15) / 16 * 16) + G);
        fast(qf.data(), G, kp, vp, slots, L, KVH * D, kh, scores.data(), acc.data());
      } else
#endif
      {
        attend_scalar<T>(qf.data(), G, D, kp, vp, slots, L, KVH, kh, scores, kv_row.data(), acc.data());
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
