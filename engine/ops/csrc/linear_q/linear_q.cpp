// ember::linear_q on CPU: y[M, N] = x[M, K] @ W[N, K]^T for a weight in Ember's quantized format (linear_q.h,
// engine/quant/format.py), x and y in bf16 or fp32. This file checks the arguments, quantizes x to int16 per 32
// inputs once per call, picks the kernel of the active ISA tier and spreads blocks of 32 output rows over the
// threads (common/parallel_blocks.h). ISA: none (generic x86-64).
//
// Kernel per tier: avx512 and avx512bf16 run the AVX512-VNNI kernel where the CPU has VNNI (every AVX512-BF16 CPU
// does; Skylake-SP does not) and the AVX2 kernel otherwise; avx2 the AVX2 kernel; scalar the portable reference.
#include "linear_q/linear_q.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "common/cpu_isa.h"
#include "common/parallel_blocks.h"
#include "common/widen_bf16.h"

namespace ember {
namespace {

enum class Variant { kScalar, kAvx2, kAvx512Vnni };

Variant variant_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512: return cpu_has_avx512_vnni() ? Variant::kAvx512Vnni : Variant::kAvx2;
    case Isa::kAvx2: return Variant::kAvx2;
    case Isa::kScalar: break;
  }
  return Variant::kScalar;
}

QLinearKernel kernel_for(Isa isa, const QLayout& layout) {
  switch (variant_for(isa)) {
    case Variant::kAvx512Vnni: return linear_q_kernel_avx512vnni(layout);
    case Variant::kAvx2: return linear_q_kernel_avx2(layout);
    case Variant::kScalar: break;
  }
  return linear_q_kernel_scalar(layout);
}

at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
               const c10::optional<at::Tensor>& mins, int64_t n, Isa isa) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_q takes bfloat16 or float32 input");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  (qweight.scalar_type() == at::kByte || qweight.scalar_type() == at::kChar),
              "qweight must be contiguous uint8 (4-bit) or int8 (8-bit) packed [ceil(N/4), 4 * row bytes]");
  const int bits = qweight.scalar_type() == at::kByte ? 4 : 8;
  TORCH_CHECK(qweight.size(1) % 4 == 0 && n > 4 * (qweight.size(0) - 1) && n <= 4 * qweight.size(0),
              "qweight [", qweight.size(0), ", ", qweight.size(1), "] is not a packed weight of ", n, " rows");
  const int64_t row_bytes = qweight.size(1) / 4, k = bits == 4 ? 2 * row_bytes : row_bytes;
  TORCH_CHECK(k % 32 == 0 && k > 0, "linear_q needs K to be a positive multiple of 32, got ", k);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == qweight.size(0) && scales.size(1) % 4 == 0 &&
                  scales.is_contiguous() && scales.size(1) > 0 &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "scales must be contiguous float16/float32 packed [ceil(N/4), 4 * K/G]");
  const int64_t groups = scales.size(1) / 4, group = k / groups;
  TORCH_CHECK(k % groups == 0 && (group % 32 == 0 || (group == 16 && bits == 8)),
              "group size must be a multiple of 32 (or 16 for 8-bit weights), got K=", k, " / ", groups);
  const bool has_min = mins.has_value() && mins->defined();
  if (has_min) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type() &&
                    mins->is_contiguous(), "mins must have the shape and dtype of scales");
    TORCH_CHECK(group != 16, "per-16 groups take no mins");
  }
  TORCH_CHECK(x.size(-1) == k, "input has ", x.size(-1), " features, weight expects ", k);
  const QLayout layout{bits, scales.scalar_type() == at::kHalf, has_min, group};
  const QLinearKernel kernel = kernel_for(isa, layout);

  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k, nb = k / 32;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (rows == 0 || n == 0) return out;
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()) : nullptr;
  QLinearArgs args{nullptr, nullptr, nullptr, nullptr, static_cast<const uint8_t*>(qweight.data_ptr()),
                   scales.data_ptr(), has_min ? mins->data_ptr() : nullptr, rows, k, n, layout, bf16,
                   out.data_ptr()};
  // Plain buffers: a decode step makes ~120 of these calls (see parallel_blocks.h on tensor allocations).
  std::vector<int16_t> xq;
  std::vector<float> xd, xs, widened;
  const bool tile = rows >= kQTileMinRows && kernel.run_block_tile != nullptr;
  if (tile) {
    if (bf16) widened = widen_bf16(xb, rows * k);
    args.xf = bf16 ? widened.data() : xc.data_ptr<float>();
  } else {
    xq.resize(rows * k);
    xd.resize(rows * nb);
    xs.resize(rows * nb);
    kernel.quantize(bf16 ? nullptr : xc.data_ptr<float>(), xb, rows, k, xq.data(), xd.data(), xs.data());
    if (has_min && group > 32) {  // the mins' activation sums per weight group, not per block: sum in place
      const int64_t rep = group / 32;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          float sum = 0.0f;
          for (int64_t b = 0; b < rep; ++b) sum += xs[r * nb + g * rep + b];
          xs[r * groups + g] = sum;  // never ahead of what it reads: r * groups + g <= r * nb + g * rep
        }
    }
    args.xq = xq.data();
    args.xd = xd.data();
    args.xs = xs.data();
  }
  const auto run_block = tile ? kernel.run_block_tile : kernel.run_block;
  parallel_blocks((n + kQBlockRows - 1) / kQBlockRows, q_scratch_floats(tile ? rows : 0, k),
                  [&](int64_t b, float* scratch) { run_block(args, b, scratch); });
  return out;
}

at::Tensor linear_q(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& mins, int64_t n) {
  return run(x, qweight, scales, mins, n, active_isa());
}

// One named tier, whatever is active: how the tests run every tier the CPU supports.
at::Tensor linear_q_isa(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t n, const std::string& isa) {
  return run(x, qweight, scales, mins, n, parse_isa(isa));
}

std::string linear_q_variant(const std::string& isa) {
  const Variant v = variant_for(parse_isa(isa));
  return v == Variant::kAvx512Vnni ? "avx512vnni" : v == Variant::kAvx2 ? "avx2" : "scalar";
}

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("linear_q(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int n) -> Tensor");
  m.def("linear_q_isa(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int n, str isa) -> Tensor");
  m.def("linear_q_variant(str isa) -> str", &ember::linear_q_variant);
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("linear_q", &ember::linear_q);
  m.impl("linear_q_isa", &ember::linear_q_isa);
}
