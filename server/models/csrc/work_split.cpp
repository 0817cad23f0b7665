// Probes of neuronmm::balanced_for and balanced_for_then (work_split.h) for the tests (which thread ran each item),
// and the switch and read-out of their region times (bench.engine_step --region-times).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "work_split.h"

namespace {

// Runs balanced_for over items costing `costs` (int64 [count]), thread 0 sleeping `stall_us` before its first item
// (as a thread whose core the OS gave to another process). Returns the thread that ran each item (-1: none did);
// fails if any item ran twice.
at::Tensor balanced_for_owners(const at::Tensor& costs, int64_t stall_us) {
  TORCH_CHECK(costs.dim() == 1 && costs.scalar_type() == at::kLong, "balanced_for_owners: int64 costs [count] expected");
  const auto c = costs.contiguous();
  const int64_t count = c.size(0);
  std::vector<int64_t> before(count + 1, 0);
  for (int64_t i = 0; i < count; ++i) before[i + 1] = before[i] + c.data_ptr<int64_t>()[i];
  auto owners = at::full({count}, -1, c.options());
  int64_t* out = owners.data_ptr<int64_t>();
  std::atomic<int64_t> twice{0};
  neuronmm::balanced_for(count, [&](int64_t i) { return before[i]; }, [&](const auto& next) {
    const int64_t thread = at::get_thread_num();
    if (thread == 0 && stall_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
    for (int64_t item; next(item);) {
      if (out[item] != -1) twice.fetch_add(1);
      out[item] = thread;
    }
  });
  TORCH_CHECK(twice.load() == 0, "balanced_for_owners: an item ran twice");
  return owners;
}

// Runs balanced_for_then over two phases of items costing `first` and `second` (int64 [count] each), the first
// first-phase item to be claimed taking `stall_us` (claimed, no other thread can take it, and the others run out of
// first-phase work meanwhile); `nested`:
// called from inside another parallel region. Returns the thread that ran each item, the first phase's then the
// second's (-1: none did); fails if an item ran twice or a second-phase item started before every first-phase item
// had ended.
at::Tensor balanced_for_then_owners(const at::Tensor& first, const at::Tensor& second, int64_t stall_us, bool nested) {
  TORCH_CHECK(first.dim() == 1 && second.dim() == 1 && first.scalar_type() == at::kLong &&
                  second.scalar_type() == at::kLong,
              "balanced_for_then_owners: int64 costs [count] expected for both phases");
  const auto c1 = first.contiguous(), c2 = second.contiguous();
  const int64_t n1 = c1.size(0), n2 = c2.size(0);
  const auto prefix = [](const at::Tensor& c) {
    std::vector<int64_t> before(c.size(0) + 1, 0);
    for (int64_t i = 0; i < c.size(0); ++i) before[i + 1] = before[i] + c.data_ptr<int64_t>()[i];
    return before;
  };
  const auto before1 = prefix(c1), before2 = prefix(c2);
  auto owners = at::full({n1 + n2}, -1, c1.options());
  int64_t* out = owners.data_ptr<int64_t>();
  std::atomic<int64_t> twice{0}, first_done{0}, early{0};
  std::atomic<bool> stall_taken{stall_us <= 0};
  const auto run = [&](int64_t offset, bool is_first) {
    return [&, offset, is_first](const auto& next) {
      const int64_t thread = at::get_thread_num();
      for (int64_t item; next(item);) {
        if (!is_first && first_done.load() != n1) early.fetch_add(1);
        if (out[offset + item] != -1) twice.fetch_add(1);
        out[offset + item] = thread;
        if (is_first && !stall_taken.exchange(true)) std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
        if (is_first) first_done.fetch_add(1);
      }
    };
  };
  const auto phases = [&] {
    neuronmm::balanced_for_then(neuronmm::phase(n1, [&](int64_t i) { return before1[i]; }, run(0, true)),
                                neuronmm::phase(n2, [&](int64_t i) { return before2[i]; }, run(n1, false)));
  };
  if (nested)  // the first of a two-item region's threads calls it
    at::parallel_for(0, 2, 1, [&](int64_t b, int64_t) { if (b == 0) phases(); });
  else
    phases();
  TORCH_CHECK(twice.load() == 0, "balanced_for_then_owners: an item ran twice");
  TORCH_CHECK(early.load() == 0, "balanced_for_then_owners: a second-phase item started before the first phase ended");
  return owners;
}

// The balanced regions' times summed since the last call ([regions, fork, tail, join, wall, barrier], ns; see
// RegionTimes), then reset; `on` switches the recording on or off from here.
std::vector<int64_t> region_times(bool on) {
  auto& times = neuronmm::region_times();
  times.on.store(on);
  return {times.regions.exchange(0), times.fork_ns.exchange(0), times.tail_ns.exchange(0), times.join_ns.exchange(0),
          times.wall_ns.exchange(0), times.barrier_ns.exchange(0)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronmm, m) {
  m.def("balanced_for_owners(Tensor costs, int stall_us) -> Tensor");
  m.def("balanced_for_then_owners(Tensor first, Tensor second, int stall_us, bool nested=False) -> Tensor");
  m.def("region_times(bool on) -> int[]", &region_times);
}

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) {
  m.impl("balanced_for_owners", &balanced_for_owners);
  m.impl("balanced_for_then_owners", &balanced_for_then_owners);
}
