#pragma once
// conv(relu(batch_norm(x))) keeping only x for backward, which recomputes the normalised,
// rectified tensor from x and the batch's statistics: the cheapest recomputation there is (one
// elementwise pass), for one activation-sized tensor less per step. Plainly run, this sequence
// keeps x for BatchNorm and relu's output for ReLU and the convolution; every conv-BN-ReLU-conv
// of R(2+1)D-18 (each (2+1)D convolution's middle, and between a block's two convolutions), of
// R3D-18's blocks, of the UNet's double convolutions and of the 2D ResNets' blocks (one per
// basic block, two per bottleneck) has one, so these models keep fewer activations with it on
// (docs/layers.md has the measured effect).
//
// Gradients are those of the plain sequence up to floating-point rounding (the normalisation is
// computed as x * scale + shift per channel); BatchNorm's running statistics are updated once,
// in forward, as plainly. Taken in training with grad for float32/float64 input outside autocast
// and a BatchNorm (Norm2d: batch or frozen statistics, not GroupNorm); otherwise the plain
// sequence runs.
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/types.h>

#include "framefit/models/conv3d.h"

namespace framefit::models {

class Norm2dImpl;  // models/resnet.h, whose blocks use this

// A module whose forward has norm-ReLU-convolution steps: with recompute_norm on it runs them
// through norm_relu_conv.
class RecomputesNorm {
 public:
  virtual ~RecomputesNorm() = default;
  bool recompute_norm = false;
};

// Sets recompute_norm on every module in `module` (itself included) that has it; returns how many.
int64_t set_recompute_norm(torch::nn::Module& module, bool on);

torch::Tensor norm_relu_conv(const torch::Tensor& x, Norm2dImpl& norm, torch::nn::Conv2dImpl& conv);
torch::Tensor norm_relu_conv(const torch::Tensor& x, torch::nn::BatchNorm3dImpl& norm,
                             LeanConv3dImpl& conv);

}  // namespace framefit::models
