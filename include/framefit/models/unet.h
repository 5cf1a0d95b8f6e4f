#pragma once
// A classic 2D UNet for per-pixel classification: an encoder of double convolutions with max
// pooling between, a decoder that upsamples, concatenates the encoder's output of the same size
// and convolves again, and a 1x1 output convolution.
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <vector>

#include "framefit/models/norm_relu_conv.h"
#include "framefit/models/resnet.h"  // Norm2d, NormKind

namespace framefit::models {

struct UNetOptions {
  TORCH_ARG(int64_t, in_channels) = 3;
  TORCH_ARG(int64_t, classes) = 2;
  TORCH_ARG(int64_t, width) = 64;  // channels of the first stage, doubled at each down step
  TORCH_ARG(int64_t, depth) = 4;   // down-sampling steps; H and W must be multiples of 2^depth
  TORCH_ARG(NormKind, norm) = NormKind::BatchNorm;
  TORCH_ARG(int64_t, groups) = 32;    // for NormKind::GroupNorm; must divide width
  TORCH_ARG(bool, bilinear) = false;  // bilinear upsampling instead of ConvTranspose2d
};

// Sizes from the options alone, without building the model. Counts are elements.
struct UNetSize {
  int64_t parameters = 0;
  int64_t buffer_elements = 0;  // BatchNorm running statistics (float) ...
  int64_t buffer_counters = 0;  // ... and num_batches_tracked counters (int64)
  int64_t size_multiple = 0;    // 2^depth: H and W must be multiples of it
};
UNetSize unet_size(const UNetOptions& options);

// conv3x3 - norm - ReLU, twice. Convolutions have no bias: the norm that follows has one. With
// recompute_norm on, the first norm and ReLU are recomputed in conv2's backward.
class DoubleConvImpl : public torch::nn::Module, public RecomputesNorm {
 public:
  DoubleConvImpl(int64_t in_channels, int64_t out_channels, const Norm2dOptions& norm);
  torch::Tensor forward(const torch::Tensor& x);
  // The rest of forward given conv1's output.
  torch::Tensor after_conv1(const torch::Tensor& h);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  Norm2d norm1{nullptr}, norm2{nullptr};
};
TORCH_MODULE(DoubleConv);

// One decoder stage: upsample x by 2 (ConvTranspose2d `upconv` halving its channels to the
// skip's, or bilinear without parameters), concatenate [skip, x] on channels, DoubleConv `conv`
// (its first convolution is computed per input, without materialising the concatenation).
class UNetUpImpl : public torch::nn::Module {
 public:
  UNetUpImpl(int64_t in_channels, int64_t skip_channels, bool bilinear, const Norm2dOptions& norm);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& skip);

  torch::nn::ConvTranspose2d upconv{nullptr};  // null when bilinear
  DoubleConv conv{nullptr};
};
TORCH_MODULE(UNetUp);

class UNetImpl : public torch::nn::Module {
 public:
  explicit UNetImpl(const UNetOptions& options = {});

  // [N,in_channels,H,W] floating point -> logits [N,classes,H,W]; H and W multiples of 2^depth.
  torch::Tensor forward(const torch::Tensor& x);

  // Stages for checkpointing; forward() is exactly:
  //   skips[i] = encoder_stage(i, ...) for i in [0, depth), x = encoder_stage(depth, skips.back())
  //   x = decoder_stage(j, x, skips[depth-1-j]) for j in [0, depth), then head(x).
  // Encoder stage i (child "down<i>") max-pools (i > 0) then applies its DoubleConv: output
  // width * 2^i channels at 1/2^i of the input size. Decoder stage j is child "up<j>".
  int64_t depth() const { return options_.depth(); }
  torch::Tensor encoder_stage(int64_t i, const torch::Tensor& x);
  torch::Tensor decoder_stage(int64_t j, const torch::Tensor& x, const torch::Tensor& skip);
  torch::Tensor head(const torch::Tensor& x) { return out(x); }
  const UNetOptions& options() const { return options_; }

  std::vector<DoubleConv> down;    // depth + 1 stages, children "down0" ... "down<depth>"
  std::vector<UNetUp> up;          // depth stages, children "up0" ... "up<depth-1>"
  torch::nn::Conv2d out{nullptr};  // 1x1 convolution to class logits, child "out"

  // Rank, channels and a size divisible by 2^depth, with what to change (forward checks it).
  void check_input(const torch::Tensor& x) const;

 private:
  UNetOptions options_;
};
TORCH_MODULE(UNet);

}  // namespace framefit::models
