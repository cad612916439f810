// ember::linear_bf16 and ember::linear_f32 on CPU: y[M, N] = x[M, K] @ W[N, K]^T with fp32 accumulation, over a weight
// packed once at load time (layouts: linear.h). This file checks the arguments, picks the block kernel of the active
// ISA tier (common/cpu_isa.h) and spreads the output blocks over the threads (common/parallel_blocks.h).
// ISA: none (generic x86-64).
#include "linear/linear.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/cpu_isa.h"
#include "common/parallel_blocks.h"
#include "common/row_stride.h"
#include "common/widen_bf16.h"
#include "linear/amx_bf16.h"

namespace ember {
namespace {

enum class Format { kBf16, kF32 };

LinearKernel kernel_for(Format format, Isa isa) {
  const char* name = format == Format::kBf16 ? "linear_bf16" : "linear_f32";
  switch (isa) {
    case Isa::kAvx512Bf16:
      return format == Format::kBf16 ? linear_bf16_kernel_avx512bf16() : linear_f32_kernel_avx512();
    case Isa::kAvx512: return format == Format::kBf16 ? linear_bf16_kernel_avx512() : linear_f32_kernel_avx512();
    case Isa::kAvx2: return format == Format::kBf16 ? linear_bf16_kernel_avx2() : linear_f32_kernel_avx2();
    case Isa::kScalar: break;
  }
  TORCH_CHECK(false, "ember::", name, " has no ", isa_name(isa), " kernel (it needs AVX2 or better)");
}

// bf16 on a CPU with AMX-BF16 (avx512bf16 tier): from this many rows on the packed blocks, which are AMX's B layout
// already, run through AMX tiles (linear/amx_bf16.h) instead of the vdpbf16ps micro-tiles. Measured on the AMX Xeon,
// 1 thread, GFLOP/s kernel vs amx on 2048x2048 / 16384x2048 / 2048x8192 (weights from DRAM): 1 row 16/11/13 vs
// 15/10/15, 2 rows 25/19/20 vs 29/20/24, 4 rows 37/33/34 vs 54/40/56, 8 rows 65/57/62 vs 120/79/113, 32 rows
// 94/94/92 vs 350/295/286, 64 rows ~100 vs 564/468/496.
constexpr int64_t kBf16AmxMinRows = 4;
constexpr int64_t kAmxChunk = 512;  // K values per pass of the row tiles: 512 x 32 x 2 B of weights in L1

enum class Path { kAuto, kKernel, kAmx };

bool amx_for(Format format, Isa isa, int64_t k) {
  return format == Format::kBf16 && isa == Isa::kAvx512Bf16 && k % 32 == 0 && cpu_has_amx_bf16();
}

// x [rows, K] bf16 (rows padded with zeros to a multiple of 16) @ the packed blocks, through AMX tiles.
void run_amx(const at::Tensor& xc, int64_t rows, const LinearArgs& a, int64_t blocks) {
  const int64_t k = a.k, rows_pad = (rows + 15) / 16 * 16;
  at::Tensor xb = xc.reshape({rows, k});
  if (rows_pad != rows) xb = at::constant_pad_nd(xb, {0, 0, 0, rows_pad - rows});
  xb = xb.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<c10::BFloat16>());
  parallel_blocks(blocks, rows_pad * kLinearBlock, [&](int64_t b, float* acc) {
    const uint16_t* wb = static_cast<const uint16_t*>(a.w) + b * k * kLinearBlock;
    amx_begin();
    for (int64_t k0 = 0; k0 < k; k0 += kAmxChunk)
      amx_bf16_block(xp + k0, k, rows_pad, wb + k0 * kLinearBlock, std::min(kAmxChunk, k - k0), acc, k0 == 0);
    amx_end();
    const int64_t ncols = std::min(kLinearBlock, a.n - b * kLinearBlock);
    amx_store_rows(acc, rows, ncols, static_cast<uint16_t*>(a.out) + b * kLinearBlock, a.n, true);
  });
}

at::Tensor run(const at::Tensor& x, const at::Tensor& w_packed, int64_t n, Isa isa, Format format,
               Path path = Path::kAuto) {
  const LinearKernel kernel = kernel_for(format, isa);
  const bool bf16 = format == Format::kBf16;
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(x.scalar_type() == dtype && w_packed.scalar_type() == dtype,
              bf16 ? "linear_bf16 takes bfloat16 input and weight" : "linear_f32 takes float32 input and weight");
  const int64_t blocks = w_packed.size(0);
  int64_t k = 0;
  if (bf16) {
    TORCH_CHECK(w_packed.dim() == 4 && w_packed.size(2) == kLinearBlock && w_packed.size(3) == 2 &&
                    w_packed.is_contiguous(),
                "weight must be packed [N_pad/32, K/2, 32, 2] (engine/ops/linear.py pack_linear_weight)");
    k = 2 * w_packed.size(1);
  } else {
    TORCH_CHECK(w_packed.dim() == 3 && w_packed.size(2) == kLinearBlock && w_packed.is_contiguous(),
                "weight must be packed [N_pad/32, K, 32] (engine/ops/linear.py pack_linear_weight)");
    k = w_packed.size(1);
  }
  TORCH_CHECK(x.size(-1) == k, "input has ", x.size(-1), " features, weight expects ", k);
  TORCH_CHECK(n > (blocks - 1) * kLinearBlock && n <= blocks * kLinearBlock, "n=", n, " does not match ", blocks,
              " blocks");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (rows == 0) return out;
  LinearArgs args{nullptr, nullptr, w_packed.data_ptr(), rows, k, n, out.data_ptr(), k};
  TORCH_CHECK(path != Path::kAmx || amx_for(format, isa, k), "linear_bf16: the AMX path needs bf16 weights with K a "
              "multiple of 32 on the avx512bf16 tier of a CPU with AMX-BF16");
  if (path == Path::kAuto && amx_for(format, isa, k) && rows >= kBf16AmxMinRows) path = Path::kAmx;
  if (path == Path::kAmx) {
    run_amx(xc, rows, args, blocks);
    return out;
  }
  // The input the kernel reads, at row_stride's padded stride when several rows share the call.
  std::vector<float> xf;
  std::vector<uint16_t> xb;
  if (!bf16) {
    args.ldx = row_stride(rows, k, sizeof(float));
    args.xf = xc.data_ptr<float>();
    if (args.ldx != k) args.xf = (xf = with_stride(args.xf, rows, k, args.ldx)).data();
  } else if (kernel.fp32_input) {
    args.ldx = row_stride(rows, k, sizeof(float));
    xf = widen_bf16(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), rows, k, args.ldx);
    args.xf = xf.data();
  } else {
    args.ldx = row_stride(rows, k, sizeof(uint16_t));
    args.x = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
    if (args.ldx != k) args.x = (xb = with_stride(args.x, rows, k, args.ldx)).data();
  }
  parallel_blocks(blocks, kernel.scratch_floats(rows, k),
                  [&](int64_t b, float* scratch) { kernel.run_block(args, b, scratch); });
  return out;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w_packed, int64_t n) {
  return run(x, w_packed, n, active_isa(), Format::kBf16);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w_packed, int64_t n) {
  return run(x, w_packed, n, active_isa(), Format::kF32);
}

