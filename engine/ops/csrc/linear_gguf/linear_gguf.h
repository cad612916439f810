// The interface between ember::linear_gguf's driver (linear_gguf.cpp: checks, activation quantization, threads,
// dispatch) and its per-ISA kernels (linear_gguf_<isa>.cpp over linear_gguf_body.h; the scalar reference, which
// is also the test oracle and gguf_rows' dequantizer, in linear_gguf_scalar.cpp). ISA: none.
//
// The weight is GGUF's own block bytes (ggml-common.h layouts), only permuted (engine/quant/gguf_blocks.py
// interleave), in groups of gguf_group_rows(qtype) rows, the last group padded with zero rows. A thread computing a
// group's rows reads one sequential stream (separate row streams ran at half the bandwidth, linear_q.h), and the
// bytes read are exactly the file's. Two layouts:
// - 4-row groups (Q5_0, Q5_1, Q5_K): block b of the group's row r sits whole at byte (4 b + r) * block_bytes.
// - 16-row groups, rows in the lanes (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K: "x16"): block b of the group is 16 block_bytes at
//   byte 16 b block_bytes: the 16 rows' fp16 d (32 B; Q6_K's d, which its blocks store last), for Q4_1 / Q4_K then
//   their fp16 m / dmin (32 B), then the rest of each row's block in chunks of 64 B, chunk c holding bytes 4c..4c+3 of
//   it for each row in row order (Q4_0 / Q4_1: 4 chunks of the 16 nibble bytes, so chunk c's low nibbles are values
//   4c..4c+3 and its high ones 16+4c..; Q8_0: 8 chunks of the 32 code bytes; Q4_K: 3 chunks of the 12 scale bytes, then
//   32 of the 128 nibble bytes; Q6_K, in the order its kernel reads them: 4 chunks of the 16 int8 scales, then per half
//   of the block 16 of its 64 low-nibble bytes and 8 of its 32 high-bit bytes, so file bytes 192-207, 0-63, 128-159,
//   64-127, 160-191, gguf_q6k_chunk). One vpdpbusd of a chunk against 4 broadcast activation bytes gives 16 rows'
//   partial dots, one row a lane, so each block's scales apply once per 16 rows (linear_gguf_x16.h) instead of once per
//   row.
//
// Activations are quantized once per call, per row, symmetric and rounded to nearest, to int8 (-127..127) in
// blocks of 32 (types with 32-value blocks, like ggml's q8_0) or 256 (K-quants, like q8_K), one fp32 scale per
// block, plus integer sums per 16 values that carry the weights' offsets and mins (see GgufActs).
#pragma once

#include <cstdint>
#include <utility>

namespace ember {

enum GgufType : int {  // ggml type ids
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

struct GgufTypeInfo {
  int values;  // per block: 32, or 256 for K-quants
  int bytes;   // per block, as in the file
};

// {0, 0} for a type this op does not run.
constexpr GgufTypeInfo gguf_type_info(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18};   // fp16 d, 16 B nibbles:                 d * (q - 8)
    case kQ4_1: return {32, 20};   // fp16 d, fp16 m, 16 B nibbles:         d * q + m
    case kQ5_0: return {32, 22};   // fp16 d, 4 B 5th bits, 16 B nibbles:   d * (q - 16)
    case kQ5_1: return {32, 24};   // fp16 d, fp16 m, 4 B qh, 16 B nibbles: d * q + m
    case kQ8_0: return {32, 34};   // fp16 d, 32 int8:                      d * q
    case kQ4_K: return {256, 144};  // fp16 d, dmin, 12 B 6-bit sc/m, 128 B nibbles: d sc q - dmin m per 32
    case kQ5_K: return {256, 176};  // as Q4_K + 32 B 5th bits
    case kQ6_K: return {256, 210};  // 128 B low nibbles, 64 B 2-bit highs, 16 int8 sc, fp16 d: d sc (q - 32) per 16
    default: return {0, 0};
  }
}

constexpr bool gguf_x16(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ4_K || qtype == kQ6_K;
}
constexpr int64_t gguf_group_rows(int64_t qtype) { return gguf_x16(qtype) ? 16 : 4; }

