#include "framefit/engine/step.h"

#include <torch/torch.h>

#include <chrono>

namespace framefit::engine {

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<torch::Tensor>& parameters,
                                                        const OptimizerOptions& options) {
  TORCH_CHECK(options.lr > 0, "learning rate must be > 0; got ", options.lr);
  TORCH_CHECK(options.weight_decay >= 0, "weight decay must be >= 0; got ", options.weight_decay);
  for (const auto& p : parameters) {
    TORCH_CHECK(p.requires_grad(), "a frozen parameter (requires_grad = false) was handed to the "
                "optimizer: pass only trained parameters");
  }
  if (options.kind == "sgd") {
    return std::make_shared<torch::optim::SGD>(
        parameters, torch::optim::SGDOptions(options.lr)
                        .momentum(options.momentum)
                        .weight_decay(options.weight_decay));
  }
  if (options.kind == "adam") {
    return std::make_shared<torch::optim::Adam>(
        parameters, torch::optim::AdamOptions(options.lr).weight_decay(options.weight_decay));
  }
  if (options.kind == "adamw") {
    return std::make_shared<torch::optim::AdamW>(
        parameters, torch::optim::AdamWOptions(options.lr).weight_decay(options.weight_decay));
  }
  TORCH_CHECK(false, "unknown optimizer '", options.kind, "': use sgd, adam or adamw");
}

namespace {
LossScalerOptions scaler_options(const StepOptions& options) {
  auto scaler = options.scaler;
  scaler.enabled = scaler.enabled && options.precision == Precision::FP16;
  return scaler;
}
}  // namespace

TrainingStep::TrainingStep(FrameEncoder encoder, std::shared_ptr<models::TemporalHead> head,
                           std::shared_ptr<torch::optim::Optimizer> optimizer, StepOptions options)
    : encoder_(std::move(encoder)),
      head_(std::move(head)),
      optimizer_(std::move(optimizer)),
      options_(std::move(options)),
      scaler_(scaler_options(options_)) {
  TORCH_CHECK(head_ != nullptr && optimizer_ != nullptr, "TrainingStep needs a head and an optimizer");
  TORCH_CHECK(options_.accumulate >= 1, "accumulate must be >= 1 step; got ", options_.accumulate);
  TORCH_CHECK(options_.clip_grad_norm >= 0, "clip_grad_norm must be >= 0; got ",
              options_.clip_grad_norm);
  parameters_ = encoder_.parameters;
  for (const auto& p : head_->parameters()) {
    if (p.requires_grad()) parameters_.push_back(p);
  }
}

StepReport TrainingStep::step(const std::vector<Video>& videos) {
  TORCH_CHECK(!videos.empty(), "a training step needs at least one video");
  const auto start = std::chrono::steady_clock::now();
  auto& tracker = memory::Tracker::of(options_.chunked.device);
  tracker.clear_phase_stats();
  auto window = tracker.mark();
  StepReport report;
  if (pending_ == 0) optimizer_->zero_grad();

  // Each video's loss is scaled so that the summed gradients are the mean over every video of
  // the accumulated steps; one video's graph at a time is alive.
  const double share = 1.0 / (static_cast<double>(videos.size()) * options_.accumulate);
  for (const auto& video : videos) {
    const std::string what = video.name.empty() ? "video" : video.name;
    check_video_frames(video.frames, what);
    TORCH_CHECK(video.labels.dim() == 1 && video.labels.size(0) == video.frames.size(0), what,
                ": ", video.frames.size(0), " frames but ", video.labels.numel(),
                " labels: there must be one label per frame");
    torch::Tensor features;
    {
      // Mixed precision where the compute is: the encoder. The head (LSTM/TCN over [T,D]) is
      // cheap and runs in float32, which LibTorch 1.13's CPU LSTM needs anyway.
      AutocastGuard autocast(options_.chunked.device, options_.precision);
      features = chunked_encode(encoder_, video.frames, options_.chunked);
    }
    torch::Tensor loss;
    {
      auto phase = tracker.phase("head");
      loss = phase_loss(head_->forward(features), video.labels, options_.loss);
    }
    report.loss += loss.item<double>() / static_cast<double>(videos.size());
    report.frames += video.frames.size(0);
    scaler_.scale(loss * share).backward();
  }
  ++pending_;

  if (pending_ >= options_.accumulate) {
    pending_ = 0;
    if (on_gradients_ready) on_gradients_ready(parameters_);
    const bool finite = scaler_.unscale(parameters_);
    if (finite && options_.clip_grad_norm > 0) {
      report.grad_norm = torch::nn::utils::clip_grad_norm_(parameters_, options_.clip_grad_norm);
    }
    if (scaler_.update()) {
      optimizer_->step();
      report.optimizer_stepped = true;
    } else {
      report.overflow_skipped = true;
    }
  }
  window.close();
  report.peak_bytes = window.peak_bytes();
  report.phases = tracker.phase_stats();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace framefit::engine
