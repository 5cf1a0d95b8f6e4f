#pragma once
// A Conv3d (same options, parameters and names) whose backward, on the CPU, skips oneDNN for
// convolutions with few output positions. For those - layer4 of R3D-18 / R(2+1)D-18 on
// 16-frame 112-pixel clips, 2x7x7 per sample - oneDNN 2.x's weight-gradient pass holds about
// nine copies of the weight at once (a 512->512 3x3x3 layer: +249 MiB at 2 threads for a
// 28 MiB weight), which makes that layer's backward the peak of the whole step. LibTorch's own
// kernel needs one copy plus its columns (+38 MiB), at up to 1.7x that layer's time. The forward
// pass is unchanged (oneDNN), and so are the gradients, up to floating-point rounding.
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace framefit::models {

class LeanConv3dImpl : public torch::nn::Conv3dImpl {
 public:
  explicit LeanConv3dImpl(torch::nn::Conv3dOptions options) : Conv3dImpl(std::move(options)) {}
  torch::Tensor forward(const torch::Tensor& x);
  // Whether forward(x) takes the lean backward: on by default; off runs a plain Conv3d.
  bool lean_backward = true;
};
TORCH_MODULE(LeanConv3d);

// Output positions (T x H x W, per sample) up to which the lean backward is taken: oneDNN's
// large weight-gradient workspace was measured at 2x7x7 and 2x8x8 outputs, not at 4x7x7 (196),
// where oneDNN is both leaner and faster.
constexpr int64_t kLeanBackwardMaxPositions = 128;

// Whether `conv` (lean_backward on) runs x's backward with LibTorch's kernel: a CPU float32
// input outside autocast, a gradient needed, one group, no dilation, zero padding mode, and at
// most kLeanBackwardMaxPositions output positions per sample.
bool takes_lean_backward(const LeanConv3dImpl& conv, const torch::Tensor& x);

}  // namespace framefit::models