// File byte offset of the 16-row layout's Q6_K chunk c (of 52; the layout above).
constexpr int gguf_q6k_chunk(int c) {
  return c < 4 ? 192 + 4 * c : c < 20 ? 4 * (c - 4) : c < 28 ? 128 + 4 * (c - 20) : c < 44 ? 64 + 4 * (c - 28)
                                                                                          : 160 + 4 * (c - 44);
}

// Row n's block b as GGUF stores it (block_bytes bytes): a pointer into the weight w (4-row groups), or `tmp`
// (block_bytes at least) filled from the 16-row layout. For dequantizers, not hot loops.
inline const uint8_t* gguf_row_block(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t b,
                                     uint8_t* tmp) {
  const int bytes = gguf_type_info(qtype).bytes;
  const int64_t g = gguf_group_rows(qtype), r = n % g;
  const uint8_t* group = w + (n / g) * g * row_bytes;
  if (g == 4) return group + (4 * b + r) * bytes;
  const uint8_t* blk = group + b * 16 * bytes;
  const int scales = qtype == kQ4_1 || qtype == kQ4_K ? 2 : 1, chunks = (bytes - 2 * scales) / 4;
  const bool q6k = qtype == kQ6_K;  // its d last, as the file has it, and its chunks in the kernel's order
  for (int s = 0; s < scales; ++s) __builtin_memcpy(tmp + (q6k ? bytes - 2 : 2 * s), blk + 32 * s + 2 * r, 2);
  for (int c = 0; c < chunks; ++c)
    __builtin_memcpy(tmp + (q6k ? gguf_q6k_chunk(c) : 2 * scales + 4 * c), blk + 32 * scales + 64 * c + 4 * r, 4);
  return tmp;
}

constexpr int64_t kGgufBlockRows = 32;  // output rows per unit of work stolen between threads
constexpr float kGgufActMax = 127.0f;   // int8 activations: -127..127, so a sign flip never overflows

