// ember::linear_gguf on CPU: y[..., N] = x[..., K] @ W[N, K]^T for a weight held in GGUF's own block bytes,
// interleaved in row groups (linear_gguf.h), x and y in bf16 or fp32; and ember::gguf_rows, the exact dequantized rows
// (embeddings). This file checks the arguments, quantizes x to int8 once per call (quantize_acts.h), picks the
// kernel of the active ISA tier and spreads blocks of 32 output rows over the threads (common/parallel_blocks.h).
// ISA: none.
//
// Kernel per tier, as linear_q: avx512 and avx512bf16 run the AVX512-VNNI kernel (512-bit) where the CPU has VNNI
// and the AVX2 kernel otherwise; avx2 the AVX2 kernel; scalar the portable reference.
#include "linear_gguf/linear_gguf.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/cpu_isa.h"
#include "common/parallel_blocks.h"
#include "common/widen_bf16.h"
#include "linear_gguf/quantize_acts.h"

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

GgufKernel kernel_for(Isa isa, int64_t qtype) {
  switch (variant_for(isa)) {
    case Variant::kAvx512Vnni: return linear_gguf_kernel_avx512vnni(qtype);
    case Variant::kAvx2: return linear_gguf_kernel_avx2(qtype);
    case Variant::kScalar: break;
  }
  return linear_gguf_kernel_scalar(qtype);
}

// The wide path: GgufActs::kt and ktp, the 8-row tiles' block scales and sub-block sums with the rows in the lanes.
void transpose_tiles(int64_t rows, int64_t k, QuantizedActs& o) {
  const int64_t nsb = k / 256, tiles = rows / kGgufRowTile;
  o.kt.resize(tiles * nsb * kGgufRowTile);
  o.ktp.resize(tiles * nsb * 64);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t sb = 0; sb < nsb; ++sb)
      for (int m = 0; m < kGgufRowTile; ++m) {
        const int64_t row = t * kGgufRowTile + m, at = t * nsb + sb;
        o.kt[at * kGgufRowTile + m] = o.d[row * nsb + sb];
        const int16_t* bs = o.bsum.data() + row * (k / 16) + 16 * sb;
        for (int s = 0; s < 8; ++s)  // |sum over 32| <= 32 x 127: an int16
          o.ktp[(at * 4 + s / 2) * 16 + 2 * m + s % 2] = static_cast<int16_t>(bs[2 * s] + bs[2 * s + 1]);
      }
}

// K of a packed weight, after checking it is one.
int64_t checked_k(const at::Tensor& packed, int64_t qtype, int64_t n) {
  const GgufTypeInfo ti = gguf_type_info(qtype);
  TORCH_CHECK(ti.values != 0, "linear_gguf: unsupported ggml type ", qtype,
              " (supported: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  const int64_t g = gguf_group_rows(qtype);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte, "packed must be a "
              "contiguous uint8 [ceil(N/", g, "), ", g, " * row bytes] tensor (gguf_blocks.interleave)");
  TORCH_CHECK(packed.size(1) % (g * ti.bytes) == 0 && packed.size(1) > 0,
              "packed rows of ", packed.size(1), " bytes are not ", g, " rows of whole ", ti.bytes, "-byte blocks");
  TORCH_CHECK(n > g * (packed.size(0) - 1) && n <= g * packed.size(0), "packed [", packed.size(0), ", ",
              packed.size(1), "] is not an interleaved weight of ", n, " rows");
  return packed.size(1) / g / ti.bytes * ti.values;
}

// Which kernel family a call runs: by the CPU's features and the row count (kAuto), or forced (tests, benchmarks).
enum class Path { kAuto, kInt8, kWide, kTile, kAmx, kAmx8 };

Path parse_path(const std::string& p) {
  if (p == "auto") return Path::kAuto;
  if (p == "int8") return Path::kInt8;
  if (p == "wide") return Path::kWide;
  if (p == "tile") return Path::kTile;
  if (p == "amx") return Path::kAmx;
  if (p == "amx8") return Path::kAmx8;
  TORCH_CHECK(false, "linear_gguf: path must be auto, int8, wide, tile, amx or amx8, got ", p);
}

// AMX runs on the avx512bf16 tier of a CPU with AMX-BF16 (every such CPU has that tier).
bool amx_for(Isa isa) { return isa == Isa::kAvx512Bf16 && cpu_has_amx_bf16(); }
// AMX-INT8 likewise, for the 16-row types (its epilogue is the avx512vnni variant's: every AMX CPU has VNNI).
bool amx8_for(Isa isa, int64_t qtype) {
  return amx_for(isa) && cpu_has_amx_int8() && cpu_has_avx512_vnni() && gguf_amx8_rows(qtype).second > 0;
}

