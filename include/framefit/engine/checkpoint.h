#pragma once
// Layer checkpointing for LibTorch, which has none: a network split into a chain of stages
// (layers, or whole blocks with their skip connections inside: ResNet blocks, UNet stages),
// some of which keep no activations in the forward pass and are recomputed in backward.
//
// Which stages to recompute is chosen for a memory budget from measured per-stage costs by
// plan::plan_chain (plan/chain_plan.h): the least recompute time whose kept activations plus
// the largest recomputed segment fit. Recomputing replays the random stream
// (dropout) and leaves BatchNorm statistics as the forward pass set them (updated once, unlike
// PyTorch's checkpointing), so gradients are exactly those of running without checkpointing.
// A checkpointed chain is an ordinary function of its input: it works inside the chunked
// encoder (engine/chunked.h), so larger chunks fit the same budget.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace framefit::memory {
class Tracker;
}

namespace framefit::models {
class ResNetImpl;
class NetworkImpl;
class UNetImpl;
class VideoResNetImpl;
}  // namespace framefit::models

namespace framefit::engine {

// A piece of a network mapping one activation to the next.
struct Stage {
  std::string name;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> parameters;  // those with requires_grad
  std::vector<torch::Tensor> buffers;     // state forward may change (BatchNorm statistics)
};
// A stage running `forward` over `module`'s parameters and buffers.
Stage make_stage(std::string name, const torch::nn::Module& module,
                 std::function<torch::Tensor(const torch::Tensor&)> forward);

// The chains of framefit's models: a ResNet as stem, each residual block, then pooling (and fc
// when it has one); a layer-list network one stage per convolution or linear layer, with the
// norm, activation and pooling layers that follow it.
std::vector<Stage> resnet_stages(const std::shared_ptr<models::ResNetImpl>& resnet);
std::vector<Stage> network_stages(const std::shared_ptr<models::NetworkImpl>& network);
// R3D-18 / R(2+1)D-18 as stem, each block, head (models/video_resnet.h block_names()).
std::vector<Stage> video_resnet_stages(const std::shared_ptr<models::VideoResNetImpl>& video);

// Runs `stage` on `input` keeping only the input; backward runs it again with grad. Without
// grad mode (or nothing to differentiate) it is just stage.forward(input).
torch::Tensor checkpoint(const Stage& stage, const torch::Tensor& input);

// A stage of several inputs, such as a UNet decoder stage (upsampled input and skip).
struct MultiStage {
  std::string name;
  std::function<torch::Tensor(const std::vector<torch::Tensor>&)> forward;
  std::vector<torch::Tensor> parameters;
  std::vector<torch::Tensor> buffers;
};
torch::Tensor checkpoint(const MultiStage& stage, const std::vector<torch::Tensor>& inputs);

// What one stage costs, measured on the device of the input: bytes the stage leaves allocated
// when run with grad in the chain (its output and what its graph saves), its output's bytes,
// forward seconds, and the peak of running it alone forward and backward (above its input:
// what it keeps plus backward's gradients) as a stored stage. Recomputed, a stage's backward
// holds the same: its checkpoint lets its incoming gradient go once the stage's last operation
// has used it, as a stored stage's graph does.
struct StageCost {
  int64_t kept_bytes = 0;
  int64_t output_bytes = 0;
  double seconds = 0;
  int64_t peak_bytes = 0;
  // Of peak_bytes, the highest during the forward alone. A recomputed stage runs its forward
  // again while the gradient of its output is already held, which its own measure does not see.
  int64_t forward_peak_bytes = 0;
  // Its trained parameters' gradients. A recomputed segment returns its parameters' gradients
  // when its backward ends, so while it recomputes a stage it holds those of the later stages
  // in it (a stored stage's go straight into .grad). The same at any batch.
  int64_t parameter_grad_bytes = 0;
};
// Measured on `tracker`, the tracker of the input's device.
std::vector<StageCost> measure_stages(const std::vector<Stage>& stages, const torch::Tensor& input,
                                      memory::Tracker& tracker);
// Costs at `factor` times the measured batch (activations and time grow with the batch).
std::vector<StageCost> scale_costs(const std::vector<StageCost>& costs, double factor);

struct ChainSegment {
  int64_t begin = 0, end = 0;  // stages [begin, end)
  bool recompute = false;
  // Recomputed at two levels, as Revolve does: the forward keeps only the segment's input, as
  // a recomputed segment does, but its backward recomputes the stages one at a time (it reruns
  // all but the last without grad to get their inputs back, then each with grad, last first).
  // The segment's own outputs are then never held while later segments run backward, and its
  // backward holds one stage's recompute at a time, for one more forward of all its stages but
  // the last.
  bool nested = false;
};

// Every stage stored (no checkpointing), or every `every` stages one recomputed segment.
std::vector<ChainSegment> store_all(int64_t stages);
std::vector<ChainSegment> recompute_every(int64_t stages, int64_t every);

// Per stage: whether the segments recompute it.
std::vector<bool> recomputed(const std::vector<ChainSegment>& segments);

// A UNet's stages in forward order (down0..down<depth>, up0..up<depth-1>, out), run with the
// stages flagged in `recompute` checkpointed (empty: none). The skip connections stay as they
// are: each stage's output is kept, its insides are recomputed.
std::vector<std::string> unet_stage_names(const models::UNetImpl& unet);
torch::Tensor unet_forward(const std::shared_ptr<models::UNetImpl>& unet, const torch::Tensor& x,
                           const std::vector<bool>& recompute);

// Runs the chain with the plan's segments (recomputed ones through checkpoint()).
torch::Tensor run_chain(const std::vector<Stage>& stages, const std::vector<ChainSegment>& segments,
                        torch::Tensor x);

// A whole network as something to checkpoint: a chain of stages, or a UNet's stages around its
// skips. What trainers and benchmarks hold, whatever the model.
struct ChainNetwork {
  std::shared_ptr<torch::nn::Module> module;  // owns the parameters
  std::vector<Stage> stages;                  // a chain ...
  std::shared_ptr<models::UNetImpl> unet;     // ... or a UNet
  int64_t stage_count() const;
  // plan::plan_chain's limit on stages per recomputed segment: 1 for a UNet (not a chain), else
  // none.
  int64_t max_segment_stages() const { return unet ? 1 : 0; }
  // The network's output with `segments` recomputed (store_all: plain forward).
  torch::Tensor forward(const torch::Tensor& x, const std::vector<ChainSegment>& segments) const;
  // Each stage's cost on input x (measure_stages, or measured along a UNet's plain forward), on
  // `tracker`, the tracker of x's device.
  std::vector<StageCost> measure(const torch::Tensor& x, memory::Tracker& tracker) const;
};
ChainNetwork chain_network(const std::shared_ptr<models::NetworkImpl>& network);
ChainNetwork chain_network(const std::shared_ptr<models::VideoResNetImpl>& video);
ChainNetwork chain_network(const std::shared_ptr<models::ResNetImpl>& resnet);
ChainNetwork chain_network(const std::shared_ptr<models::UNetImpl>& unet);
// Any module as one stage (a TorchScript network): it can be recomputed only as a whole.
ChainNetwork chain_network(const std::shared_ptr<torch::nn::Module>& module,
                           std::function<torch::Tensor(const torch::Tensor&)> forward);

}  // namespace framefit::engine