// One named tier, whatever is active: how the tests run every tier the CPU supports.
at::Tensor linear_bf16_isa(const at::Tensor& x, const at::Tensor& w_packed, int64_t n, const std::string& isa) {
  return run(x, w_packed, n, parse_isa(isa), Format::kBf16);
}

// A forced path ("kernel": the tier's packed kernel, "amx", or "auto"): tests and benchmarks. No fake kernel.
at::Tensor linear_bf16_path(const at::Tensor& x, const at::Tensor& w_packed, int64_t n, const std::string& isa,
                            const std::string& path) {
  TORCH_CHECK(path == "auto" || path == "kernel" || path == "amx", "linear_bf16: path must be auto, kernel or amx");
  return run(x, w_packed, n, parse_isa(isa), Format::kBf16,
             path == "amx" ? Path::kAmx : path == "kernel" ? Path::kKernel : Path::kAuto);
}

at::Tensor linear_f32_isa(const at::Tensor& x, const at::Tensor& w_packed, int64_t n, const std::string& isa) {
  return run(x, w_packed, n, parse_isa(isa), Format::kF32);
}

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("linear_bf16(Tensor x, Tensor w_packed, int n) -> Tensor");
  m.def("linear_bf16_isa(Tensor x, Tensor w_packed, int n, str isa) -> Tensor");
  m.def("linear_bf16_path(Tensor x, Tensor w_packed, int n, str isa, str path) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor w_packed, int n) -> Tensor");
  m.def("linear_f32_isa(Tensor x, Tensor w_packed, int n, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("linear_bf16", &ember::linear_bf16);
  m.impl("linear_bf16_isa", &ember::linear_bf16_isa);
  m.impl("linear_bf16_path", &ember::linear_bf16_path);
  m.impl("linear_f32", &ember::linear_f32);
  m.impl("linear_f32_isa", &ember::linear_f32_isa);
}