Path auto_path(const GgufKernel& kernel, Isa isa, int64_t qtype, int64_t rows) {
  const auto [amx8_from, amx8_below] = gguf_amx8_rows(qtype);
  if (amx8_for(isa, qtype) && rows >= amx8_from && rows < amx8_below) return Path::kAmx8;
  if (amx_for(isa) && rows >= gguf_amx_min_rows(qtype)) return Path::kAmx;
  if (kernel.run_block_tile != nullptr && rows >= kernel.tile_min_rows) return Path::kTile;
  if (kernel.run_block_wide != nullptr && rows >= kernel.wide_min_rows) return Path::kWide;
  return Path::kInt8;
}

// f32_out: fp32 output whatever the input's dtype (the output head's logits), else the input's dtype.
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n, Isa isa,
               Path path = Path::kAuto, bool f32_out = false) {
  const int64_t k = checked_k(packed, qtype, n);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_gguf takes bfloat16 or float32 input, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "input has ", x.dim() ? x.size(-1) : 0, " features, weight expects ", k);
  const GgufKernel kernel = kernel_for(isa, qtype);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, f32_out ? x.options().dtype(at::kFloat) : x.options());
  if (rows == 0 || n == 0) return out;
  if (path == Path::kAuto) path = auto_path(kernel, isa, qtype, rows);
  TORCH_CHECK(path != Path::kTile || kernel.run_block_tile != nullptr, "linear_gguf: the ", isa_name(isa),
              " tier has no tile path");
  TORCH_CHECK(path != Path::kWide || kernel.run_block_wide != nullptr, "linear_gguf: the ", isa_name(isa),
              " tier has no wide path for type ", qtype);
  TORCH_CHECK(path != Path::kAmx || amx_for(isa), "linear_gguf: the AMX path needs the avx512bf16 tier of a CPU "
              "with AMX-BF16 (this CPU: ", cpu_has_amx_bf16() ? "has AMX" : "no AMX", ")");
  TORCH_CHECK(path != Path::kAmx8 || amx8_for(isa, qtype), "linear_gguf: the amx8 path needs the avx512bf16 tier "
              "of a CPU with AMX-INT8 and one of its types (Q4_0, Q4_1, Q8_0, Q4_K), got type ", qtype, " on ",
              isa_name(isa), cpu_has_amx_int8() ? "" : " (this CPU: no AMX-INT8)");
  if (path == Path::kAmx) {
    // bf16 activations padded with zero rows to a multiple of 16 (AMX tiles are 16 rows). Only the pad rows are
    // zeroed: constant_pad_nd filled the whole copy first (~5 % of a SmolLM2 prefill in fills and pads).
    const int64_t rows_pad = (rows + 15) / 16 * 16;
    at::Tensor xb = xc.reshape({rows, k});
    if (rows_pad != rows) {
      at::Tensor padded = at::empty({rows_pad, k}, xb.options().dtype(at::kBFloat16));
      padded.narrow(0, 0, rows).copy_(xb);
      padded.narrow(0, rows, rows_pad - rows).zero_();
      xb = padded;
    } else {
      xb = xb.to(at::kBFloat16).contiguous();
    }
    GgufLinearArgs args{qtype, packed.data_ptr<uint8_t>(), rows, k, n, {}, nullptr, out.scalar_type() == at::kBFloat16,
                        out.data_ptr(), reinterpret_cast<const uint16_t*>(xb.data_ptr<c10::BFloat16>()), rows_pad};
    const GgufBlockFn fn = linear_gguf_amx_block(qtype);
    parallel_blocks((n + kGgufBlockRows - 1) / kGgufBlockRows, gguf_amx_scratch_floats(rows_pad),
                    [&](int64_t b, float* scratch) { fn(args, b, scratch); });
    return out;
  }
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const bool tile = path == Path::kTile;
  const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()) : nullptr;
  // Plain buffers: a decode step makes ~120 of these calls (see parallel_blocks.h on tensor allocations). Only the
  // tile path reads fp32 activations; the integer paths quantize bf16 directly.
  std::vector<float> widened;
  if (bf16 && tile) widened = widen_bf16(xb, rows * k);
  const float* xf = bf16 ? (tile ? widened.data() : nullptr) : xc.data_ptr<float>();
  GgufLinearArgs args{qtype, packed.data_ptr<uint8_t>(), rows, k, n, {}, nullptr, out.scalar_type() == at::kBFloat16,
                      out.data_ptr()};
  QuantizedActs acts;
  if (tile) {
    args.xf = xf;
  } else {
    quantize_acts(xf, xb, rows, k, gguf_type_info(qtype).values, kernel.lane_offset, isa, acts);
    if (path == Path::kWide) transpose_tiles(rows, k, acts);
    if (path == Path::kAmx8) {  // GgufActs::q32: the A tiles
      const int64_t rows_pad = (rows + 15) / 16 * 16;
      acts.q32.assign(k * rows_pad, 0);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < k / 32; ++j)
          std::memcpy(acts.q32.data() + (j * rows_pad + m) * 32, acts.q.data() + m * acts.ldq + 32 * j, 32);
      args.rows_pad = rows_pad;
    }
    args.x = {acts.q.data(), acts.d.data(), acts.bsum.data(), acts.off.data(), acts.msum.data(),
              acts.kt.empty() ? nullptr : acts.kt.data(), acts.ktp.empty() ? nullptr : acts.ktp.data(),
              acts.s32.empty() ? nullptr : acts.s32.data(), acts.ldq, acts.q32.empty() ? nullptr : acts.q32.data()};
  }
  const auto run_block = tile ? kernel.run_block_tile : path == Path::kWide ? kernel.run_block_wide
                         : path == Path::kAmx8 ? linear_gguf_amx8_block(qtype) : kernel.run_block;
  parallel_blocks((n + kGgufBlockRows - 1) / kGgufBlockRows, gguf_scratch_floats(rows, tile),
                  [&](int64_t b, float* scratch) { run_block(args, b, scratch); });
  return out;
}

