#include "replay.h"

namespace framefit::engine::detail {

namespace {
torch::Generator default_generator(torch::Device device) {
  return at::globalContext().defaultGenerator(device.is_cuda() ? device
                                                               : torch::Device(torch::kCPU));
}
}  // namespace

torch::Tensor generator_state(torch::Device device) {
  auto gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(torch::Device device, const torch::Tensor& state) {
  auto gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

RngState RngState::capture(torch::Device device) {
  RngState state;
  state.device = device;
  state.cpu = generator_state(torch::kCPU);
  if (device.is_cuda()) state.cuda = generator_state(device);
  return state;
}

RngReplay::RngReplay(const RngState& state) : saved_(RngState::capture(state.device)) {
  set_generator_state(torch::kCPU, state.cpu);
  if (state.device.is_cuda()) set_generator_state(state.device, state.cuda);
}

RngReplay::~RngReplay() {
  set_generator_state(torch::kCPU, saved_.cpu);
  if (saved_.device.is_cuda()) set_generator_state(saved_.device, saved_.cuda);
}

BufferSnapshot::BufferSnapshot(const std::vector<torch::Tensor>& buffers) : buffers_(buffers) {
  torch::NoGradGuard no_grad;
  for (const auto& b : buffers_) copies_.push_back(b.clone());
}

BufferSnapshot::~BufferSnapshot() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(copies_[i]);
}

}  // namespace framefit::engine::detail
