#pragma once
// Private to the engine: what a recompute needs to repeat a forward pass exactly (the random
// stream) without repeating its side effects (BatchNorm statistics). Shared by the chunked
// encoder and layer checkpointing.
#include <torch/torch.h>

#include <vector>

namespace framefit::engine::detail {

// The random-generator states in use before a forward pass (CPU, plus the device's on CUDA).
struct RngState {
  torch::Device device = torch::kCPU;
  torch::Tensor cpu, cuda;
  static RngState capture(torch::Device device);
  void make_current() const;  // the generators continue from this state
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

// Copies of buffers (BatchNorm statistics) that restore() writes back.
class BufferCopies {
 public:
  explicit BufferCopies(const std::vector<torch::Tensor>& buffers);
  void restore() const;

 private:
  std::vector<torch::Tensor> buffers_, copies_;
};

// BatchNorm statistics were updated once by the forward pass; a recompute must not update them
// again (PyTorch's own checkpointing does, twice). Restores the buffers on destruction.
class BufferSnapshot {
 public:
  explicit BufferSnapshot(const std::vector<torch::Tensor>& buffers) : copies_(buffers) {}
  ~BufferSnapshot() { copies_.restore(); }
  BufferSnapshot(const BufferSnapshot&) = delete;
  BufferSnapshot& operator=(const BufferSnapshot&) = delete;

 private:
  BufferCopies copies_;
};

// What a training step changes besides gradients and the optimizer's state (BatchNorm
// statistics, the random generators), taken before it: a step that is undone - retried after
// running out of memory, or dropped for a loss that is not finite - restores it and leaves no
// trace, where LibTorch would have updated the statistics of a failed attempt's layers again.
class StepStart {
 public:
  StepStart(const std::vector<torch::Tensor>& buffers, torch::Device device)
      : buffers_(buffers), rng_(RngState::capture(device)) {}
  void restore_buffers() const { buffers_.restore(); }
  void restore() const;  // buffers and generators

 private:
  BufferCopies buffers_;
  RngState rng_;
};

}  // namespace framefit::engine::detail
