#pragma once
// A Conv3d (same options, parameters and names) whose backward, on the CPU, skips oneDNN for
// convolutions with few output positions. For those - layer4 of R3D-18 / R(2+1)D-18 on
// 16-frame 112-pixel clips, 2x7x7 per sample - oneDNN's weight-gradient pass holds several
// weight-sized buffers at once (a 512->512 3x3x3 weight is 27 MiB), which made layer4's backward
// the peak of the whole step. LibTorch's own kernel holds one weight gradient and the input's
// columns (test: LeanConv3d.BackwardHoldsOneWeightGradientAndItsColumns). R3D-18, batch 2 at
// 3x16x112x112 (bench/results/layers.md): peak 866 MiB instead of 1,077, activations 357 MiB
// instead of 568, for 9-22% more step time over the runs. The forward pass is unchanged
// (oneDNN), and so are the gradients, up to floating-point rounding.
//
// Convolutions with many output positions (the stem and layer1 on 112-pixel clips, 16x56x56 per
// sample) keep oneDNN but split its backward: the parameters' pass, then the input's, over slices
// of two samples. In one call its passes hold three input-sized buffers at once (the input's
// gradient and both operands reordered); split, two: a pass's result and one operand, or both
// operands (at batches of four or more, the input's gradient plus a slice's two). R3D-18 at
// batch 2 (3x16x112x112): its least-memory checkpointing plan holds 25 MB less, which is what
// halving its activation memory took (docs/layers.md); the passes take the same time.
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <array>
#include <tuple>

namespace framefit::models {

// How a convolution's backward runs: as LibTorch runs it (oneDNN on the CPU, in one call over
// the batch), with LibTorch's own kernel (the lean backward), or split into passes and slices.
enum class ConvBackward { Plain, Lean, Split };

class LeanConv3dImpl : public torch::nn::Conv3dImpl {
 public:
  explicit LeanConv3dImpl(torch::nn::Conv3dOptions options) : Conv3dImpl(std::move(options)) {}
  torch::Tensor forward(const torch::Tensor& x);
  // forward(x) with `padding` in place of the options' (a slice of a clip padded by hand where
  // it borders other slices, models/network.h).
  torch::Tensor forward_padded(const torch::Tensor& x, at::IntArrayRef padding);
  // The backward forward(x) takes (counted in lean_applicable_calls, as a call of forward):
  // for code that runs this convolution inside its own backward (models/norm_relu_conv.h).
  ConvBackward backward_for(const torch::Tensor& x);
  // Whether forward(x) takes the lean backward: on by default; off runs a plain Conv3d.
  bool lean_backward = true;
  // Whether forward(x) takes the split backward: on by default; off runs a plain Conv3d.
  bool split_backward = true;
  // Calls of forward() whose input the lean backward applies to, on or off: none after a
  // training step means switching it on changes nothing.
  int64_t lean_applicable_calls = 0;

 private:
  torch::Tensor run(const torch::Tensor& x, ConvBackward kind, at::IntArrayRef padding);
};
TORCH_MODULE(LeanConv3d);

// Output positions (T x H x W, per sample) up to which the lean backward is taken: layer4 of the
// video ResNets on 16-frame clips of 112 or 128 pixels (2x7x7, 2x8x8) takes it; layer3 (4x14x14),
// where oneDNN's workspace was about the weight's size and oneDNN the faster when this limit was
// set, does not.
constexpr int64_t kLeanBackwardMaxPositions = 128;

// Whether `conv` (lean_backward on) runs x's backward with LibTorch's kernel: a CPU float32
// input outside autocast, a gradient needed, one group, no dilation, zero padding mode, and at
// most kLeanBackwardMaxPositions output positions per sample.
bool takes_lean_backward(const LeanConv3dImpl& conv, const torch::Tensor& x);

// Output positions per sample from which oneDNN's backward is split: the stem and layer1 of the
// video ResNets on 16-frame 112-pixel clips (16x56x56). Not layer3 (4x14x14), where oneDNN's
// buffers are small and one sample at a time made it three times slower.
constexpr int64_t kSplitBackwardMinPositions = 16384;

// Whether `conv` (split_backward on) splits x's backward: the conditions of takes_lean_backward
// but the number of positions, at least kSplitBackwardMinPositions output positions per sample.
bool takes_split_backward(const LeanConv3dImpl& conv, const torch::Tensor& x);

// The gradients of a convolution (no transposition, no output padding) of x by `weight`, those
// `wanted` of x, weight and bias, run as `kind` says (Lean and Split: 3d, as takes_*_backward).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> convolution_backward(
    ConvBackward kind, const torch::Tensor& grad, const torch::Tensor& x,
    const torch::Tensor& weight, bool has_bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> wanted);

// Sets lean_backward on every LeanConv3d in `module`; returns how many there are.
int64_t set_lean_backward(torch::nn::Module& module, bool on);
// Sets split_backward on every LeanConv3d in `module`; returns how many there are.
int64_t set_split_backward(torch::nn::Module& module, bool on);
// The LeanConv3d calls in `module` whose input the lean backward applies to (whether on or off).
int64_t lean_applicable_calls(const torch::nn::Module& module);

}  // namespace framefit::models
