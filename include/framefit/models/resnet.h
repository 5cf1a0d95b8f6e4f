#pragma once
// ResNet-18/34/50 with torchvision's architecture and parameter names, so torchvision
// state_dicts load as they are and framefit's weights load back in torchvision.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "framefit/models/norm_relu_conv.h"

namespace framefit::models {

enum class NormKind {
  BatchNorm,        // "bn": torchvision's BatchNorm2d
  FrozenBatchNorm,  // "frozen_bn": running statistics only, affine not trained
  GroupNorm,        // "group_norm": independent of batch size, so chunking is exact
};
NormKind parse_norm_kind(const std::string& name);  // "bn" | "frozen_bn" | "group_norm"
std::string to_string(NormKind kind);

// Memory layout of the encoder's activations. Auto picks channels-last (NHWC) with BatchNorm or
// frozen BatchNorm: measured faster on the CPU at long T (bench/results/step_bench.md) and on
// CUDA in bf16, no slower in fp32 (bench/results/gpu.md). On the CPU layer4 returns to NCHW:
// oneDNN's convolutions on its small feature maps are faster in NCHW (ResNet-18 at 112 px: 8%
// less time per encoder step; never slower at 64-224 px). GroupNorm stays NCHW (LibTorch 1.13's
// CPU GroupNorm is slower on NHWC input); channels_last forces NHWC everywhere.
enum class ActivationLayout { Auto, Nchw, ChannelsLast };
ActivationLayout parse_activation_layout(const std::string& name);  // auto | nchw | channels_last

// What a layout means for a ResNet's stages (ResNetOptions::channels_last and nchw_from).
struct StageLayout {
  bool channels_last = false;  // the input and the stages before nchw_from run in NHWC
  std::string nchw_from;       // first stage back in NCHW; "" = none
};
StageLayout resolve_layout(ActivationLayout layout, NormKind norm, c10::DeviceType device);

// One normalisation layer with torchvision's parameter and buffer names (weight, bias,
// running_mean, running_var, num_batches_tracked) whatever its kind.
struct Norm2dOptions {
  Norm2dOptions(int64_t channels) : channels_(channels) {}
  TORCH_ARG(int64_t, channels);
  TORCH_ARG(NormKind, kind) = NormKind::BatchNorm;
  TORCH_ARG(int64_t, groups) = 32;  // GroupNorm only; must divide channels
  TORCH_ARG(double, eps) = 1e-5;
  TORCH_ARG(double, momentum) = 0.1;
};

class Norm2dImpl : public torch::nn::Module {
 public:
  explicit Norm2dImpl(const Norm2dOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  // Frozen: uses running statistics in training too and its affine parameters take no grad.
  void freeze();
  bool frozen() const { return frozen_; }
  const Norm2dOptions& options() const { return options_; }

  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  torch::Tensor norm(const torch::Tensor& x);
  Norm2dOptions options_;
  bool frozen_ = false;
};
TORCH_MODULE(Norm2d);

// torchvision's BasicBlock (ResNet-18/34) or Bottleneck (ResNet-50), same names. With
// recompute_norm on, bn1 and its ReLU (and a bottleneck's bn2 and its ReLU) are recomputed in the
// next convolution's backward.
class ResidualBlockImpl : public torch::nn::Module, public RecomputesNorm {
 public:
  ResidualBlockImpl(int64_t in_channels, int64_t width, int64_t stride, bool bottleneck,
                    const Norm2dOptions& norm);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t out_channels() const { return out_channels_; }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  Norm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};

 private:
  int64_t out_channels_;
};
TORCH_MODULE(ResidualBlock);

struct ResNetOptions {
  ResNetOptions(int64_t depth = 18) : depth_(depth) {}
  TORCH_ARG(int64_t, depth);                // 18, 34 or 50
  TORCH_ARG(int64_t, num_classes) = 1000;   // 0: feature mode, no fc, forward gives features
  TORCH_ARG(NormKind, norm) = NormKind::BatchNorm;
  TORCH_ARG(int64_t, groups) = 32;          // for NormKind::GroupNorm
  TORCH_ARG(std::string, freeze) = "";      // freeze up to and including: conv1, layer1..layer4
  TORCH_ARG(bool, drop_layer4) = false;     // slim variant: features from layer3
  TORCH_ARG(bool, channels_last) = false;   // NHWC activations (see resolve_layout) ...
  TORCH_ARG(std::string, nchw_from) = "";   // ... up to this stage; a dropped layer4 is ignored
  // Each block's BatchNorm and ReLU between convolutions recomputed in backward (set on the
  // blocks; set_recompute_norm changes it later).
  TORCH_ARG(bool, recompute_norm) = false;
};

// Parses "resnet18" | "resnet34" | "resnet50" into a depth.
int64_t parse_resnet_name(const std::string& name);

// A ResNet's sizes computed from its options alone, without building it: the doctor and the
// memory model need them before anything is allocated. Counts are elements, not bytes.
struct ResNetSize {
  int64_t parameters = 0;          // every parameter (conv, norm affine, fc)
  int64_t trained_parameters = 0;  // those with requires_grad after freezing
  int64_t largest_trained = 0;     // the largest single trained parameter tensor
  int64_t buffer_elements = 0;     // norm running statistics (float) ...
  int64_t buffer_counters = 0;     // ... and num_batches_tracked counters (int64)
  int64_t feature_dim = 0;
  int64_t min_input_size = 0;
  int64_t frozen_stages = 0;
  // Channels and total stride after the last frozen stage (the frozen output per frame is
  // channels x ceil(H/stride) x ceil(W/stride)); 0 when nothing is frozen.
  int64_t frozen_channels = 0;
  int64_t frozen_stride = 0;
};
ResNetSize resnet_size(const ResNetOptions& options);

class ResNetImpl : public torch::nn::Module {
 public:
  explicit ResNetImpl(const ResNetOptions& options = {});

  // [N,3,H,W] floating point, normalised -> logits [N,num_classes] (or features in feature mode).
  torch::Tensor forward(const torch::Tensor& x);
  // [N,3,H,W] -> pooled features [N,feature_dim()].
  torch::Tensor features(const torch::Tensor& x);
  int64_t feature_dim() const { return feature_dim_; }
  // Smallest height/width the network accepts (its total stride).
  int64_t min_input_size() const;
  const ResNetOptions& options() const { return options_; }
  // Stage names in forward order: "conv1" (conv1+bn1+relu+maxpool), "layer1", ...
  std::vector<std::string> stage_names() const;
  // Runs stages [begin, end) of stage_names(); ending with the last stage also pools, giving
  // [N, feature_dim()]. Lets the engine run frozen stages apart from trained ones.
  torch::Tensor forward_stages(const torch::Tensor& x, int64_t begin, int64_t end);
  // How many leading stages are frozen (options().freeze()), 0 if none.
  int64_t frozen_stage_count() const;

  torch::nn::Conv2d conv1{nullptr};
  Norm2d bn1{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr}, layer4{nullptr};
  torch::nn::Linear fc{nullptr};

 private:
  void check_input(const torch::Tensor& x) const;
  void freeze_up_to(const std::string& stage);
  // The modules holding a stage's parameters: conv1 and bn1 for "conv1", else the layer.
  std::vector<std::shared_ptr<torch::nn::Module>> stage_modules(const std::string& stage);
  ResNetOptions options_;
  int64_t first_nchw_stage_ = 0;  // with channels_last: stages from here on run NCHW
  int64_t feature_dim_ = 0;
};
TORCH_MODULE(ResNet);

}  // namespace framefit::models
