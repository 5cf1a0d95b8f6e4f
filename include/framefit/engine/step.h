#pragma once
// One training step over whole videos: chunked encoder, temporal head, per-frame loss,
// backward (recomputing the encoder chunk by chunk), loss scaling, clipping, optimizer.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framefit/core/video.h"
#include "framefit/engine/amp.h"
#include "framefit/engine/chunked.h"
#include "framefit/engine/loss.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/heads.h"

namespace framefit::engine {

namespace detail {
class StepStart;
}

struct OptimizerOptions {
  std::string kind = "adamw";  // sgd | adam | adamw
  double lr = 1e-4;
  double weight_decay = 1e-4;
  double momentum = 0.9;  // sgd
};
std::shared_ptr<torch::optim::Optimizer> make_optimizer(
    const std::vector<torch::Tensor>& parameters, const OptimizerOptions& options);

// The end of every training step, once the gradients are complete: `on_gradients_ready` (where
// data-parallel training will all-reduce), unscaling with an inf/NaN check, clipping (clip > 0),
// the scaler's update, and the optimizer step unless the gradients overflowed (fp16) or, without
// loss scaling, are not finite: a NaN or infinite loss (diverging training) does not reach the
// weights. Deciding on the synchronised gradients, every rank decides alike.
struct AppliedGradients {
  bool optimizer_stepped = false;
  bool overflow_skipped = false;    // fp16: the scaler backs off
  bool not_finite_skipped = false;  // fp32, bf16
  // Either way the caller puts back what the step changed (BatchNorm statistics).
  double grad_norm = 0;             // before clipping, when clipping is on
};
AppliedGradients apply_gradients(
    const std::vector<torch::Tensor>& parameters, LossScaler& scaler,
    torch::optim::Optimizer& optimizer, double clip_grad_norm,
    const std::function<void(const std::vector<torch::Tensor>&)>& on_gradients_ready = {});

struct StepOptions {
  ChunkedOptions chunked;  // chunk size, keep-k, frozen-stage caching, device, dtype
  Precision precision = Precision::FP32;
  // Gradients of this many step() calls are summed before the optimizer runs.
  int64_t accumulate = 1;
  double clip_grad_norm = 0;  // 0: no clipping
  PhaseLossOptions loss;
  LossScalerOptions scaler;  // used with Precision::FP16 only
  // On out-of-memory (budget or CUDA) the step's partial work is undone, the chunk halved and the
  // same step retried, down to 1 frame per chunk; off: the error propagates.
  bool retry_on_out_of_memory = true;
  // StepReport::features gets each video's encoder output (CPU, detached): with an encoder
  // without trained parameters, what later steps may take as Video::features.
  bool return_features = false;
  // With a tool head: the loss adds tool_weight x tool_loss on each video's tool presence.
  double tool_weight = 1.0;
  torch::Tensor tool_positive_weight;  // [K], optional: tool_loss's positive_weight
};

// What a step was doing when it ran out of memory.
struct OutOfMemoryEvent {
  int64_t chunk = 0;
  int64_t keep = 0;
  bool cache_frozen = false;
  int64_t longest_video = 0;    // frames
  int64_t requested_bytes = 0;  // the allocation that failed; 0 when the error does not say
  int64_t in_use_bytes = 0;     // when it failed
  int64_t budget_bytes = 0;     // 0: no framefit budget (a real device ran out)
  std::string phase;            // encode, head, recompute, or "" (elsewhere)
};
// Settings to retry the same step with after out-of-memory.
struct RetrySettings {
  int64_t chunk = 0;
  int64_t keep = 0;
  bool cache_frozen = false;
  std::string reason;  // logged in StepReport::replans
};
// nullopt gives up: the error propagates.
using Replanner = std::function<std::optional<RetrySettings>(const OutOfMemoryEvent&)>;
// The fallback: half the chunk that ran out (the video's length when naive), nothing kept;
// nullopt at one frame with nothing kept or cached.
std::optional<RetrySettings> halve_chunk(const OutOfMemoryEvent& event);

struct StepReport {
  double loss = 0;  // mean over this call's videos
  int64_t frames = 0;
  bool optimizer_stepped = false;  // false while accumulating, when fp16 overflowed, or below
  bool overflow_skipped = false;   // BatchNorm statistics are as before the step then, too
  // Without loss scaling: the gradients (of every call of an accumulated step) were not finite
  // (a NaN or infinite loss): they were dropped, the optimizer did not run, and BatchNorm
  // statistics are as before the step's first call. Diverging training keeps its last good
  // weights so.
  bool not_finite_skipped = false;
  double grad_norm = 0;  // before clipping, when clipping is on
  double seconds = 0;
  int64_t peak_bytes = 0;  // tracked tensor peak during the step (device of the encoder)
  std::map<std::string, memory::PhaseStats> phases;  // encode, head, recompute
  std::vector<std::string> replans;  // what was changed to make the step fit, if anything
  int64_t chunk = 0;                 // the chunk the step finished with
  std::vector<torch::Tensor> features;  // per video, with StepOptions::return_features
};

class TrainingStep {
 public:
  // `tracker`: the tracker of options.chunked.device, which measures each step (its peak, its
  // phases, the budget an out-of-memory retry plans for) and outlives the step.
  // `tool_head` (optional) maps each frame's features to tool logits [T,K], trained on
  // Video::tools alongside the phases (multi-task, as EndoNet and TeCNO's feature training).
  TrainingStep(FrameEncoder encoder, std::shared_ptr<models::TemporalHead> head,
               std::shared_ptr<torch::optim::Optimizer> optimizer, StepOptions options,
               memory::Tracker& tracker,
               std::shared_ptr<torch::nn::LinearImpl> tool_head = nullptr);

  // Videos of different lengths are processed one after another; their gradients are averaged.
  StepReport step(const std::vector<Video>& videos);

  // Called with every trained parameter once this step's gradients are complete, before
  // unscaling, clipping and the optimizer: where data-parallel training will all-reduce.
  std::function<void(const std::vector<torch::Tensor>&)> on_gradients_ready;

  // Chooses new settings after out-of-memory (plan::make_replanner does it from the memory
  // model). Unset: the chunk is halved and nothing kept.
  Replanner replan;

  const std::vector<torch::Tensor>& parameters() const { return parameters_; }
  LossScaler& scaler() { return scaler_; }
  const StepOptions& options() const { return options_; }

 private:
  FrameEncoder encoder_;
  std::shared_ptr<models::TemporalHead> head_;
  std::shared_ptr<torch::nn::LinearImpl> tool_head_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  StepOptions options_;
  memory::Tracker& tracker_;
  LossScaler scaler_;
  std::vector<torch::Tensor> parameters_;  // encoder's, head's, tool head's
  std::vector<torch::Tensor> buffers_;     // their BatchNorm statistics
  int64_t pending_ = 0;                    // step() calls accumulated so far
  std::shared_ptr<detail::StepStart> first_call_start_;  // of the accumulated step

  // Forward and backward of every video; gradients accumulate into .grad.
  void accumulate_gradients(const std::vector<Video>& videos, StepReport& report);
};

}  // namespace framefit::engine
