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
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include <immintrin.h>

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

// Each thread's starting stretch over items [0, count): about 1 / threads of the summed cost each
// (cost_before(i): the summed cost of items 0 .. i-1, non-decreasing). On the stack for the usual few threads: a
// decode step makes ~250 balanced_for calls, and an aligned heap allocation each (with its free) was serial time on
// the calling thread while the others waited.
class Stretches {
 public:
  template <typename CostBefore>
  Stretches(int64_t threads, int64_t count, const CostBefore& cost_before)
      : threads_(threads), on_heap_(threads > kOnStack ? new Stretch[threads] : nullptr) {
    const int64_t total = cost_before(count);
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
    for (int64_t t = 0; t < threads; ++t) at(t).reset(start(t), start(t + 1));
  }

  // Thread t's `next(item)`: its own stretch from the front, then the others' from their backs; false when no
  // item is left anywhere.
  class Next {
   public:
    Next(Stretches& all, int64_t t) : all_(all), t_(t) {}
    bool operator()(int64_t& item) const {
      if (claimed_ < claimed_end_ || all_.at(t_).take_front(claimed_, claimed_end_)) {
        item = claimed_++;
        return true;
      }
      for (; victim_ < all_.threads_; ++victim_)
        if (all_.at((t_ + victim_) % all_.threads_).take_back(item)) return true;
      return false;
    }

   private:
    Stretches& all_;
    int64_t t_;
    mutable int64_t claimed_ = 0, claimed_end_ = 0;  // the items of the thread's last claim on its own stretch
    mutable int64_t victim_ = 1;                     // then the others' stretches in turn
  };
  Next next_for(int64_t t) { return Next(*this, t); }

 private:
  static constexpr int64_t kOnStack = 8;
  Stretch& at(int64_t t) { return on_heap_ ? on_heap_[t] : on_stack_[t]; }

  int64_t threads_;
  Stretch on_stack_[kOnStack];
  std::unique_ptr<Stretch[]> on_heap_;
};

// Where the balanced regions' wall time goes beyond their threads' work, summed over regions while switched on
// (neuronmm::region_times, bench.engine_step --region-times): fork, from the call until its last thread starts;
// tail, from the first thread's end to the last's (the others wait); join, from the last thread's end until the
// call returns; barrier, in a two-phase region (balanced_for_then), from the first thread's arrival at the barrier
// to the last's. Off (the default) it costs a relaxed load per region.
struct RegionTimes {
  std::atomic<bool> on{false};
  std::atomic<int64_t> regions{0}, fork_ns{0}, tail_ns{0}, join_ns{0}, wall_ns{0}, barrier_ns{0};
};

inline RegionTimes& region_times() {
  static RegionTimes times;
  return times;
}

// One region's clock: begin(t) / end(t) on each thread t (and arrive(t) at a two-phase region's barrier), the sums
// added at destruction (on the calling thread, after the region). Records nothing when off, or for regions of more
// threads than it holds.
class RegionClock {
 public:
  explicit RegionClock(int64_t threads, bool two_phase = false)
      : threads_(threads), on_(threads <= kMax && region_times().on.load(std::memory_order_relaxed)),
        two_phase_(two_phase), enter_(on_ ? now() : 0) {}
  void begin(int64_t t) {
    if (on_) begin_[t] = now();
  }
  void end(int64_t t) {
    if (on_) end_[t] = now();
  }
  // thread t reached a two-phase region's barrier
  void arrive(int64_t t) {
    if (on_) arrive_[t] = now();
  }
  ~RegionClock() {
    if (!on_) return;
    const int64_t exit = now();
    int64_t last_begin = enter_, first_end = exit, last_end = enter_;
    for (int64_t t = 0; t < threads_; ++t) {
      last_begin = std::max(last_begin, begin_[t]);
      first_end = std::min(first_end, end_[t]);
      last_end = std::max(last_end, end_[t]);
    }
    auto& times = region_times();
    times.regions.fetch_add(1, std::memory_order_relaxed);
    times.fork_ns.fetch_add(last_begin - enter_, std::memory_order_relaxed);
    times.tail_ns.fetch_add(last_end - first_end, std::memory_order_relaxed);
    times.join_ns.fetch_add(exit - last_end, std::memory_order_relaxed);
    times.wall_ns.fetch_add(exit - enter_, std::memory_order_relaxed);
    if (two_phase_) {
      const auto [first, last] = std::minmax_element(arrive_, arrive_ + threads_);
      times.barrier_ns.fetch_add(*last - *first, std::memory_order_relaxed);
    }
  }

