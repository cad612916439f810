// ember::linear_bf16 on CPU: y[M, N] = x[M, K] @ W[N, K]^T in bf16 with fp32 accumulation, over a weight
// packed once at load time for AVX512-BF16's vdpbf16ps.
//
// Why not oneDNN: at decode shapes (M = 1..32) its bf16 matrix-vector path streamed weights at ~10-12 GB/s on this
// machine, and freezing gave every compiled batch bucket its own prepacked copy of all weights. This kernel reads
// each weight byte once per call from one shared copy.
//
// Packed layout (engine/ops/linear.py pack_linear_weight): [N_pad / 32, K / 2, 32, 2]. Block b holds output
// columns 32b..32b+31; for each pair of inputs (2k, 2k+1) its 32 columns x 2 values are 128 contiguous bytes,
// i.e. two zmm registers whose 32-bit lanes are (W[n, 2k], W[n, 2k+1]) pairs, exactly what vdpbf16ps multiplies
// against a broadcast pair (x[m, 2k], x[m, 2k+1]). Columns past N are zero padding and never stored.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <omp.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // output columns per packed block (two zmm of fp32 accumulators)
constexpr int kMaxRows = 12;    // rows per micro-tile: 12 x 2 accumulators + 2 weight vectors fit the 32 zmm
constexpr int64_t kMaxThreads = 256;  // block ranges live on the stack; more threads than this are not used
// Software prefetch distance in the weight stream. With one sequential stream per thread the hardware prefetcher
// does most of the work; a short distance still covers the start of each block. Measured in the decode step:
// 0, 128, 256 and 512 within noise of each other; 1024 (best with interleaved runs) ~5 % slower.
constexpr int64_t kPrefetchBytes = 256;

// Blocks [lo, hi) of one thread, packed in one atomic word so that the owner (taking from the front) and a
// thief (taking from the back) can never both take the last block.
class BlockRange {
 public:
  void reset(int64_t lo, int64_t hi) { word_.store(pack(lo, hi), std::memory_order_relaxed); }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }

 private:
  static uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32; }
  int64_t take(bool front) {
    uint64_t v = word_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(v & 0xffffffffu), hi = static_cast<int64_t>(v >> 32);
      if (lo >= hi) return -1;
      const uint64_t next = front ? pack(lo + 1, hi) : pack(lo, hi - 1);
      if (word_.compare_exchange_weak(v, next, std::memory_order_relaxed)) return front ? lo : hi - 1;
    }
  }
  alignas(64) std::atomic<uint64_t> word_{0};  // one cache line each: owners do not share lines
};

#if defined(__AVX512BF16__)
// Store 32 fp32 accumulators as bf16 (round to nearest even, as torch rounds) into out[0 .. ncols).
inline void store_bf16(c10::BFloat16* out, __m512 lo, __m512 hi, int64_t ncols) {
  const __m512i packed = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  const __m512i both = _mm512_inserti64x4(packed, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)), 1);
  const __mmask32 mask = ncols >= 32 ? ~__mmask32(0) : (__mmask32(1) << ncols) - 1;
  _mm512_mask_storeu_epi16(out, mask, both);
}

