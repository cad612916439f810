// Writing this step's K/V into a layer's cache, for ember::decode_attention (decode_attention.cpp). ISA: none.
// A float cache takes the rows as they are (converted when --kv-cache-dtype differs from the activations); an int8 or
// fp8 e4m3 cache takes each [D] head-row quantized with its own scale (layout: decode_attention.h).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "attention/decode_attention.h"

namespace ember {
namespace kv_write_detail {
template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }
}  // namespace kv_write_detail

// T: the new K/V's type; C: the cache's (T, or another float type: converted here).
template <typename T, typename C>
void write_kv(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t n) {
  const int64_t row = src.size(1) * src.size(2);
  const T* s = src.data_ptr<T>();
  C* c = cache.data_ptr<C>();
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, C>) {
      std::copy(s + i * row, s + (i + 1) * row, c + slots[i] * row);
    } else {
      for (int64_t j = 0; j < row; ++j) {
        c[slots[i] * row + j] = static_cast<C>(kv_write_detail::to_float(s[i * row + j]));
      }
    }
  }
}

// C = int8_t or c10::Float8_e4m3fn. Each [kv_heads, D] row of src: s = absmax * (1 / qmax) (qmax 127 or 448, e4m3's
// largest finite value), y = x * (1 / s); int8 stores round(y) (half to even, as torch.round), fp8 stores y clamped to
// +-qmax and rounded by c10's conversion (the one torch's .to(float8_e4m3fn) uses); the scale's 4 bytes follow.
// These are engine/ops/kv_quant.py quantize_rows' fp32 operations in its order, so both write identical bytes. Built
// without -ffast-math (which the extension otherwise uses): it would fold the constant into the reciprocal and round
// other fp32 values than the reference does.
template <typename T, typename C>
__attribute__((optimize("no-fast-math"))) void write_kv_scaled(const at::Tensor& src, at::Tensor& cache,
                                                               const int64_t* slots, int64_t n) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  constexpr double kMax = kInt8 ? 127.0 : 448.0;
  const int64_t KVH = src.size(1), D = src.size(2), R = D + kQ8ScaleBytes;
  const T* s = src.data_ptr<T>();
  uint8_t* c = reinterpret_cast<uint8_t*>(cache.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < KVH; ++h) {
      const T* x = s + (i * KVH + h) * D;
      uint8_t* out = c + (slots[i] * KVH + h) * R;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(kv_write_detail::to_float(x[d])));
      const float scale = amax * static_cast<float>(1.0 / kMax);
      const float inv = scale > 0.f ? 1.0f / scale : 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float y = kv_write_detail::to_float(x[d]) * inv;
        if constexpr (kInt8) {
          const int8_t q = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(y))));
          std::memcpy(out + d, &q, 1);
        } else {
          const C q(std::min(448.f, std::max(-448.f, y)));
          std::memcpy(out + d, &q, 1);
        }
      }
      std::memcpy(out + D, &scale, sizeof(float));
    }
  }
}

}  // namespace ember
