#include "framefit/engine/step.h"

#include <torch/torch.h>

#include <chrono>

#include "replay.h"

namespace framefit::engine {

std::shared_ptr<torch::optim::Optimizer> make_optimizer(
    const std::vector<torch::Tensor>& parameters, const OptimizerOptions& options) {
  TORCH_CHECK(options.lr > 0, "learning rate must be > 0; got ", options.lr);
  TORCH_CHECK(options.weight_decay >= 0, "weight decay must be >= 0; got ", options.weight_decay);
  for (const auto& p : parameters) {
    TORCH_CHECK(p.requires_grad(),
                "a frozen parameter (requires_grad = false) was handed to the "
                "optimizer: pass only trained parameters");
  }
  if (options.kind == "sgd") {
    return std::make_shared<torch::optim::SGD>(parameters, torch::optim::SGDOptions(options.lr)
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
// A sum is finite unless an element is not (or the sum overflows, which finite gradients of
// training that has not diverged do not): one pass and no gradient-sized temporary.
bool finite_gradients(const std::vector<torch::Tensor>& parameters) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> sums;
  for (const auto& p : parameters) {
    if (p.grad().defined()) sums.push_back(p.grad().sum().to(torch::kFloat64));
  }
  return sums.empty() || torch::isfinite(torch::stack(sums).sum()).item<bool>();
}
}  // namespace

AppliedGradients apply_gradients(
    const std::vector<torch::Tensor>& parameters, LossScaler& scaler,
    torch::optim::Optimizer& optimizer, double clip_grad_norm,
    const std::function<void(const std::vector<torch::Tensor>&)>& on_gradients_ready) {
  if (on_gradients_ready) on_gradients_ready(parameters);
  AppliedGradients applied;
  if (!scaler.enabled() && !finite_gradients(parameters)) {
    applied.not_finite_skipped = true;
    return applied;
  }
  const bool finite = scaler.unscale(parameters);
  if (finite && clip_grad_norm > 0) {
    applied.grad_norm = torch::nn::utils::clip_grad_norm_(parameters, clip_grad_norm);
  }
  if (scaler.update()) {
    optimizer.step();
    applied.optimizer_stepped = true;
  } else {
    applied.overflow_skipped = true;
  }
  return applied;
}

// Without a planner: half the effective chunk (a chunk of 0 or of at least the longest video is
// one pass over all frames), nothing kept, down to one frame per chunk.
std::optional<RetrySettings> halve_chunk(const OutOfMemoryEvent& event) {
  const int64_t effective =
      event.chunk == 0 ? event.longest_video : std::min(event.chunk, event.longest_video);
  if (effective <= 1 && event.keep == 0 && !event.cache_frozen) return std::nullopt;
  RetrySettings retry;
  retry.chunk = std::max<int64_t>(1, effective / 2);
  retry.keep = 0;
  return retry;
}

TrainingStep::TrainingStep(FrameEncoder encoder, std::shared_ptr<models::TemporalHead> head,
                           std::shared_ptr<torch::optim::Optimizer> optimizer, StepOptions options,
                           memory::Tracker& tracker,
                           std::shared_ptr<torch::nn::LinearImpl> tool_head)
    : encoder_(std::move(encoder)),
      head_(std::move(head)),
      tool_head_(std::move(tool_head)),
      optimizer_(std::move(optimizer)),
      options_(std::move(options)),
      tracker_(tracker),
      scaler_(scaler_options_for(options_.scaler, options_.precision)) {
  TORCH_CHECK(head_ != nullptr && optimizer_ != nullptr,
              "TrainingStep needs a head and an optimizer");
  TORCH_CHECK(tracker_.device().type() == options_.chunked.device.type(), "TrainingStep on ",
              options_.chunked.device, " needs that device's tracker, not ", tracker_.device(),
              "'s");
  options_.chunked.tracker = &tracker_;
  TORCH_CHECK(options_.accumulate >= 1, "accumulate must be >= 1 step; got ", options_.accumulate);
  TORCH_CHECK(options_.clip_grad_norm >= 0, "clip_grad_norm must be >= 0; got ",
              options_.clip_grad_norm);
  parameters_ = encoder_.parameters;
  buffers_ = encoder_.buffers;
  for (const auto& p : head_->parameters()) {
    if (p.requires_grad()) parameters_.push_back(p);
  }
  for (const auto& b : head_->buffers()) buffers_.push_back(b);
  if (tool_head_) {
    TORCH_CHECK(options_.tool_weight >= 0, "tool_weight must be >= 0; got ", options_.tool_weight);
    for (const auto& p : tool_head_->parameters()) {
      if (p.requires_grad()) parameters_.push_back(p);
    }
  }
}

void TrainingStep::accumulate_gradients(const std::vector<Video>& videos, StepReport& report) {
  auto& tracker = tracker_;
  // Each video's loss is scaled so that the summed gradients are the mean over every video of
  // the accumulated steps; one video's graph at a time is alive.
  const double share = 1.0 / (static_cast<double>(videos.size()) * options_.accumulate);
  for (const auto& video : videos) {
    torch::Tensor features;
    if (video.features.defined()) {
      features = video.features.to(options_.chunked.device);
    } else {
      // Mixed precision where the compute is: the encoder. The head (LSTM/TCN over [T,D]) is
      // cheap and runs in float32, which LibTorch 1.13's CPU LSTM needs anyway.
      AutocastGuard autocast(options_.chunked.device, options_.precision);
      features = chunked_encode(encoder_, video.frames, options_.chunked);
    }
    if (options_.return_features) report.features.push_back(features.detach().cpu());
    torch::Tensor loss;
    {
      auto phase = tracker.phase("head");
      loss = phase_loss(head_->forward(features), video.labels, options_.loss);
      if (tool_head_) {
        // In float32 as the phase head: the features of mixed precision are bf16/fp16.
        const auto input =
            features.scalar_type() == torch::kFloat64 ? features : features.to(torch::kFloat32);
        loss = loss + options_.tool_weight * tool_loss(tool_head_->forward(input), video.tools,
                                                       options_.tool_positive_weight);
      }
    }
    report.loss += loss.item<double>() / static_cast<double>(videos.size());
    report.frames += video.labels.size(0);
    scaler_.scale(loss * share).backward();
  }
}

StepReport TrainingStep::step(const std::vector<Video>& videos) {
  TORCH_CHECK(!videos.empty(), "a training step needs at least one video");
  for (const auto& video : videos) {
    const std::string what = video.name.empty() ? "video" : video.name;
    if (video.features.defined()) {
      TORCH_CHECK(encoder_.parameters.empty(), what,
                  ": features stand in for frames only for an encoder without trained "
                  "parameters; this one trains");
      TORCH_CHECK(video.features.dim() == 2, what, ": features must be [T,D], got ",
                  video.features.sizes());
    } else {
      check_video_frames(video.frames, what);
    }
    const int64_t frames = video.features.defined() ? video.features.size(0) : video.frames.size(0);
    TORCH_CHECK(video.labels.dim() == 1 && video.labels.size(0) == frames, what, ": ", frames,
                " frames but ", video.labels.numel(), " labels: there must be one label per frame");
    if (tool_head_) {
      TORCH_CHECK(
          video.tools.defined(), what,
          ": the step trains a tool head but the video has no tool presence (Video::tools)");
      TORCH_CHECK(video.tools.dim() == 2 && video.tools.size(0) == frames &&
                      video.tools.size(1) == tool_head_->options.out_features(),
                  what, ": tool presence must be [", frames, ",",
                  tool_head_->options.out_features(), "] (frames x tools), got ",
                  video.tools.sizes());
    }
  }
  const auto start = std::chrono::steady_clock::now();
  auto& tracker = tracker_;
  tracker.clear_phase_stats();
  auto window = tracker.mark();
  StepReport report;
  // Undoes a failed attempt (out of memory); the first call's, a step whose loss is not finite.
  const auto call_start = std::make_shared<detail::StepStart>(buffers_, options_.chunked.device);
  if (pending_ == 0) {
    optimizer_->zero_grad();
    first_call_start_ = call_start;
  }

  // Gradients accumulated by earlier calls must survive a failed attempt; without accumulation
  // there are none to keep.
  std::vector<torch::Tensor> kept_grads;
  while (true) {
    if (pending_ > 0 && options_.retry_on_out_of_memory && kept_grads.empty()) {
      for (const auto& p : parameters_) {
        kept_grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
      }
    }
    try {
      accumulate_gradients(videos, report);
      break;
    } catch (const c10::Error& e) {
      if (!options_.retry_on_out_of_memory || !memory::is_out_of_memory(e)) throw;
      // Undo the partial step: the graph is gone with the exception; restore the gradients,
      // the statistics its layers updated and the random numbers it drew.
      call_start->restore();
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < parameters_.size(); ++i) {
        auto& grad = parameters_[i].mutable_grad();
        if (!kept_grads.empty() && kept_grads[i].defined()) {
          grad.copy_(kept_grads[i]);
        } else if (grad.defined()) {
          grad.zero_();
        }
      }
      report.loss = 0;
      report.frames = 0;
      report.features.clear();
      auto& chunked = options_.chunked;
      OutOfMemoryEvent event;
      event.chunk = chunked.chunk;
      event.keep = chunked.keep;
      event.cache_frozen = chunked.cache_frozen;
      event.longest_video =
          std::max_element(videos.begin(), videos.end(), [](const auto& a, const auto& b) {
            return a.labels.size(0) < b.labels.size(0);
          })->labels.size(0);
      event.in_use_bytes = tracker.current_bytes();
      event.budget_bytes = tracker.budget_bytes();
      if (const auto* oom = dynamic_cast<const memory::OutOfMemoryError*>(&e)) {
        event.requested_bytes = oom->requested_bytes();
        event.in_use_bytes = oom->in_use_bytes();
        event.phase = oom->phase();
      }
      const auto retry = replan ? replan(event) : halve_chunk(event);
      if (!retry) throw;
      report.replans.push_back(
          c10::str("out of memory", event.phase.empty() ? "" : " in " + event.phase, " with chunk ",
                   event.chunk == 0 ? "0 (naive)" : std::to_string(event.chunk), ", keep ",
                   event.keep, " (", memory::format_bytes(event.in_use_bytes), " in use",
                   event.requested_bytes > 0
                       ? ", " + memory::format_bytes(event.requested_bytes) + " requested"
                       : "",
                   "); retrying the step with chunk ", retry->chunk, ", keep ", retry->keep,
                   retry->cache_frozen ? ", frozen outputs cached" : "",
                   retry->reason.empty() ? "" : ": " + retry->reason));
      chunked.chunk = retry->chunk;
      chunked.keep = retry->keep;
      chunked.cache_frozen = retry->cache_frozen;
      tracker.release_cache();
    }
  }
  ++pending_;
  report.chunk = options_.chunked.chunk;

  if (pending_ >= options_.accumulate) {
    pending_ = 0;
    const auto applied = apply_gradients(parameters_, scaler_, *optimizer_, options_.clip_grad_norm,
                                         on_gradients_ready);
    report.optimizer_stepped = applied.optimizer_stepped;
    report.overflow_skipped = applied.overflow_skipped;
    report.not_finite_skipped = applied.not_finite_skipped;
    report.grad_norm = applied.grad_norm;
    if (applied.not_finite_skipped || applied.overflow_skipped) {
      optimizer_->zero_grad();
      first_call_start_->restore_buffers();
    }
    first_call_start_.reset();
  }
  window.close();
  report.peak_bytes = window.peak_bytes();
  report.phases = tracker.phase_stats();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace framefit::engine
