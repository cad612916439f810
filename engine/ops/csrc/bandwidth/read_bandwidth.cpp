// ember::read_bandwidth(buf, repeats) -> GB/s: every OpenMP thread (torch's thread count) reads its contiguous
// 1/T of `buf` front to back, `repeats` times, one parallel region per pass as a linear call has. The benchmark
// (scripts/bench_linear.py) reports a weight stream's bytes per second as a fraction of this. ISA: none.
#include "bandwidth/read_bandwidth.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <chrono>
#include <omp.h>

#include "common/cpu_isa.h"

namespace ember {
namespace {

uint64_t read_sum_scalar(const uint8_t* p, int64_t n) {
  uint64_t s = 0;
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    uint64_t v;
    __builtin_memcpy(&v, p + i, 8);
    s += v;
  }
  return s;
}

double read_bandwidth(const at::Tensor& buf, int64_t repeats) {
  TORCH_CHECK(buf.is_contiguous() && buf.nbytes() >= 4096, "read_bandwidth needs a contiguous buffer of 4 KiB+");
  TORCH_CHECK(repeats >= 1, "read_bandwidth needs repeats >= 1");
  const Isa isa = active_isa();
  auto fold = isa >= Isa::kAvx512 ? read_sum_avx512 : isa == Isa::kAvx2 ? read_sum_avx2 : read_sum_scalar;
  const uint8_t* base = static_cast<const uint8_t*>(buf.data_ptr());
  const uint8_t* p = base + (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;  // 64-byte aligned start
  const int64_t usable = (buf.nbytes() - (p - base)) / 4096 * 4096;
  const int threads = at::get_num_threads();
  volatile uint64_t sink = 0;
  auto pass = [&]() {
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t lo = usable / 64 * t / nt * 64, hi = usable / 64 * (t + 1) / nt * 64;
      total += fold(p + lo, hi - lo);
    }
    sink = sink + total;
  };
  pass();  // warm-up: page faults, thread start
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < repeats; ++r) pass();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(usable) * static_cast<double>(repeats) / s / 1e9;
}

}  // namespace
}  // namespace ember

TORCH_LIBRARY_FRAGMENT(ember, m) { m.def("read_bandwidth(Tensor buf, int repeats) -> float"); }

TORCH_LIBRARY_IMPL(ember, CPU, m) { m.impl("read_bandwidth", &ember::read_bandwidth); }
