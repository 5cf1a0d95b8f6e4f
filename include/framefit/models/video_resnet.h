#pragma once
// R3D-18 and R(2+1)D-18 video classifiers with torchvision's architecture and parameter names
// (torchvision.models.video.r3d_18 / r2plus1d_18), so their state_dicts load as they are and
// framefit's weights load back in torchvision.
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "framefit/models/conv3d.h"
#include "framefit/models/norm_relu_conv.h"

#include <string>
#include <utility>
#include <vector>

namespace framefit::models {

enum class VideoArch {
  R3D_18,       // "r3d_18": full 3x3x3 convolutions
  R2Plus1D_18,  // "r2plus1d_18": each 3x3x3 convolution split into 1x3x3 spatial + 3x1x1 temporal
};
VideoArch parse_video_arch(const std::string& name);  // "r3d_18" | "r2plus1d_18"
std::string to_string(VideoArch arch);

struct VideoResNetOptions {
  VideoResNetOptions(std::string arch = "r3d_18") : arch_(std::move(arch)) {}
  TORCH_ARG(std::string, arch);           // "r3d_18" or "r2plus1d_18"
  TORCH_ARG(int64_t, num_classes) = 400;  // Kinetics-400; 0: feature mode, no fc
  // On the CPU, the backward of convolutions with few output positions (layer4 on 112-pixel
  // clips) without oneDNN's weight-sized workspace buffers (models/conv3d.h).
  TORCH_ARG(bool, lean_backward) = true;
};

// Sizes from the options alone, without building the model (for the planner). Counts are
// elements, not bytes.
struct VideoResNetSize {
  int64_t parameters = 0;       // every parameter (conv, BatchNorm affine, fc)
  int64_t buffer_elements = 0;  // BatchNorm running statistics (float) ...
  int64_t buffer_counters = 0;  // ... and num_batches_tracked counters (int64)
  int64_t feature_dim = 0;      // 512
  int64_t min_input_size = 0;   // smallest height/width accepted (the spatial stride, 16)
};
VideoResNetSize video_resnet_size(const VideoResNetOptions& options);

// torchvision's Conv2Plus1D: a (1,3,3) spatial convolution to `mid` channels, BatchNorm, ReLU,
// then a (3,1,1) temporal convolution. Children "0", "1", "2", "3" as in torchvision's
// nn.Sequential, so its keys read conv1.0.0.weight, conv1.0.1.running_mean, conv1.0.3.weight.
// With recompute_norm on, the BatchNorm and ReLU are recomputed in the temporal convolution's
// backward (models/norm_relu_conv.h).
class Conv2Plus1dImpl : public torch::nn::Module, public RecomputesNorm {
 public:
  Conv2Plus1dImpl(int64_t in_channels, int64_t out_channels, int64_t mid_channels, int64_t stride);
  torch::Tensor forward(const torch::Tensor& x);
  // The rest of forward given the spatial convolution's output.
  torch::Tensor after_spatial(const torch::Tensor& h);

  LeanConv3d spatial{nullptr}, temporal{nullptr};
  torch::nn::BatchNorm3d norm{nullptr};
  torch::nn::ReLU relu{nullptr};
};
TORCH_MODULE(Conv2Plus1d);

// torchvision's video BasicBlock: conv1 = [conv, BatchNorm3d, ReLU], conv2 = [conv, BatchNorm3d],
// optional downsample = [1x1x1 conv, BatchNorm3d]; conv is Conv3d (3x3x3) or Conv2Plus1d. With
// recompute_norm on, conv1's BatchNorm and ReLU are recomputed in the backward of conv2's first
// convolution.
class VideoBasicBlockImpl : public torch::nn::Module, public RecomputesNorm {
 public:
  VideoBasicBlockImpl(VideoArch arch, int64_t in_channels, int64_t channels, int64_t stride);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Sequential conv1{nullptr}, conv2{nullptr}, downsample{nullptr};
};
TORCH_MODULE(VideoBasicBlock);

// recompute_norm (set_recompute_norm sets it on the blocks too): R(2+1)D-18's stem recomputes its
// inner BatchNorm and ReLU in its temporal convolution's backward.
class VideoResNetImpl : public torch::nn::Module, public RecomputesNorm {
 public:
  explicit VideoResNetImpl(const VideoResNetOptions& options = {});

  // [N,3,T,H,W] floating point, normalised -> logits [N,num_classes] (features [N,512] in
  // feature mode). Any T >= 1; H and W at least min_input_size().
  torch::Tensor forward(const torch::Tensor& x);
  // [N,3,T,H,W] -> pooled features [N,feature_dim()], without fc.
  torch::Tensor features(const torch::Tensor& x);
  int64_t feature_dim() const { return 512; }
  int64_t min_input_size() const { return 16; }
  VideoArch arch() const { return arch_; }
  const VideoResNetOptions& options() const { return options_; }

  // The body as an ordered list of blocks, the unit of layer checkpointing:
  // "stem", "layer1.0", "layer1.1", ..., "layer4.1", "head" (10 in all). "head" is global
  // average pooling + flatten + fc (no fc in feature mode), giving [N,num_classes] or [N,512].
  std::vector<std::string> block_names() const;
  // Runs blocks [begin, end) of block_names() on x, the output of block begin-1 (the input
  // video when begin is 0). forward(x) == forward_blocks(x, 0, block_names().size()).
  torch::Tensor forward_blocks(const torch::Tensor& x, int64_t begin, int64_t end);

  torch::nn::Sequential stem{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr}, layer4{nullptr};
  torch::nn::Linear fc{nullptr};

 private:
  void check_input(const torch::Tensor& x) const;
  VideoResNetOptions options_;
  VideoArch arch_;
};
TORCH_MODULE(VideoResNet);

}  // namespace framefit::models
