#include "framefit/engine/batch_step.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <tuple>

#include "framefit/engine/step.h"
#include "framefit/memory/tracker.h"
#include "replay.h"

namespace framefit::engine {

namespace {

// The recomputed segments (begin, end, nested): plans with the same ones run the same, however
// their stored stages are grouped.
std::vector<std::tuple<int64_t, int64_t, bool>> recomputed_segments(
    const std::vector<ChainSegment>& segments) {
  std::vector<std::tuple<int64_t, int64_t, bool>> result;
  for (const auto& s : segments) {
    if (s.recompute) result.emplace_back(s.begin, s.end, s.nested);
  }
  return result;
}

}  // namespace

BatchTrainingStep::BatchTrainingStep(ChainNetwork network,
                                     std::shared_ptr<torch::optim::Optimizer> optimizer,
                                     BatchStepOptions options, memory::Tracker& tracker)
    : network_(std::move(network)),
      optimizer_(std::move(optimizer)),
      options_(std::move(options)),
      tracker_(tracker),
      scaler_(scaler_options_for(options_.scaler, options_.precision)) {
  TORCH_CHECK(network_.module, "BatchTrainingStep needs a network");
  TORCH_CHECK(tracker_.device().type() == options_.device.type(), "BatchTrainingStep on ",
              options_.device, " needs that device's tracker, not ", tracker_.device(), "'s");
  TORCH_CHECK(options_.micro_batches >= 1, "micro_batches must be at least 1, got ",
              options_.micro_batches);
  if (options_.segments.empty()) options_.segments = store_all(network_.stage_count());
  for (const auto& p : network_.module->parameters()) {
    if (p.requires_grad()) parameters_.push_back(p);
  }
  buffers_ = network_.module->buffers();
  if (options_.class_weights.defined()) {
    TORCH_CHECK(options_.class_weights.dim() == 1 && options_.class_weights.size(0) >= 2,
                "class_weights must be [C], one weight per class, got ",
                options_.class_weights.sizes());
    TORCH_CHECK(options_.class_weights.min().item<double>() >= 0 &&
                    options_.class_weights.sum().item<double>() > 0,
                "class_weights must be non-negative and not all zero");
    weights_ = options_.class_weights.to(options_.device);
  }
}

torch::Tensor BatchTrainingStep::counted_labels(const torch::Tensor& labels) const {
  const auto flat = labels.flatten().cpu();
  return options_.ignore_label >= 0 ? flat.masked_select(flat.ne(options_.ignore_label)) : flat;
}

double BatchTrainingStep::accumulate_gradients(const torch::Tensor& samples,
                                               const torch::Tensor& labels) {
  const int64_t batch = samples.size(0);
  const int64_t parts = std::min(options_.micro_batches, batch);
  // Each micro-batch's summed loss is divided by the whole batch's label count (or weight), so
  // the micro-batches' gradients add up to those of the batch's mean.
  const auto counted = counted_labels(labels);
  double denominator =
      weights_.defined()
          ? weights_.cpu().to(torch::kDouble).index_select(0, counted).sum().item<double>()
          : static_cast<double>(counted.numel());
  if (denominator == 0) denominator = 1;  // nothing counted: every summed loss is 0
  double loss_sum = 0;
  int64_t begin = 0;
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t count = batch / parts + (part < batch % parts ? 1 : 0);
    const auto piece = samples.narrow(0, begin, count);
    const auto x = options_.to_input ? options_.to_input(piece) : piece.to(options_.device);
    const auto y = labels.narrow(0, begin, count).to(options_.device);
    begin += count;
    torch::Tensor loss;
    {
      AutocastGuard autocast(options_.device, options_.precision);
      const auto logits = network_.forward(x, options_.segments);
      // Reduced-precision logits go to float32 for the loss; float64 stays (exactness tests).
      const auto scores =
          logits.scalar_type() == torch::kDouble ? logits : logits.to(torch::kFloat32);
      auto loss_options = torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum);
      if (weights_.defined()) loss_options.weight(weights_.to(scores.options()));
      if (options_.ignore_label >= 0) loss_options.ignore_index(options_.ignore_label);
      loss_options.label_smoothing(options_.label_smoothing);
      loss = torch::nn::functional::cross_entropy(scores, y, loss_options) / denominator;
    }
    scaler_.scale(loss).backward();
    loss_sum += loss.item<double>();
  }
  return loss_sum;
}

BatchStepReport BatchTrainingStep::step(const torch::Tensor& samples, const torch::Tensor& labels) {
  TORCH_CHECK(samples.dim() >= 2 && samples.size(0) >= 1,
              "a batch step needs samples [B,...] with B >= 1, got ", samples.sizes());
  TORCH_CHECK(labels.scalar_type() == torch::kLong && labels.size(0) == samples.size(0),
              "a batch step needs int64 labels with one entry per sample: ", samples.size(0),
              " samples, labels ", labels.sizes(), " ", labels.scalar_type());
  const auto counted = counted_labels(labels);
  if (weights_.defined() && counted.numel() > 0) {
    const auto [low, high] = torch::aminmax(counted);
    TORCH_CHECK(low.item<int64_t>() >= 0 && high.item<int64_t>() < weights_.size(0),
                "a batch step with ", weights_.size(0), " class weights got labels from ",
                low.item<int64_t>(), " to ", high.item<int64_t>());
  }
  const auto start = std::chrono::steady_clock::now();
  auto& tracker = tracker_;
  auto window = tracker.mark();
  BatchStepReport report;
  report.samples = samples.size(0);
  optimizer_->zero_grad();
  // Undoes a failed attempt (out of memory) or a step whose loss is not finite.
  const detail::StepStart start_state(buffers_, options_.device);
  while (true) {
    try {
      report.loss = accumulate_gradients(samples, labels);
      break;
    } catch (const c10::Error& e) {
      if (!options_.retry_on_out_of_memory || !memory::is_out_of_memory(e)) throw;
      // The partial step's gradients, statistics and random draws; its graph went with the error.
      optimizer_->zero_grad();
      start_state.restore();
      const bool given = !options_.fallback_segments.empty();
      const auto fallback =
          given ? options_.fallback_segments : recompute_every(network_.stage_count(), 1);
      std::string change;
      if (recomputed_segments(options_.segments) != recomputed_segments(fallback) &&
          network_.stage_count() > 1) {
        options_.segments = fallback;
        change = given ? "the checkpointing plan that holds the least" : "every stage recomputed";
      } else if (options_.micro_batches < samples.size(0)) {
        options_.micro_batches = std::min<int64_t>(2 * options_.micro_batches, samples.size(0));
        change = c10::str("the batch of ", samples.size(0), " split into ", options_.micro_batches,
                          " micro-batches");
      } else {
        throw;  // one sample at a time with everything recomputed does not fit
      }
      report.replans.push_back(c10::str("out of memory (",
                                        memory::format_bytes(tracker.current_bytes()),
                                        " in use); retrying the step with ", change));
      tracker.release_cache();
    }
  }
  const auto applied = apply_gradients(parameters_, scaler_, *optimizer_, options_.clip_grad_norm,
                                       on_gradients_ready);
  report.optimizer_stepped = applied.optimizer_stepped;
  report.overflow_skipped = applied.overflow_skipped;
  report.not_finite_skipped = applied.not_finite_skipped;
  if (applied.not_finite_skipped || applied.overflow_skipped) {
    optimizer_->zero_grad();
    start_state.restore_buffers();
  }
  window.close();
  report.peak_bytes = window.peak_bytes();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace framefit::engine
