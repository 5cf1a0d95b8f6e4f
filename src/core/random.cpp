#include "framefit/core/random.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <mutex>

namespace framefit {

namespace {
at::Generator default_generator(torch::Device device) {
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

}  // namespace framefit
