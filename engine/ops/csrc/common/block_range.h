// Work stealing over a range of output blocks, for kernels whose threads each stream their own contiguous range.
// ISA: none.
#pragma once

#include <atomic>
#include <cstdint>

namespace ember {

// Blocks [lo, hi) of one thread, packed in one atomic word so that the owner (taking from the front) and a thief
// (taking from the back) can never both take the last block.
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

}  // namespace ember
