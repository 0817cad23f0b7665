// Work items shared by the OpenMP threads: a contiguous stretch of about equal cost per thread, and the tails of
// stretches left over taken by the threads that are done.
//
// Why: a static split loses whenever the costs or the threads are uneven. A decode batch's sequences differ in
// length (attention over 8 sequences at 40 positions beside 8 at 600 ran at half the speed of 16 at 320: one
// thread had all the long ones); on 2 cores the API process and the kernel take a core from one engine thread now
// and then, and threads start a region at different times. Here a thread that finishes its own stretch takes the
// others' last items, one at a time from the back, while their owners go on from the front: each thread still
// streams one contiguous run of the weights (what the hardware prefetcher wants), and the region ends when the
// work does. Items run exactly once; which thread runs one does not change its result.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace neuronmm {

// One thread's stretch of items [front, back), claimable from both ends (both packed in one word, so a claim is
// one compare-and-swap). Its own line: the owner's claims stay in its cache until another thread takes from it.
struct alignas(64) Stretch {
  std::atomic<uint64_t> ends{0};

  void reset(int64_t front, int64_t back) {
    ends.store(uint64_t(front) << 32 | uint64_t(back), std::memory_order_relaxed);
  }
  // The owner's next items [begin, end) from the front: an eighth of what is left (at least one), so it claims a
  // few times per stretch rather than once per item (a claim is a locked instruction, which waits for the loads in
  // flight) while the tail stays fine-grained for the others. False when the stretch is empty.
  bool take_front(int64_t& begin, int64_t& end) {
    uint64_t v = ends.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = v >> 32, b = v & 0xFFFFFFFFu;
      if (f >= b) return false;
      const uint64_t n = std::max<uint64_t>(1, (b - f) / 8);
      if (ends.compare_exchange_weak(v, (f + n) << 32 | b, std::memory_order_relaxed)) {
        begin = int64_t(f), end = int64_t(f + n);
        return true;
      }
    }
  }
  // The back item (for a thread whose own stretch is done), or false when the stretch is empty.
  bool take_back(int64_t& item) {
    uint64_t v = ends.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = v >> 32, b = v & 0xFFFFFFFFu;
      if (f >= b) return false;
      if (ends.compare_exchange_weak(v, f << 32 | (b - 1), std::memory_order_relaxed)) {
        item = int64_t(b - 1);
        return true;
      }
    }
  }
};

// Runs body(next) once per thread over items [0, count): `next(item)` gives the thread its next item, false when
// none is left anywhere. Each thread starts on a stretch whose summed cost is about 1 / threads of the total
// (cost_before(i): the summed cost of items 0 .. i-1, non-decreasing) and takes it front to back, then takes the
// other stretches' items from their backs. Every item runs exactly once; which thread runs it may vary.
template <typename CostBefore, typename Body>
void balanced_for(int64_t count, const CostBefore& cost_before, const Body& body) {
  if (count <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count), total = cost_before(count);
  const auto start = [&](int64_t t) {  // the first item whose preceding cost reaches t / threads of the total
    if (t == 0 || t == threads) return t == 0 ? int64_t(0) : count;  // (items costing 0 at either end included)
    if (total <= 0) return t * count / threads;
    int64_t lo = 0, hi = count;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (cost_before(mid) * threads >= t * total) hi = mid; else lo = mid + 1;
    }
    return lo;
  };
  // On the stack for the usual few threads: a decode step makes ~250 of these calls, and an aligned heap
  // allocation each (with its free) was serial time on the calling thread while the others waited.
  constexpr int64_t kStackStretches = 8;
  Stretch on_stack[kStackStretches];
  const std::unique_ptr<Stretch[]> on_heap(threads > kStackStretches ? new Stretch[threads] : nullptr);
  Stretch* const stretches = on_heap ? on_heap.get() : on_stack;
  for (int64_t t = 0; t < threads; ++t) stretches[t].reset(start(t), start(t + 1));
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {  // one t per thread (all of them in turn where the region has one thread)
      int64_t claimed = 0, claimed_end = 0;  // the items of the thread's last claim on its own stretch
      int64_t victim = 1;                    // then the others' stretches in turn
      const auto next = [&](int64_t& item) {
        if (claimed < claimed_end || stretches[t].take_front(claimed, claimed_end)) {
          item = claimed++;
          return true;
        }
        for (; victim < threads; ++victim)
          if (stretches[(t + victim) % threads].take_back(item)) return true;
        return false;
      };
      body(next);
    }
  });
}

}  // namespace neuronmm
