#pragma once
// One training step of a batch network (clip classifier, UNet): micro-batches through the
// network with its checkpointed stages, cross-entropy (one label per sample, or per pixel),
// loss scaling, clipping, optimizer. On out-of-memory the step is undone and retried with the
// fallback segments (every stage recomputed unless given), then with the batch split into twice
// as many micro-batches (BatchNorm statistics and random numbers as before the failed attempt).
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "framefit/engine/amp.h"
#include "framefit/engine/checkpoint.h"

namespace framefit::engine {

struct BatchStepOptions {
  torch::Device device = torch::kCPU;
  Precision precision = Precision::FP32;
  std::vector<ChainSegment> segments;  // what to recompute; empty: nothing
  // What a step that ran out of memory is retried with first: a planner's plan that holds the
  // least (with nested segments it holds less than every stage recomputed); empty: every stage
  // recomputed.
  std::vector<ChainSegment> fallback_segments;
  // The batch runs as this many micro-batches whose gradients are summed, weighted by their
  // share of the samples: equal to the whole batch at once unless the network has train-mode
  // BatchNorm (statistics per micro-batch).
  int64_t micro_batches = 1;
  double clip_grad_norm = 0;  // 0: no clipping
  // [C], optional: the loss is the weighted mean over the whole batch (sum of weight x loss over
  // samples or pixels, divided by the sum of their labels' weights), as PyTorch's weighted
  // cross-entropy, whatever the micro-batches.
  torch::Tensor class_weights;
  // Labels equal to this count in neither the loss nor its mean (PyTorch's ignore_index, e.g.
  // the border pixels of a segmentation mask); -1: none. A batch of ignored labels only has a
  // loss of 0.
  int64_t ignore_label = -1;
  // PyTorch's label_smoothing, the loss still the batch's (weighted) mean; 0: off.
  double label_smoothing = 0;
  LossScalerOptions scaler;  // used with Precision::FP16 only
  bool retry_on_out_of_memory = true;
  // Stored samples (uint8 clips or images) to network input on the device, one micro-batch at
  // a time; unset: the samples are the input.
  std::function<torch::Tensor(const torch::Tensor&)> to_input;
};

struct BatchStepReport {
  double loss = 0;  // mean over the batch's samples (or pixels), weighted by class_weights
  int64_t samples = 0;
  bool optimizer_stepped = false;
  bool overflow_skipped = false;  // BatchNorm statistics are as before the step then, too
  // Without loss scaling: the gradients were not finite (a NaN or infinite loss): they were
  // dropped, the optimizer did not run and BatchNorm statistics are as before the step.
  bool not_finite_skipped = false;
  double seconds = 0;
  int64_t peak_bytes = 0;            // tracked tensor peak during the step
  std::vector<std::string> replans;  // what changed to make the step fit
};

class BatchTrainingStep {
 public:
  // `tracker`: the tracker of options.device, which measures each step (its peak, the memory
  // in use when one runs out) and outlives the step.
  BatchTrainingStep(ChainNetwork network, std::shared_ptr<torch::optim::Optimizer> optimizer,
                    BatchStepOptions options, memory::Tracker& tracker);
  // samples [B,...]; labels [B] (one class per sample) or [B,H,W] (per pixel).
  BatchStepReport step(const torch::Tensor& samples, const torch::Tensor& labels);
  // Called with the trained parameters once the gradients are complete, before unscaling,
  // clipping and the optimizer: where data-parallel training will all-reduce.
  std::function<void(const std::vector<torch::Tensor>&)> on_gradients_ready;
  const BatchStepOptions& options() const { return options_; }
  LossScaler& scaler() { return scaler_; }
  const std::vector<torch::Tensor>& parameters() const { return parameters_; }

 private:
  ChainNetwork network_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  BatchStepOptions options_;
  memory::Tracker& tracker_;
  LossScaler scaler_;
  std::vector<torch::Tensor> parameters_;
  std::vector<torch::Tensor> buffers_;  // BatchNorm statistics
  torch::Tensor weights_;               // class_weights on the device
  double accumulate_gradients(const torch::Tensor& samples, const torch::Tensor& labels);
  // The labels the loss counts, flattened on the CPU: all but ignore_label.
  torch::Tensor counted_labels(const torch::Tensor& labels) const;
};

}  // namespace framefit::engine
