// The activation and KV cache types the attention drivers (decode_attention.cpp, prefill_attention.cpp) accept, and
// the one dispatch over them: writing this step's K/V into the cache and handing the kernels their raw layout types.
// ISA: none.
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "attention/decode_attention.h"
#include "attention/kv_write.h"
#include "common/cpu_isa.h"

namespace ember {

// The 1-byte caches with a scale per row: int8 and fp8 e4m3 (decode_attention.h, engine/ops/kv_quant.py).
template <typename C>
constexpr bool kScaled = std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn>;

// The kernels see c10's types as the layout-identical Bf16 / Half / Fp8E4M3 of common/dtypes.h.
template <typename C>
using RawOf = std::conditional_t<std::is_same_v<C, float> || std::is_same_v<C, int8_t>, C,
              std::conditional_t<std::is_same_v<C, c10::BFloat16>, Bf16,
              std::conditional_t<std::is_same_v<C, c10::Half>, Half, Fp8E4M3>>>;

// The tier's table of kernels (decode's AttentionKernels or prefill's PrefillKernels), all nullptr on `scalar`.
template <typename Table>
Table tier_table(Isa isa, Table (*avx512)(), Table (*avx2)()) {
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) return avx512();
  if (isa == Isa::kAvx2) return avx2();
  return Table{};
}

// The table's kernel for cache storage type C (c10's) and this head size, or nullptr. Both tables name their
// members f32, bf16, f16, q8 and fp8.
template <typename C, typename Table>
auto kernel_in(const Table& t, int64_t head_dim) {
  using Raw = RawOf<C>;
  if constexpr (std::is_same_v<Raw, float>) return t.f32 ? t.f32(head_dim) : nullptr;
  else if constexpr (std::is_same_v<Raw, Bf16>) return t.bf16 ? t.bf16(head_dim) : nullptr;
  else if constexpr (std::is_same_v<Raw, Half>) return t.f16 ? t.f16(head_dim) : nullptr;
  else if constexpr (std::is_same_v<Raw, int8_t>) return t.q8 ? t.q8(head_dim) : nullptr;
  else return t.fp8 ? t.fp8(head_dim) : nullptr;
}

// fn(T{}, C{}) with T the activations' type (q's) and C the cache's storage type (--kv-cache-dtype), after writing
// k and v (T, [n, kv_heads, D]) into the caches at `slots` (quantized for an int8 / fp8 cache, converted for another
// float type).
template <typename Fn>
void with_kv_types(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const int64_t* slots, int64_t n, const char* op, const Fn& fn) {
  auto for_q = [&](auto tag) {
    using T = decltype(tag);
    auto for_cache = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      if constexpr (kScaled<C>) {
        write_kv_scaled<T, C>(k, k_cache, slots, n);
        write_kv_scaled<T, C>(v, v_cache, slots, n);
      } else {
        write_kv<T, C>(k, k_cache, slots, n);
        write_kv<T, C>(v, v_cache, slots, n);
      }
      fn(T{}, C{});
    };
    switch (k_cache.scalar_type()) {
      case at::kChar: for_cache(int8_t{}); break;
      case at::kFloat8_e4m3fn: for_cache(c10::Float8_e4m3fn{}); break;
      case at::kFloat: for_cache(float{}); break;
      case at::kBFloat16: for_cache(c10::BFloat16{}); break;
      case at::kHalf: for_cache(c10::Half{}); break;
      default: TORCH_CHECK(false, "KV caches are float32, bfloat16, float16, int8 or float8_e4m3fn, got ",
                           k_cache.scalar_type());
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: for_q(float{}); break;
    case at::kBFloat16: for_q(c10::BFloat16{}); break;
    case at::kHalf: for_q(c10::Half{}); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
}

// The checks both attention ops make of their tensors; an int8 or fp8 cache (its dtype is the only flag) has rows of
// head_dim + 4 bytes, the scale last.
inline void check_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& req_to_token) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt, "req_to_token must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  const bool q8 = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(k_cache.size(2) == q.size(2) + (q8 ? kQ8ScaleBytes : 0),
              "KV cache rows must be head_dim long, or head_dim + 4 bytes for int8 (the scale)");
}

}  // namespace ember
