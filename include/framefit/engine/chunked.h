#pragma once
// Exact end-to-end training of a per-frame encoder over a whole video in memory that does not
// grow with the video's length.
//
// chunked_encode() returns the features [T,D] of all frames attached to autograd, but its
// forward pass keeps no encoder activations: it runs one chunk of frames at a time without
// grad. Backward recomputes each chunk with grad, replaying its random numbers and leaving
// BatchNorm statistics as the forward pass set them, and accumulates the encoder's parameter
// gradients: the same gradients as running all T frames with grad (naive training), up to
// floating-point summation order.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <vector>

#include "framefit/engine/extract.h"

namespace framefit::memory {
class Tracker;
}

namespace framefit::models {
class ResNetImpl;
}

namespace framefit::engine {

// A per-frame encoder split at its frozen boundary: `frozen` (may be empty) runs the stages
// that are not trained, without grad; `trainable` maps its output to [N,D] features.
struct FrameEncoder {
  std::function<torch::Tensor(const torch::Tensor&)> frozen;
  std::function<torch::Tensor(const torch::Tensor&)> trainable;
  std::vector<torch::Tensor> parameters;  // trained parameters (requires_grad)
  std::vector<torch::Tensor> buffers;     // state forward may change (BatchNorm statistics)
};

// Splits a ResNet after its frozen stages (ResNetOptions::freeze).
FrameEncoder frame_encoder(const std::shared_ptr<models::ResNetImpl>& resnet);
// Any module: `forward` maps [N,3,H,W] input to [N,D]; everything is trainable.
FrameEncoder frame_encoder(const std::shared_ptr<torch::nn::Module>& module,
                           std::function<torch::Tensor(const torch::Tensor&)> forward);

struct ChunkedOptions {
  // Frames per chunk; 0 runs all frames with grad at once (naive training, the reference).
  int64_t chunk = 32;
  // The last `keep` chunks keep their graph from the forward pass and are not recomputed.
  int64_t keep = 1;
  // Keep the frozen stages' outputs between forward and backward instead of recomputing them
  // (costs their size per frame; saves their compute).
  bool cache_frozen = false;
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;  // input dtype (float64 for exactness checks)
  bool channels_last = false;
  FrameNormalization normalization;
  // The device's tracker, where the memory phases "encode" (forward) and "recompute" (backward)
  // are recorded, and named in an out-of-memory error; null: none recorded.
  memory::Tracker* tracker = nullptr;
};

// frames: [T,3,H,W] uint8 (or normalised float) on the host; only the chunk being processed is
// converted and moved to options.device. Returns [T,D] features (float32, or float64 when the
// encoder computes in float64) on options.device, attached to autograd when grad mode is on.
// Without grad (inference, evaluation) the chunks simply run one after the other: memory holds
// one chunk's activations and the features, whatever the video's length.
torch::Tensor chunked_encode(const FrameEncoder& encoder, const torch::Tensor& frames,
                             const ChunkedOptions& options = {});

}  // namespace framefit::engine
