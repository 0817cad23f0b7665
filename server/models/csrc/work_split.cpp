// A probe of neuronmm::balanced_for (work_split.h) for the tests: which thread ran each item.
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronmm, m) { m.def("balanced_for_owners(Tensor costs, int stall_us) -> Tensor"); }

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) { m.impl("balanced_for_owners", &balanced_for_owners); }
