// Spreads the output blocks of one kernel call over the OpenMP threads. ISA: none (generic x86-64 drivers only).
//
// Each thread owns a contiguous range of blocks and streams it front to back (the hardware prefetcher follows one
// sequential stream per thread best: measured 10-15 % faster than interleaved runs from a shared counter). A thread
// that finishes its range takes single blocks from the back of the others': on a 2-core machine the HTTP thread
// regularly preempts one compute thread for a moment, and with a fixed split the whole call (and the decode step)
// would wait for it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <omp.h>

#include "common/block_range.h"

namespace ember {

constexpr int64_t kMaxBlockThreads = 256;  // block ranges live on the stack; more threads than this are not used

// run(block, scratch) for every block in [0, blocks); `scratch` is this thread's `scratch_floats` floats (or null).
template <class Run>
void parallel_blocks(int64_t blocks, int64_t scratch_floats, const Run& run) {
  const int64_t threads = std::min<int64_t>({at::get_num_threads(), blocks, kMaxBlockThreads});
  const bool serial = threads <= 1 || at::in_parallel_region();
  // Plain buffers, not ATen tensors: at batch 1 a decode step makes ~120 of these calls, and tensor allocations
  // plus an ATen conversion each cost ~0.9 ms of a 15 ms step (torch.profiler, AVX2).
  // Left uninitialised: every kernel writes its scratch before reading it (a thread's later blocks see its earlier
  // blocks' leftovers anyway), and zeroing the AMX path's 100 KiB a thread was ~2 % of a 32-row SmolLM2 step.
  const std::unique_ptr<float[]> scratch(scratch_floats > 0 ? new float[(serial ? 1 : threads) * scratch_floats]
                                                            : nullptr);
  float* base = scratch.get();
  if (serial) {
    for (int64_t b = 0; b < blocks; ++b) run(b, base);
    return;
  }
  BlockRange ranges[kMaxBlockThreads];
  for (int64_t t = 0; t < threads; ++t) ranges[t].reset(blocks * t / threads, blocks * (t + 1) / threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t me = omp_get_thread_num();
    float* mine = base == nullptr ? nullptr : base + me * scratch_floats;
    for (int64_t b; (b = ranges[me].take_front()) >= 0;) run(b, mine);
    for (int64_t i = 1; i < threads; ++i) {
      BlockRange& other = ranges[(me + i) % threads];
      for (int64_t b; (b = other.take_back()) >= 0;) run(b, mine);
    }
  }
}

}  // namespace ember
