// Tracker backend over LibTorch's CUDA caching allocator. Compiled only when framefit is built
// against a CUDA LibTorch (-DTorch_DIR=...); the CPU build never includes a CUDA header.
#include "backends.h"

#ifdef FRAMEFIT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#endif

namespace framefit::memory::detail {

#ifdef FRAMEFIT_WITH_CUDA
namespace {
namespace cca = c10::cuda::CUDACachingAllocator;

// StatType::AGGREGATE, index 0 in every LibTorch; the enum moved namespaces across versions.
constexpr size_t kAll = 0;

cca::DeviceStats device_stats(c10::DeviceIndex index) { return cca::getDeviceStats(index); }

// cuBLAS and cuBLASLt take a workspace from the caching allocator per handle and stream the
// first time they run and keep it: bytes a budget counts that no tensor of a step owns. Linear
// layers run forward here and backward (autograd's device thread has a handle of its own), in
// each precision the device takes, so the workspaces exist and their size is measured. No
// random numbers are drawn: the generators' streams stay as they were.
int64_t take_library_workspaces(c10::DeviceIndex index) {
  const auto before = device_stats(index).allocated_bytes[kAll].current;
  c10::AutoGradMode grad(true);
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    try {
      const auto options = at::TensorOptions().device(c10::Device(c10::kCUDA, index)).dtype(dtype);
      auto x = at::ones({64, 64}, options).requires_grad_();
      auto w = at::ones({64, 64}, options).requires_grad_();
      auto b = at::zeros({64}, options).requires_grad_();
      torch::autograd::backward({at::linear(x, w, b).sum() + at::mm(x, w).sum()});
    } catch (const c10::Error&) {  // a precision this GPU does not run
    }
  }
  return std::max<int64_t>(0, device_stats(index).allocated_bytes[kAll].current - before);
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(c10::DeviceIndex index) : index_(index) {
    // The caching allocator answers only once LibTorch has initialised CUDA on the device; one
    // tiny tensor does that portably across LibTorch versions.
    at::empty({1}, at::TensorOptions().device(c10::Device(c10::kCUDA, index)));
    library_bytes_ = take_library_workspaces(index);
  }
  int64_t library_bytes() const override { return library_bytes_; }
  c10::Device device() const override { return c10::Device(c10::kCUDA, index_); }
  int64_t current_bytes() const override { return stats().allocated_bytes[kAll].current; }
  int64_t peak_bytes() const override { return stats().allocated_bytes[kAll].peak; }
  void reset_peak() override { cca::resetPeakStats(index_); }
  int64_t reserved_bytes() const override { return stats().reserved_bytes[kAll].current; }
  int64_t allocation_count() const override { return stats().allocation[kAll].allocated; }
  void set_budget(int64_t bytes) override {
    TORCH_CHECK(bytes >= 0, "a memory budget cannot be negative; got ", bytes);
    c10::cuda::CUDAGuard guard(index_);
    size_t free_bytes = 0, total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const double fraction =
        bytes == 0 ? 1.0 : std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total_bytes));
    cca::setMemoryFraction(fraction, index_);
    budget_ = bytes;
  }
  int64_t budget_bytes() const override { return budget_; }
  void release_cache() override { cca::emptyCache(); }
  void set_phase_name(const std::string&) override {}  // CUDA's own error names no phase
  int64_t capacity_bytes() const override {
    c10::cuda::CUDAGuard guard(index_);
    size_t free_bytes = 0, total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return static_cast<int64_t>(total_bytes);
  }

 private:
  cca::DeviceStats stats() const { return device_stats(index_); }
  c10::DeviceIndex index_;
  int64_t library_bytes_ = 0;
  std::atomic<int64_t> budget_{0};
};
}  // namespace

std::unique_ptr<Backend> make_cuda_backend(c10::DeviceIndex index) {
  return std::make_unique<CudaBackend>(index);
}

#else

std::unique_ptr<Backend> make_cuda_backend(c10::DeviceIndex) {
  TORCH_CHECK(false, "this framefit was built against a CPU-only LibTorch; rebuild with "
                     "-DTorch_DIR=<a CUDA LibTorch>/share/cmake/Torch to track CUDA memory");
}

#endif

}  // namespace framefit::memory::detail