 private:
  static constexpr int64_t kMax = 8;
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int64_t threads_;
  bool on_, two_phase_;  // (set at construction: the threads only write their own slots)
  int64_t enter_;
  int64_t begin_[kMax] = {}, end_[kMax] = {}, arrive_[kMax] = {};
};

// Runs body(next) once per thread over items [0, count): `next(item)` gives the thread its next item, false when
// none is left anywhere. Each thread starts on a stretch whose summed cost is about 1 / threads of the total
// (cost_before(i): the summed cost of items 0 .. i-1, non-decreasing) and takes it front to back, then takes the
// other stretches' items from their backs. Every item runs exactly once; which thread runs it may vary.
template <typename CostBefore, typename Body>
void balanced_for(int64_t count, const CostBefore& cost_before, const Body& body) {
  if (count <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  Stretches stretches(threads, count, cost_before);
  RegionClock clock(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) clock.begin(t);
    for (int64_t t = b; t < e; ++t)  // one t per thread (all of them in turn where the region has one thread)
      body(stretches.next_for(t));
    for (int64_t t = b; t < e; ++t) clock.end(t);
  });
}

// One balanced_for's work, for balanced_for_then.
template <typename CostBefore, typename Body>
struct Phase {
  int64_t count;
  CostBefore cost_before;
  Body body;
};

template <typename CostBefore, typename Body>
Phase<CostBefore, Body> phase(int64_t count, CostBefore cost_before, Body body) {
  return {count, std::move(cost_before), std::move(body)};
}

// balanced_for(first), then balanced_for(second), in one parallel region: every thread waits at a barrier for the
// first phase to end (the second reads what it wrote). Why: a low-rank projection at a decode step is two small
// GEMMs in a row (X·U, then ·V), and a second region's fork and join cost 3-6 µs of a 50-140 µs call at 16 rows
// (AVX512-BF16, two threads, measured in a step's MLP sequence).
constexpr int64_t kSpinsBeforeYield = 1 << 14;  // ~100 µs of PAUSEs: longer than a phase's usual skew

template <typename First, typename Second>
void balanced_for_then(const First& first, const Second& second) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max(first.count, second.count));
  if (threads <= 0) return;
  Stretches one(threads, first.count, first.cost_before), two(threads, second.count, second.cost_before);
  std::atomic<int64_t> arrived{0};
  RegionClock clock(threads, /*two_phase=*/true);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) clock.begin(t);
    for (int64_t t = b; t < e; ++t) first.body(one.next_for(t));
    for (int64_t t = b; t < e; ++t) clock.arrive(t);
    // Counted per stretch, not per thread: a region given fewer threads than stretches runs several in turn on
    // one thread, which must not wait for itself.
    arrived.fetch_add(e - b, std::memory_order_acq_rel);
    for (int64_t spins = 0; arrived.load(std::memory_order_acquire) < threads; ++spins) {
      if (spins < kSpinsBeforeYield) _mm_pause(); else std::this_thread::yield();  // the other thread lost its core
    }
    for (int64_t t = b; t < e; ++t) second.body(two.next_for(t));
    for (int64_t t = b; t < e; ++t) clock.end(t);
  });
}

}  // namespace neuronmm
