#pragma once
// Private to src/memory: the device backends behind framefit::memory::Tracker.
#include "framefit/memory/tracker.h"

#include <chrono>

namespace framefit::memory::detail {

// The process-wide CPU backend over framefit's tracking allocator.
std::unique_ptr<Backend> make_cpu_backend();
// Whether the calling thread's CPU allocations count as the data pipeline's; returns the
// previous setting.
bool set_pipeline_thread(bool on);

// A backend over LibTorch's CUDA caching allocator; throws if this build has no CUDA.
std::unique_ptr<Backend> make_cuda_backend(c10::DeviceIndex index);

// The clock of PhaseEvent::time_ns and of the trace files' timestamps: one, so they line up.
inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace framefit::memory::detail
