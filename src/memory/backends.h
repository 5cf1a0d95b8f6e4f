#pragma once
// Private to src/memory: the device backends behind framefit::memory::Tracker.
#include "framefit/memory/tracker.h"

namespace framefit::memory::detail {

// The process-wide CPU backend over framefit's tracking allocator.
std::unique_ptr<Backend> make_cpu_backend();
// Whether the calling thread's CPU allocations count as the data pipeline's; returns the
// previous setting.
bool set_pipeline_thread(bool on);

// A backend over LibTorch's CUDA caching allocator; throws if this build has no CUDA.
std::unique_ptr<Backend> make_cuda_backend(c10::DeviceIndex index);

}  // namespace framefit::memory::detail
