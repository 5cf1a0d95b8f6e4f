#include "replay.h"

#include "framefit/core/random.h"

namespace framefit::engine::detail {

RngState RngState::capture(torch::Device device) {
  RngState state;
  state.device = device;
  state.cpu = generator_state(torch::kCPU);
  if (device.is_cuda()) state.cuda = generator_state(device);
  return state;
}

void RngState::make_current() const {
  set_generator_state(torch::kCPU, cpu);
  if (device.is_cuda()) set_generator_state(device, cuda);
}

RngReplay::RngReplay(const RngState& state) : saved_(RngState::capture(state.device)) {
  state.make_current();
}

RngReplay::~RngReplay() { saved_.make_current(); }

BufferCopies::BufferCopies(const std::vector<torch::Tensor>& buffers) : buffers_(buffers) {
  torch::NoGradGuard no_grad;
  for (const auto& b : buffers_) copies_.push_back(b.clone());
}

void BufferCopies::restore() const {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(copies_[i]);
}

void StepStart::restore() const {
  buffers_.restore();
  rng_.make_current();
}

}  // namespace framefit::engine::detail