// From GgufKernel::tile_min_rows rows on (prefill; set per variant and type where the measured crossing is, 64-1024
// rows: linear_gguf_avx512vnni.cpp, _avx2.cpp) a call dequantizes each 32-row block's K-chunk once into an fp32
// tile and runs the fp32 micro-kernel (linear/linear_fma_body.h) on fp32 activations; below, integer dots on int8
// activations (from GgufKernel::wide_min_rows, where a variant has it, the wide integer path: K-quants on AVX2).
// kGgufTileMinRows only names the scalar reference's (it has no tile path).
constexpr int64_t kGgufTileMinRows = 16;
// AMX CPUs (avx512bf16 tier): the AMX path from this many rows on. Measured (1 thread, Llama-1B shapes, GFLOP/s
// amx vs int8 avx512vnni): Q4_K 100/146 at 16 rows, 148/152 at 24, 196/153 at 32, 327/158 at 64; Q6_K 186/142 at
// 32. 2 threads, ms per layer (q|k|v, o, gate|up, down; scripts/bench_linear.py --paths int8 amx): the 4-row
// layout's 32-value types (Q5_0, Q5_1; 2026-12-05, then also Q4_0/Q4_1/Q8_0) are epilogue-bound from 8 rows on
// (Q4_1 5.4 / 10.0 / 15.3 ms at 8 / 16 / 24 rows) while AMX costs about the same at 16 and 24 (9.4 / 10.3): 16.
// The 16-row layout's int8 dots (Q4_0 / Q4_1 / Q8_0) cost 3.9-5.1 ms at 16 rows, 5.5-6.9 at 24, 7.4-8.3 at 32,
// against AMX's 4.2-5.3, 5.4-6.1, 5.5-6.0 since its groups convert straight to AMX's layout (linear_gguf_amx.cpp;
// 8.7-10.0 at 32 before, when the crossing was 40). In a compiled decode step AMX gains less than alone: the step's
// other ops leave it idle between calls, and after 0.5 ms without AMX work a SmolLM2 gate|up call took 204 us
// against 144 back to back (int8 dots 242 / 209). Whole steps (scripts/profile_decode.py): the 1B Q8_0 at 24 rows
// 141-142 -> 126-127 ms, at 32 172-186 -> 132-135; SmolLM2 Q4_1 at 24 even (33-36 ms), at 32 44.3-44.5 -> 40.0: 24.
// Q4_K 11.1 / 15.2 ms at 48 / 64 rows against 13.5 / 14.9: 64.
// The 4-row K-quants' integer dots stay ahead to 24 rows (Q6_K 10.9 vs 11.3): 32.
inline int64_t gguf_amx_min_rows(int64_t qtype) {
  if (qtype == kQ4_K) return 64;
  if (qtype == kQ6_K) return 32;  // (measured in the 4-row layout; not yet again in the 16-row one)
  return gguf_x16(qtype) ? 24 : gguf_type_info(qtype).values == 32 ? 16 : 32;
}
// AMX-INT8 CPUs, the 16-row types: the amx8 path (linear_gguf_amx8.h) for rows in [first, second), ahead of both
// the int8 dots and bf16 AMX (gguf_amx_min_rows applies above). AMX Xeon, 2 threads, GB/s of a Llama-1B layer's
// four calls (scripts/bench_linear.py --types Q4_0 Q4_1 Q8_0 Q4_K --rows ... --paths int8 amx amx8 --layers 4),
// int8 / amx8 / bf16 AMX: at 8 rows Q4_1 16.6 / 13.4 / 8.6; at 12 Q4_1 12.1 / 13.1, Q8_0 15.7 / 15.3; at 16
// Q4_0 8.4 / 11.1 / 6.8, Q4_1 9.0 / 11.3 / 8.3, Q8_0 12.2 / 14.2 / 12.1, Q4_K 7.9 / 10.3 / 2.7; at 24 Q4_1 6.2 /
// 6.9 / 6.6, Q8_0 9.2 / 10.2 / 9.8; at 32 Q4_1 4.8 / 6.0 / 6.7, Q8_0 7.2 / 9.3 / 9.9, Q4_K 4.4 / 5.3 / 2.4; Q4_K at
// 64 2.2 / 3.1 / 2.3, at 128 1.2 / 1.6 / 1.8. (Each activation row costs amx8 its own epilogue; bf16 AMX's
// weight conversion is shared by all rows, so it wins from 24 rows, Q4_K's from 128.) Whole compiled steps of 32 rows
// agree (scripts/profile_decode.py --batch 32 --context 256, amx8 against bf16 AMX there, twice): 1B Q8_0 137.8,
// 143.5 against 131.1, 132.1 ms; SmolLM2 Q4_1 33.7, 34.3 against 32.1, 32.3. At 24 rows the 32-value types go to
// bf16 AMX too (2026-12-06, alternated, us a layer from memory, min of 7): SmolLM2's Q4_1 layers 465-501 against
// 374-441, the 1B's Q8_0 6.8-7.0 against 6.4-6.5 ms, its Q4_1 5.3-5.5 against 5.7-5.9 (the one loss); whole steps
// (scripts/bench_verify_rows.py shapes, 8 SmolLM2 requests x 3 rows) 28.2-29.3 -> 25.6-27.6 ms, the 1B Q8_0 at
// batch 24 137-140 -> 121-133 ms.
inline std::pair<int64_t, int64_t> gguf_amx8_rows(int64_t qtype) {
  if (!gguf_x16(qtype) || qtype == kQ6_K) return {0, 0};  // (Q6_K has no amx8 kernel)
  return {12, qtype == kQ4_K ? 128 : 24};
}
constexpr int64_t kGgufTileChunk = 512;  // K values per tile (a multiple of 256): 512 x 32 x 4 B = 64 KiB, in L2

// x quantized: row m, activation block j (32 or 256 values) of K.
struct GgufActs {
  const int8_t* q;      // [rows, K]
  const float* d;       // [rows, K / qb] scales
  const int16_t* bsum;  // [rows, K / 16] sum of q per 16 values (|sum| <= 2032)
  // 32-value types only, per 32 values: off = sum(q) * lane_offset (GgufKernel), what each of a row's 8 int32 dot
  // lanes subtracts so that the 8 lanes together remove the weights' offset (8 lanes x 1 = Q4_0's 8, x 2 = Q5_0's
  // 16, x 16 = 128 for Q8_0 made unsigned); msum = d * sum(q) / 8, the min's share per lane (Q4_1, Q5_1).
  const int32_t* off;
  const float* msum;
  // The wide path (K-quants on the 256-bit kernels, linear_gguf_body.h), per full tile of kGgufRowTile rows (tile
  // t = rows 8t..8t+7) and 256-value block sb, the rows in the lanes: kt[(t K / 256 + sb) 8 + m] = d[8 t + m, sb];
  // ktp[((t K / 256 + sb) 4 + p) 16 + 2 m + i] = sum of q over values 32 (2p + i) .. + 31 of row 8 t + m (int16
  // pairs, vpmaddwd against pairs of sub-block mins). Else nullptr.
  const float* kt;
  const int16_t* ktp;
  // K-quants: [rows, K / 32] sum of q per 32 values (the 16-row Q4_K kernel's mins), else nullptr.
  const int16_t* s32;
  // Row stride of q: K, plus a cache line when several rows share the call (common/row_stride.h: rows of a stride
  // that is a multiple of 4 KiB share one L1 set).
  int64_t ldq;
  // The amx8 path only: q again as AMX A tiles, [K / 32, rows rounded up to 16, 32] (zero rows past `rows`), so a
  // tile of 16 rows x one 32-value block is 512 contiguous bytes (8 cache lines, not parts of 16). Else nullptr.
  const int8_t* q32 = nullptr;
};

