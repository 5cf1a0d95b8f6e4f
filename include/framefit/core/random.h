#pragma once
// The states of LibTorch's default random generators, for whatever must continue a random
// stream exactly: a recomputed forward pass (the same dropout masks) and a resumed run.
#include <torch/types.h>

namespace framefit {

// The default generator of `device`: the CPU's, or the CUDA device's (the current one for an
// index-less "cuda"). Any other device type uses the CPU's.
torch::Tensor generator_state(torch::Device device);
void set_generator_state(torch::Device device, const torch::Tensor& state);

}  // namespace framefit