at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n) {
  return run(x, packed, qtype, n, active_isa());
}

// The output head's call: fp32 logits from the kernels' fp32 sums. A bf16 result (8 bits of mantissa) would step
// every logit of ~16-32 by 0.125, which a client sees in its logprobs, and cost a widening pass besides.
at::Tensor linear_gguf_f32(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n) {
  return run(x, packed, qtype, n, active_isa(), Path::kAuto, true);
}

// One named tier, whatever is active: how the tests run every variant the CPU supports.
at::Tensor linear_gguf_isa(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                           const std::string& isa) {
  return run(x, packed, qtype, n, parse_isa(isa));
}

// A forced path (int8, wide, tile, amx; auto as linear_gguf): how tests check every path against the oracle and
// benchmarks measure the crossings. Not for the model (no fake kernel).
at::Tensor linear_gguf_path(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                            const std::string& isa, const std::string& path) {
  return run(x, packed, qtype, n, parse_isa(isa), parse_path(path));
}

// The path linear_gguf_isa takes for `rows` rows of type `qtype` on tier `isa`.
std::string linear_gguf_auto_path(int64_t qtype, int64_t rows, const std::string& isa) {
  const Isa t = parse_isa(isa);
  TORCH_CHECK(gguf_type_info(qtype).values != 0, "linear_gguf: unsupported ggml type ", qtype);
  switch (auto_path(kernel_for(t, qtype), t, qtype, rows)) {
    case Path::kAmx: return "amx";
    case Path::kAmx8: return "amx8";
    case Path::kTile: return "tile";
    case Path::kWide: return "wide";
    default: return "int8";
  }
}

std::string linear_gguf_variant(const std::string& isa) {
  const Variant v = variant_for(parse_isa(isa));
  return v == Variant::kAvx512Vnni ? "avx512vnni" : v == Variant::kAvx2 ? "avx2" : "scalar";
}

// Rows `ids` of the weight, dequantized exactly as gguf does (embedding lookups), in fp32 or bf16 (rounded).
at::Tensor gguf_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t qtype, int64_t n,
                     at::ScalarType dtype) {
  const int64_t k = checked_k(packed, qtype, n);
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "gguf_rows: ids must be int64/int32");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gguf_rows: dtype must be float32 or bfloat16");
  const at::Tensor idc = ids.to(at::kLong).contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, packed.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  for (int64_t i = 0; i < idc.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "gguf_rows: row ", id[i], " out of range for ", n, " rows");
    gguf_dequant_row(qtype, w, id[i], k, o + i * k);
  }
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("linear_gguf(Tensor x, Tensor packed, int qtype, int n) -> Tensor");
  m.def("linear_gguf_f32(Tensor x, Tensor packed, int qtype, int n) -> Tensor");
  m.def("linear_gguf_isa(Tensor x, Tensor packed, int qtype, int n, str isa) -> Tensor");
  m.def("linear_gguf_variant(str isa) -> str", &ember::linear_gguf_variant);
  m.def("linear_gguf_path(Tensor x, Tensor packed, int qtype, int n, str isa, str path) -> Tensor");
  m.def("linear_gguf_auto_path(int qtype, int rows, str isa) -> str", &ember::linear_gguf_auto_path);
  m.def("gguf_rows(Tensor packed, Tensor ids, int qtype, int n, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("linear_gguf", &ember::linear_gguf);
  m.impl("linear_gguf_f32", &ember::linear_gguf_f32);
  m.impl("linear_gguf_isa", &ember::linear_gguf_isa);
  m.impl("linear_gguf_path", &ember::linear_gguf_path);
  m.impl("gguf_rows", &ember::gguf_rows);
}