// Rows [0, MT) of x (row stride ldx in bf16 pairs) times one packed block, over all K / 2 input pairs.
// kSplit accumulator sets over alternating pairs give few-row tiles independent dependency chains, so the
// loop is bound by weight streaming rather than vdpbf16ps latency.
template <int MT>
void micro_tile(const uint32_t* x, int64_t ldx, const c10::BFloat16* w, int64_t k2, c10::BFloat16* out,
                int64_t ldo, int64_t ncols) {
  constexpr int kSplit = MT <= 3 ? 2 : 1;
  __m512 acc[kSplit][MT][2];
  for (int s = 0; s < kSplit; ++s)
    for (int m = 0; m < MT; ++m) acc[s][m][0] = acc[s][m][1] = _mm512_setzero_ps();
  const int64_t k2_main = k2 - k2 % kSplit;
  auto step = [&](int s, int64_t kk) {
    const c10::BFloat16* wp = w + kk * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp + kBlock));
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[m * ldx + kk])));
      acc[s][m][0] = _mm512_dpbf16_ps(acc[s][m][0], w0, xb);
      acc[s][m][1] = _mm512_dpbf16_ps(acc[s][m][1], w1, xb);
    }
  };
  for (int64_t kk = 0; kk < k2_main; kk += kSplit)
    for (int s = 0; s < kSplit; ++s) step(s, kk + s);
  for (int64_t kk = k2_main; kk < k2; ++kk) step(0, kk);
  for (int m = 0; m < MT; ++m) {
    __m512 lo = acc[0][m][0], hi = acc[0][m][1];
    for (int s = 1; s < kSplit; ++s) {
      lo = _mm512_add_ps(lo, acc[s][m][0]);
      hi = _mm512_add_ps(hi, acc[s][m][1]);
    }
    store_bf16(out + m * ldo, lo, hi, ncols);
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const c10::BFloat16*, int64_t, c10::BFloat16*, int64_t, int64_t);
constexpr TileFn kTileFor[] = {nullptr, micro_tile<1>, micro_tile<2>, micro_tile<3>, micro_tile<4>, micro_tile<5>,
                               micro_tile<6>, micro_tile<7>, micro_tile<8>, micro_tile<9>, micro_tile<10>,
                               micro_tile<11>, micro_tile<12>};
#endif

bool native_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w_packed, int64_t n) {
  TORCH_CHECK(native_linear_available(), "ember::linear_bf16 was built without AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w_packed.scalar_type() == at::kBFloat16,
              "linear_bf16 takes bfloat16 input and weight");
  TORCH_CHECK(w_packed.dim() == 4 && w_packed.size(2) == kBlock && w_packed.size(3) == 2 && w_packed.is_contiguous(),
              "weight must be packed [N_pad/32, K/2, 32, 2] (engine/ops/linear.py pack_linear_weight)");
  const int64_t k2 = w_packed.size(1), blocks = w_packed.size(0);
  TORCH_CHECK(x.size(-1) == 2 * k2, "input has ", x.size(-1), " features, weight expects ", 2 * k2);
  TORCH_CHECK(n > (blocks - 1) * kBlock && n <= blocks * kBlock, "n=", n, " does not match ", blocks, " blocks");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / (2 * k2);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (rows == 0) return out;
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<c10::BFloat16>());
  const c10::BFloat16* wp = w_packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  // Each thread owns a contiguous range of output blocks and streams it front to back (the hardware prefetcher
  // follows one sequential stream per thread best: measured 10-15 % faster than interleaved runs from a shared
  // counter). A thread that finishes its range takes single blocks from the back of the others': on a 2-core
  // machine the HTTP thread regularly preempts one compute thread for a moment, and with a fixed split the whole
  // call (and the decode step) would wait for it. A block's weights (K * 64 bytes) stay in L2 while every row
  // tile of x passes over them.
  auto run_block = [&](int64_t b) {
    const int64_t ncols = std::min(kBlock, n - b * kBlock);
    const c10::BFloat16* wb = wp + b * k2 * 2 * kBlock;
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      const int64_t mt = std::min<int64_t>(kMaxRows, rows - m0);
      kTileFor[mt](xp + m0 * k2, k2, wb, k2, op + m0 * n + b * kBlock, n, ncols);
    }
  };
  const int64_t threads = std::min<int64_t>({at::get_num_threads(), blocks, kMaxThreads});
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t b = 0; b < blocks; ++b) run_block(b);
  } else {
    BlockRange ranges[kMaxThreads];
    for (int64_t t = 0; t < threads; ++t) ranges[t].reset(blocks * t / threads, blocks * (t + 1) / threads);
#pragma omp parallel num_threads(threads)
    {
      const int64_t me = omp_get_thread_num();
      for (int64_t b; (b = ranges[me].take_front()) >= 0;) run_block(b);
      for (int64_t i = 1; i < threads; ++i) {
        BlockRange& other = ranges[(me + i) % threads];
        for (int64_t b; (b = other.take_back()) >= 0;) run_block(b);
      }
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("linear_bf16(Tensor x, Tensor w_packed, int n) -> Tensor");
  m.def("native_linear_available() -> bool", &native_linear_available);
}

TORCH_LIBRARY_IMPL(ember, CPU, m) { m.impl("linear_bf16", &linear_bf16); }
