#pragma once
// Private to the engine: what a recompute needs to repeat a forward pass exactly (the random
// stream) without repeating its side effects (BatchNorm statistics). Shared by the chunked
// encoder and layer checkpointing.
#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <vector>

namespace framefit::engine::detail {

torch::Tensor generator_state(torch::Device device);
void set_generator_state(torch::Device device, const torch::Tensor& state);

// The random-generator states in use before a forward pass (CPU, plus the device's on CUDA).
struct RngState {
  torch::Device device = torch::kCPU;
  torch::Tensor cpu, cuda;
  static RngState capture(torch::Device device);
};

// Replays a captured random stream for its lifetime, then restores the current one, so that
// recomputing does not shift later draws.
class RngReplay {
 public:
  explicit RngReplay(const RngState& state);
  ~RngReplay();
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  RngState saved_;
};

// BatchNorm statistics were updated once by the forward pass; a recompute must not update them
// again (PyTorch's own checkpointing does, twice). Restores the buffers on destruction.
class BufferSnapshot {
 public:
  explicit BufferSnapshot(const std::vector<torch::Tensor>& buffers);
  ~BufferSnapshot();
  BufferSnapshot(const BufferSnapshot&) = delete;
  BufferSnapshot& operator=(const BufferSnapshot&) = delete;

 private:
  std::vector<torch::Tensor> buffers_, copies_;
};

}  // namespace framefit::engine::detail