constexpr int kGgufRowTile = 8;      // activation rows sharing each decoded weight vector (linear_gguf_body.h)

struct GgufLinearArgs {
  int64_t qtype;
  const uint8_t* w;     // interleaved GGUF blocks
  int64_t rows, k, n;
  GgufActs x;           // integer path
  const float* xf;      // [rows, K] fp32 activations (tile path), else nullptr
  bool out_bf16;        // out is bf16 (rounded to nearest even), else fp32
  void* out;            // [rows, n]
  const uint16_t* xb;   // AMX path: [rows_pad, K] bf16 activations (rows past `rows` zero), else nullptr
  int64_t rows_pad;     // rows rounded up to 16
};

struct GgufKernel {
  // Every row of output block `block` (rows [32 block, 32 block + 32)). scratch: gguf_scratch_floats floats.
  void (*run_block)(const GgufLinearArgs& a, int64_t block, float* scratch);       // integer dots
  void (*run_block_tile)(const GgufLinearArgs& a, int64_t block, float* scratch);  // fp32 tile (null: none)
  int lane_offset;  // GgufActs::off multiplier for this type and variant (0: the dot needs no offset)
  int64_t tile_min_rows;  // from this many rows on the fp32 tile path runs (measured per variant and type)
  // The wide path (null: none): integer dots like run_block, 8 activation rows in the float lanes; from
  // wide_min_rows rows on, below tile_min_rows.
  void (*run_block_wide)(const GgufLinearArgs& a, int64_t block, float* scratch);
  int64_t wide_min_rows;
};

inline int64_t gguf_scratch_floats(int64_t rows, bool tile) {
  return tile ? 2 * kGgufTileChunk * kGgufBlockRows + rows * kGgufBlockRows : 0;
}

// AMX many-row path (CPUs where cpu_has_amx_bf16()): each 32-row block's K-chunk dequantized to bf16 (one more
// rounding of each weight, to nearest even) in AMX's B layout, activations rounded to bf16, tdpbf16ps with fp32
// sums (linear/amx_bf16.h). From gguf_amx_min_rows rows on (measured there).
using GgufBlockFn = void (*)(const GgufLinearArgs& a, int64_t block, float* scratch);
GgufBlockFn linear_gguf_amx_block(int64_t qtype);
inline int64_t gguf_amx_scratch_floats(int64_t rows_pad) {
  return kGgufBlockRows * kGgufTileChunk + kGgufTileChunk * kGgufBlockRows / 2 + rows_pad * kGgufBlockRows;
}

// AMX-INT8 path of the 16-row types (linear_gguf_amx8.h; null for other types): the int8 path's activations and
// exact integer dots in tiles, the same results bit for bit. CPUs where cpu_has_amx_int8(); activations padded
// with zero rows to a multiple of 16.
GgufBlockFn linear_gguf_amx8_block(int64_t qtype);

GgufKernel linear_gguf_kernel_scalar(int64_t qtype);
GgufKernel linear_gguf_kernel_avx2(int64_t qtype);
GgufKernel linear_gguf_kernel_avx512vnni(int64_t qtype);

// Row n of the interleaved weight w, inputs [0, k), as fp32 exactly as gguf.quants.dequantize computes them (each
// value one rounding at most, of the same exact operands). Portable C++ (linear_gguf_scalar.cpp).
void gguf_dequant_row(int64_t qtype, const uint8_t* w, int64_t n, int64_t k, float* out);

}  // namespace ember
