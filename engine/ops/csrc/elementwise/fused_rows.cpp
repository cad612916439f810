// Fused row-wise ops for the eager prefill: ember::rms_norm, ember::rope and ember::silu_mul. ISA: none (generic
// x86-64; bf16 rows go to the tier's vector kernels, norm_rope_<isa>.cpp and silu_mul_<isa>.cpp; the loops here
// take the other dtypes and the scalar tier). The bf16 kernels halved rms_norm and rope (a 256 x 576 SmolLM2 norm
// 44 -> 22 us, its q's rope 62 -> 28 us, AMX Xeon, 2 threads): a 256-token prefill 69-72 -> 66-67 ms.
//
// Why: the compiled decode step gets these fused by Inductor, but prefill runs eagerly (its token count varies), and
// there each op was a handful of aten calls over the whole [tokens, hidden] activation: on SmolLM2's 256-token prefill
// the muls, adds, pows, cats and copies of rms_norm and rope took ~35 ms of ~250 (Zen 4, 2 threads). silu * up in
// bf16 (ember::silu_mul, vector kernels in silu_mul_<isa>.cpp): torch's silu and mul over the strided halves of the
// gate|up output took 75 + 56 us a 128-token SmolLM2 layer on the AMX Xeon.
// Each op here reads its input once and writes its output once. Rounding follows the torch ops they replace: fp32
// math, rounded to the activations' dtype where torch rounds (after the normalisation, after each rope product), so
// a bf16 model sees the values its eager reference would, up to the summation order of a mean.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/cpu_isa.h"
#include "elementwise/norm_rope.h"
#include "elementwise/silu_mul.h"

namespace ember {
namespace {

constexpr int64_t kGrainElements = 16384;  // rows per thread at least this many elements: small calls stay serial

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename Fn>
void over_rows(int64_t rows, int64_t row_elements, const Fn& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)), fn);
}

template <typename Fn>
void by_dtype(const at::Tensor& x, const char* op, const Fn& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, got ", x.scalar_type());
  }
}

// The active tier's bf16 row kernel(s) (norm_rope.h, silu_mul.h); on the scalar tier `none` (null: the generic loops
// below).
template <class K>
K for_tier(K none, K (*avx2)(), K (*avx512)()) {
  const Isa isa = active_isa();
  return isa == Isa::kScalar ? none : isa == Isa::kAvx2 ? avx2() : avx512();
}

RowKernels row_kernels() { return for_tier(RowKernels{nullptr, nullptr}, row_kernels_avx2, row_kernels_avx512); }

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension (HF's LlamaRMSNorm order: normalise in fp32, round
// to x's dtype, then scale in that dtype).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm takes contiguous tensors");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight must be [x.size(-1)]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  const int64_t N = x.size(-1), rows = N == 0 ? 0 : x.numel() / N;
  at::Tensor out = at::empty_like(x);
  by_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const RmsNormRow fast = std::is_same_v<T, c10::BFloat16> ? row_kernels().rms_norm : nullptr;
    over_rows(rows, N, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (fast != nullptr) {
          fast(reinterpret_cast<const uint16_t*>(xp + r * N), reinterpret_cast<const uint16_t*>(wp),
               reinterpret_cast<uint16_t*>(op + r * N), N, static_cast<float>(eps));
          continue;
        }
        const T* xr = xp + r * N;
        T* orow = op + r * N;
        float ss = 0.f;
        for (int64_t i = 0; i < N; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(N) + static_cast<float>(eps));
        for (int64_t i = 0; i < N; ++i) {
          const float normed = static_cast<float>(round_to<T>(static_cast<float>(xr[i]) * inv));
          orow[i] = round_to<T>(static_cast<float>(wp[i]) * normed);
        }
      }
    });
  });
  return out;
}

// x [T, heads, D] (any strides, the last one 1: q or k as views of the fused qkv projection) rotated by cos/sin
// [T, R] (x's dtype, R <= D, R even): the first R dims of each head as rotate-half pairs (i, i + R/2), the rest
// copied. Returns a new contiguous [T, heads, D].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope takes [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2,
              "rope: cos and sin must be contiguous [tokens, rotary_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: cos and sin must be in x's dtype");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(1), half = R / 2;
  TORCH_CHECK(cos.size(0) == T && R <= D && R % 2 == 0, "rope: cos/sin must be [tokens, even rotary_dim <= D]");
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::Tensor out = at::empty({T, H, D}, x.options());
  by_dtype(x, "rope", [&](auto tag) {
    using E = decltype(tag);
    const E* xp = x.data_ptr<E>();
    const E* cp = cos.data_ptr<E>();
    const E* sp = sin.data_ptr<E>();
    E* op = out.data_ptr<E>();
    const RopeHead fast = std::is_same_v<E, c10::BFloat16> ? row_kernels().rope : nullptr;
    over_rows(T, H * D, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const E* c = cp + t * R;
        const E* s = sp + t * R;
        for (int64_t h = 0; h < H; ++h) {
          const E* xr = xp + t * st + h * sh;
          E* o = op + (t * H + h) * D;
          if (fast != nullptr) {
            fast(reinterpret_cast<const uint16_t*>(xr), reinterpret_cast<const uint16_t*>(c),
                 reinterpret_cast<const uint16_t*>(s), reinterpret_cast<uint16_t*>(o), R, D);
            continue;
          }
          for (int64_t i = 0; i < R; ++i) {  // torch's order: x * cos + rotate_half(x) * sin, each product rounded
            const float rot = i < half ? -static_cast<float>(xr[i + half]) : static_cast<float>(xr[i - half]);
            const float a = static_cast<float>(round_to<E>(static_cast<float>(xr[i]) * static_cast<float>(c[i])));
            const float b = static_cast<float>(round_to<E>(rot * static_cast<float>(s[i])));
            o[i] = round_to<E>(a + b);
          }
          for (int64_t i = R; i < D; ++i) o[i] = xr[i];
        }
      }
    });
  });
  return out;
}

// x [T, 2I] bf16 (the fused gate|up projection's output): [T, I] = silu(x[:, :I]) * x[:, I:], rounded as torch
// rounds each of the two ops. silu comes from `table` (silu_mul.h; engine/ops/fused.py makes it with torch's own
// silu): a bf16 input has 65536 values, and a computed silu landing within an fp32 ulp of a bf16 rounding boundary
// (it does, for inputs as common as 5.9375) would round the other way from torch's.
at::Tensor silu_mul(const at::Tensor& x, const at::Tensor& table) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_mul takes a contiguous [tokens, 2 I]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "silu_mul takes bfloat16, got ", x.scalar_type());
  TORCH_CHECK(table.is_contiguous() && table.element_size() == 2 && table.numel() == 65537,
              "silu_mul's table must be 65537 contiguous 16-bit entries");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  const SiluMulRow row = for_tier<SiluMulRow>(nullptr, silu_mul_row_avx2, silu_mul_row_avx512);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* tp = reinterpret_cast<const uint16_t*>(table.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  over_rows(T, 2 * I, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* gate = xp + t * 2 * I;
      const uint16_t* up = gate + I;
      uint16_t* o = op + t * I;
      for (int64_t i = row != nullptr ? row(gate, up, tp, o, I) : 0; i < I; ++i) {
        const float s = c10::detail::f32_from_bits(tp[gate[i]]);
        o[i] = c10::BFloat16(s * c10::detail::f32_from_bits(up[i])).x;
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor x, Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("rms_norm", &ember::rms_norm);
  m.impl("rope", &ember::rope);
  m.impl("silu_mul", &ember::silu_mul);
}
