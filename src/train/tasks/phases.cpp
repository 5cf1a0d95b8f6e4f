// The phases task: per-frame phase recognition on whole, long videos, trained end to end
// through the planner-chosen chunked step (engine/step.h), one or more videos per optimizer
// step. Its plan (plan_phases), its doctor (diagnose_phases) and its run (PhasesRun).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "../phase_model.h"
#include "../run_files.h"
#include "../run_loop.h"
#include "framefit/data/media.h"
#include "framefit/engine/step.h"
#include "framefit/models/norm_relu_conv.h"
#include "framefit/models/torchscript.h"
#include "framefit/plan/calibration.h"
#include "framefit/plan/planner.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"
#include "framefit/train/timeline.h"
#include "framefit/train/trainer.h"
#include "task_kinds.h"

namespace framefit::train {

using namespace detail;

namespace {

// A split's videos as training reads them (augmented); a split without any is an error saying
// why.
data::VideoDataset videos_to_train_on(const Config& config, const std::string& split,
                                      const EventCallback& on_event) {
  auto videos = make_dataset(config, split, true, on_event);
  TORCH_CHECK(videos.size() > 0, no_videos_in_split(config, split));
  return videos;
}

// The share of the step budget a phases plan leaves free for what the memory model does not see.
constexpr double kStepMargin = 0.1;

// The step a phases run trains with: planned for the longest training video (and the largest
// frame) within train.budget less the prefetch reserve, unless chunk, keep and precision are all
// fixed, by the config or by `fixed` (a resumed run's settings).
struct StepPlan {
  plan::PlanRequest request;
  plan::StaticSizes sizes;  // planned only, as are the costs
  std::map<engine::Precision, plan::ChunkCosts> costs;
  plan::Plan chosen;
  bool planned = false;
  // train.budget as the run spends it: the step's budget and the prefetch reserve for the
  // training split's largest video.
  TrainingBudget resolved;
  // A resumed run under a changed budget: the prediction for the checkpoint's settings, and
  // whether they were replaced because they do not fit it.
  std::optional<plan::Plan> resumed;
  bool replanned = false;
};

// The step `train` runs for the longest training video, and the budget it is planned in:
// `resolved` (resolve_budget's: train.budget, else the device's available memory, less on the
// CPU the runtime's share) with its step budget for the largest training video.
StepPlan step_request(const Config& config, const data::VideoDataset& train_set,
                      const TrainingBudget& resolved) {
  const auto& tc = config.train;
  const torch::Device device(config.device);
  StepPlan result;
  int64_t longest = 0, shortest = std::numeric_limits<int64_t>::max(), largest_bytes = 0;
  for (int64_t i = 0; i < train_set.size(); ++i) {
    longest = std::max(longest, train_set.frames(i));
    shortest = std::min(shortest, train_set.frames(i));
    largest_bytes = std::max(largest_bytes, train_set.frame_bytes(i));
  }
  result.resolved = for_largest_unit(config, resolved, largest_bytes);
  auto& request = result.request;
  request.model = model_spec(config, frame_size_for_planning(train_set), device);
  request.frames = longest;
  request.shorter_videos = shortest < longest;
  // A step takes train.accumulate videos, or every one where there are fewer.
  request.videos = std::max<int64_t>(1, std::min<int64_t>(tc.accumulate, train_set.size()));
  request.accumulate = 1;
  request.chunk = tc.chunk;
  request.keep = tc.keep;
  request.precisions = tc.precision ? std::vector<engine::Precision>{*tc.precision}
                                    : plan::candidate_precisions(device);
  for (const auto precision : request.precisions) engine::check_runs_on(precision, device);
  return result;
}

// A resumed run (`fixed`) keeps the checkpoint's settings, so that it goes on as the
// uninterrupted run would have; with `check_fixed` (its budget changed) they are checked against
// the new budget and, where they do not fit, chunk, keep and caching are planned again as the
// config leaves them, the precision held (the loss scaler's state and the numbers stay its).
// `tracker`: config.device's, which the budget is resolved and the calibration measured on.
StepPlan plan_step(const Config& config, const data::VideoDataset& train_set,
                   memory::Tracker& tracker, const std::optional<plan::StepSettings>& fixed,
                   const std::function<void(const std::string&)>& info, bool check_fixed = false) {
  const torch::Device device(config.device);
  StepPlan result = step_request(config, train_set, resolve_budget(config, tracker));
  auto& request = result.request;
  if (reads_features(config)) {
    // Only the head runs, in float32, on whole videos: nothing to choose or calibrate.
    request.model.size = 0;  // no frames
    result.chosen.fits = true;
    auto& settings = result.chosen.settings;
    settings.frames = settings.chunk = request.frames;
    settings.keep = 0;
    settings.precision = engine::Precision::FP32;
    return result;
  }
  // model.recompute_norm auto: the checkpoint's choice, else the planner's (below).
  const bool auto_norm = !config.model.recompute_norm.has_value();
  if (fixed) {
    request.chunk = fixed->chunk;
    request.keep = fixed->keep;
    request.cache_frozen = fixed->cache_frozen;
    request.precisions = {fixed->precision};
    if (auto_norm) request.model.recompute_norm = fixed->recompute_norm;
  }
  // With chunk, keep and precision all fixed there is nothing to choose: no calibration, and an
  // out-of-memory step falls back to halving the chunk. Otherwise the planner decides.
  result.planned =
      !request.chunk || !request.keep || request.precisions.size() > 1 || (fixed && check_fixed);
  auto& chosen = result.chosen;
  if (!result.planned) {
    chosen.fits = true;
    chosen.settings.frames = request.frames;
    chosen.settings.shorter_videos = request.shorter_videos;
    chosen.settings.chunk = *request.chunk;
    chosen.settings.keep = *request.keep;
    chosen.settings.cache_frozen = request.cache_frozen.value_or(false);
    chosen.settings.precision = request.precisions.front();
    chosen.settings.recompute_norm = request.model.recompute_norm;
    return result;
  }
  // A TorchScript encoder is sized and calibrated on a copy loaded again from its file (probes
  // move BatchNorm statistics); its costs are not cached, as the file may change under its name.
  std::shared_ptr<models::TorchScriptEncoderImpl> probe_script;
  int64_t script_features = 0;
  if (is_script_encoder(config)) {
    probe_script = load_script_encoder(config, device);
    script_features = script_feature_dim(*probe_script, config, device);
  }
  const bool choose_norm = auto_norm && !fixed && !probe_script;
  result.sizes = probe_script ? plan::static_sizes(request.model, *probe_script, script_features)
                              : plan::static_sizes(request.model);
  result.sizes.library_bytes = tracker.library_bytes();
  if (probe_script) {
    for (const auto precision : request.precisions) {
      info("calibrating the TorchScript encoder at " + engine::to_string(precision) +
           " (probe runs)");
      result.costs[precision] = plan::calibrate(request.model, script_frame_encoder(probe_script),
                                                script_features, precision, tracker);
    }
    chosen = plan::fit(request, result.sizes, result.costs, result.resolved.step, kStepMargin);
  } else {
    plan::CalibrationCache cache(plan::CalibrationCache::default_path());
    const plan::Calibrator calibrator{cache, tracker, info};
    result.costs = plan::calibrated_costs(request.model, request.precisions, calibrator);
    // request.model.recompute_norm and the costs (the replanner's) become those chosen.
    chosen = plan::plan_chunked_step(request, result.sizes, result.costs, calibrator,
                                     result.resolved.step, kStepMargin, choose_norm);
  }
  if (!chosen.reason.empty()) info(chosen.reason);
  if (fixed && check_fixed) {
    result.resumed = chosen;
    const auto& tc = config.train;
    auto again = request;
    again.chunk = tc.chunk;
    again.keep = tc.keep;
    again.cache_frozen.reset();
    if (!chosen.fits) {
      const auto replanned =
          plan::fit(again, result.sizes, result.costs, result.resolved.step, kStepMargin);
      if (replanned.fits) {
        chosen = replanned;
        result.replanned = true;
      }
      // Where nothing fits, the checkpoint's settings stay (as they ran before): a step that
      // runs out of memory is re-planned.
      chosen.fits = true;
    }
    // The out-of-memory replanner may change what the config leaves as auto.
    request = again;
  }
  return result;
}

}  // namespace

PhasePlan plan_phases(const Config& config, memory::Tracker& tracker,
                      const EventCallback& on_event) {
  TORCH_CHECK(!is_batch_task(config), "plan_phases is for task phases; task ", config.task,
              " is planned by plan_batch_task");
  warn_if_budget_beyond_device(config, tracker, on_event);
  const auto train_set = videos_to_train_on(config, config.data.train_split, on_event);
  const auto step =
      plan_step(config, train_set, tracker, std::nullopt, [&](const std::string& message) {
        if (on_event) on_event(Event::note(Event::Kind::Info, message));
      });
  PhasePlan result;
  result.planned = step.planned;
  result.fits = step.chosen.fits;
  result.settings = step.chosen.settings;
  result.breakdown = step.chosen.breakdown;
  result.advice = step.chosen.advice;
  result.videos = train_set.size();
  result.longest_frames = step.request.frames;
  result.frame_size = step.request.model.size;
  result.budget = step.resolved;
  return result;
}

std::vector<plan::Finding> diagnose_phases(const Config& config, const TrainingBudget& budget,
                                           std::string* summary) {
  TORCH_CHECK(!is_batch_task(config), "diagnose_phases is for task phases; task ", config.task,
              " is checked by diagnose_batch_task");
  auto findings = diagnose_label_settings(config);
  const auto error = [&](const std::string& problem, const std::string& fix) {
    add_error_once(findings, problem, fix);
  };
  // Every split probed as training probes it, but each bad video reported instead of the first.
  auto probing = config;
  probing.data.on_error = "skip";
  std::optional<data::VideoDataset> train_set;
  for (const auto& split : distinct_splits(config)) {
    try {
      auto set = make_dataset(
          probing, split, split == config.data.train_split,
          skipped_as_errors(findings,
                            "fix or replace the file, or set data.on_error: skip to train "
                            "without it"));
      if (split == config.data.train_split) train_set.emplace(std::move(set));
    } catch (const c10::Error& e) {
      error(e.what_without_backtrace(), "fix the config or the manifest");
    }
  }
  if (!train_set || train_set->size() == 0) {
    if (train_set) {
      error(no_videos_in_split(config, config.data.train_split),
            "set data.train_split to a split of the manifest, or list training videos in it");
    }
    return findings;
  }
  if (reads_features(config)) {
    if (summary) {
      *summary = c10::str(train_set->size(), " training videos of precomputed features (",
                          train_set->feature_dim(), " per frame); the head trains on them alone");
    }
    return findings;
  }
  const auto step = step_request(config, *train_set, budget);
  const auto more = plan::diagnose(step.request, step.resolved.step);
  findings.insert(findings.end(), more.begin(), more.end());
  if (summary) {
    const int64_t size = step.request.model.size;
    *summary =
        c10::str(train_set->size(), " training videos, the longest ", step.request.frames,
                 " sampled frames at ", size, "x", size, "; step budget ",
                 memory::format_bytes(step.resolved.step), " (", describe_budget(step.resolved),
                 step.resolved.covers_process() ? " and " : " less ",
                 "the prefetch reserve); `framefit plan --config` chooses the settings");
  }
  return findings;
}

namespace {

// One phases run: its videos, the step planned for the longest, the model, its optimizer and
// step, and the feature caches of an encoder that trains nothing.
class PhasesRun final : public TaskRun {
 public:
  PhasesRun(const Config& given, const RunStart& start, memory::Tracker& tracker,
            const EventCallback& on_event);

  const Config& config() const override { return config_; }
  RunPosition& position() override { return progress_; }
  TrainingBudget budget() const override { return budget_; }
  int64_t steps_per_epoch() const override {
    return (train_set_.size() + config_.train.accumulate - 1) / config_.train.accumulate;
  }
  int64_t samples_per_step() const override {
    return std::min<int64_t>(config_.train.accumulate, train_set_.size());
  }
  EpochSteps start_epoch() override;
  void write(const RunPosition& at, torch::serialize::OutputArchive& archive) override {
    write_model(archive, model_);
    write_progress(archive, at_position(progress_, at));
  }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  const engine::LossScaler& scaler() override { return step_->scaler(); }
  bool validates() const override { return val_set_.has_value(); }
  PhaseMetrics validate() override {
    model_.precision = progress_.settings.precision;  // validate as `framefit eval` will
    if (model_.device.is_cpu() && model_.precision == engine::Precision::FP16)
      model_.precision = engine::Precision::FP32;
    return evaluate_with(model_, *val_set_, {}, nullptr, {},
                         val_feature_cache_ ? &*val_feature_cache_ : nullptr, budget_.prefetch);
  }
  RunNames names() const override {
    return {model_.classes.names(), config_.data.tools, "frames", progress_.settings.precision};
  }
  int64_t skipped() const override { return progress_.skipped + train_set_.skipped(); }

 private:
  void emit(Event e) const {
    if (on_event_) on_event_(e);
  }
  void info(const std::string& message) const { emit(Event::note(Event::Kind::Info, message)); }
  // Loss options from the config: class weights over the training frames (and tool weights).
  void weigh_classes(engine::StepOptions& options) const;

  Config config_;  // model.feature_dim comes from the data where it is 0
  EventCallback on_event_;
  data::VideoDataset train_set_;
  std::optional<data::VideoDataset> val_set_;
  TrainingBudget budget_;
  Model model_;
  Progress progress_;
  std::optional<FeatureCache> feature_cache_, val_feature_cache_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<engine::TrainingStep> step_;
};

PhasesRun::PhasesRun(const Config& given, const RunStart& start, memory::Tracker& tracker,
                     const EventCallback& on_event)
    : config_(given),
      on_event_(on_event),
      train_set_(videos_to_train_on(given, given.data.train_split, on_event)) {
  const auto& tc = config_.train;
  const torch::Device device(config_.device);
  if (tc.validate) {
    auto candidate = make_dataset(config_, config_.data.val_split, false, on_event);
    if (candidate.size() > 0) val_set_.emplace(std::move(candidate));
  }
  warn_unused_splits(config_, on_event);
  if (reads_features(config_)) {
    const int64_t dim = train_set_.feature_dim();
    TORCH_CHECK(config_.model.feature_dim == 0 || config_.model.feature_dim == dim,
                "model.feature_dim is ", config_.model.feature_dim,
                " but the training split's features files have ", dim, " features per frame");
    TORCH_CHECK(
        !val_set_ || val_set_->feature_dim() == dim, "the validation split's features files have ",
        val_set_ ? val_set_->feature_dim() : 0, " features per frame, the training split's ", dim,
        ": both must come from the same encoder");
    config_.model.feature_dim = dim;
  }
  info("data: " + std::to_string(train_set_.size()) + " training videos (" +
       std::to_string(train_set_.total_frames()) + " frames)" +
       (val_set_ ? ", " + std::to_string(val_set_->size()) + " validation videos" : std::string()) +
       (train_set_.skipped() ? ", " + std::to_string(train_set_.skipped()) + " skipped"
                             : std::string()));

  write_config(config_, start.out_dir);

  // A resumed run continues with the checkpoint's settings (the plan it was trained with, and
  // any re-planning after out-of-memory), so its steps are those of the uninterrupted run.
  std::optional<Progress> saved;
  if (start.resumed()) {
    saved = read_video_progress(*start.archive, start.resume_from);
    warn_config_changes(*start.stored, config_, saved->best_score, on_event);
    info("resuming from " + start.resume_from + " at step " + std::to_string(saved->step));
  }
  const std::string budget_changed = start.resumed() ? budget_change(*start.stored, config_) : "";
  const auto step_plan = plan_step(
      config_, train_set_, tracker,
      saved ? std::optional<plan::StepSettings>(saved->settings) : std::nullopt,
      [this](const std::string& message) { info(message); }, !budget_changed.empty());
  const auto& chosen = step_plan.chosen;
  const bool planned = step_plan.planned;
  const int64_t step_budget = step_plan.resolved.step;
  budget_ = step_plan.resolved;
  TORCH_CHECK(chosen.fits, "training does not fit in ", describe_budget(step_plan.resolved), ": ",
              chosen.advice);

  // Built after calibration, which seeds the global generator for its probes: the model's
  // initialisation and the generator state training starts from must not depend on whether
  // the calibration was cached.
  model_ = build_model(config_);
  if (saved) progress_ = *saved;
  progress_.settings = chosen.settings;
  progress_.settings.frames = step_plan.request.frames;
  models::set_recompute_norm(model_.encoder_module(), progress_.settings.recompute_norm);
  if (step_plan.resumed) {
    const auto& kept = *step_plan.resumed;
    const std::string change = budget_changed + ": the checkpoint's " +
                               plan::describe(kept.settings) + " is predicted to need " +
                               memory::format_bytes(kept.breakdown.peak_bytes);
    const std::string limit = memory::format_bytes(kept.budget_bytes - kept.margin_bytes) +
                              " planned for (step budget " + memory::format_bytes(step_budget) +
                              c10::str(" less a ", std::lround(100 * kStepMargin), "% margin)");
    if (step_plan.replanned) {
      emit(Event::note(
          Event::Kind::Warning,
          change + ", more than the " + limit + "; re-planned to " +
              plan::describe(progress_.settings) + " (predicted " +
              memory::format_bytes(chosen.breakdown.peak_bytes) +
              "): from here the run may differ from the uninterrupted one by rounding" +
              (config_.model.norm == "bn" ? " and BatchNorm's statistics per chunk" : "")));
    } else if (kept.fits) {
      info(change + ", within the " + limit + "; kept, so the run goes on as it would have");
    } else {
      emit(Event::note(Event::Kind::Warning,
                       change + "; nothing fits the " + limit + " (" + kept.advice +
                           "): kept (a step that runs out of memory is re-planned)"));
    }
  }
  if (planned && !step_plan.resumed) {
    info("plan: " + plan::describe(progress_.settings) + ", predicted peak " +
         memory::format_bytes(chosen.breakdown.peak_bytes) + " of " +
         memory::format_bytes(step_budget) +
         describe_step_budget(step_plan.resolved, chosen.breakdown.peak_bytes));
  } else if (reads_features(config_)) {
    info(c10::str("settings: the head alone on precomputed features (", model_.feature_dim,
                  " per frame), float32, whole videos"));
  } else {
    info("settings: " + plan::describe(progress_.settings) +
         (!saved                ? " (fixed by the config; not planned)"
          : step_plan.replanned ? " (re-planned for the new budget)"
                                : " (from the checkpoint)"));
  }

  const auto slow = engine::slow_precision_reason(progress_.settings.precision, device);
  if (!slow.empty()) emit(Event::note(Event::Kind::Warning, slow));

  engine::StepOptions options;
  options.chunked.chunk = progress_.settings.chunk;
  options.chunked.keep = progress_.settings.keep;
  options.chunked.cache_frozen = progress_.settings.cache_frozen;
  options.chunked.device = device;
  options.chunked.channels_last = channels_last_input(config_, device);
  options.precision = progress_.settings.precision;
  options.clip_grad_norm = tc.clip_grad_norm;
  options.loss.smoothing = tc.smoothing;
  options.loss.label_smoothing = tc.label_smoothing;
  if (tc.class_weights) weigh_classes(options);
  auto encoder = model_.frame_encoder();
  if (encoder.parameters.empty() && tc.cache_features && !reads_features(config_)) {
    if (config_.data.augment) {
      info(
          "the encoder trains nothing: with data.augment false its features would be computed "
          "once and the head trained on them in later epochs");
    } else {
      const auto fingerprint = feature_fingerprint(config_, progress_.settings.precision,
                                                   {&train_set_, val_set_ ? &*val_set_ : nullptr});
      feature_cache_.emplace(start.out_dir + "/feature_cache", fingerprint);
      if (val_set_) {
        val_feature_cache_.emplace(start.out_dir + "/feature_cache/validation", fingerprint);
      }
      options.return_features = true;
      info("the encoder trains nothing: each video's features are kept in " +
           feature_cache_->folder() + " after its first step (validation: its first " +
           "evaluation), and later epochs run the head on them without decoding the video");
    }
  }
  auto parameters = encoder.parameters;
  for (auto& p : model_.head->parameters()) parameters.push_back(p);
  if (model_.tools) {
    for (auto& p : model_.tools->parameters()) parameters.push_back(p);
    options.tool_weight = tc.tool_weight;
  }
  optimizer_ = engine::make_optimizer(parameters, optimizer_options(tc));
  step_.emplace(encoder, model_.head, optimizer_, options, tracker,
                model_.tools ? model_.tools.ptr() : nullptr);
  if (planned) {
    step_->replan = plan::make_replanner(step_plan.request, step_plan.sizes,
                                         step_plan.costs.at(progress_.settings.precision),
                                         progress_.settings.precision, step_budget, kStepMargin);
  }

  if (start.resumed()) {
    const std::string built_from = "the config this run resumes with";
    auto& archive = *start.archive;
    load_module(model_.encoder_module(), archive, "encoder", start.resume_from, built_from);
    load_module(*model_.head, archive, "head", start.resume_from, built_from);
    read_tool_head(archive, model_, start.resume_from, built_from);
    model_.encoder_module().to(device);
    model_.head->to(device);
    read_resume_state(archive, *optimizer_, step_->scaler(), device);
  }
}

void PhasesRun::weigh_classes(engine::StepOptions& options) const {
  const torch::Device device(config_.device);
  auto counts = torch::zeros({model_.classes.size()}, torch::kDouble);
  for (int64_t i = 0; i < train_set_.size(); ++i) {
    counts += torch::bincount(train_set_.labels(i), {}, model_.classes.size()).to(torch::kDouble);
  }
  const auto weights = engine::inverse_frequency_weights(counts);
  info("class weights (inverse frequency over the training frames): " +
       describe_class_weights(weights, model_.classes.names()));
  options.loss.class_weights = weights.to(device);
  if (!model_.tools) return;
  const auto k = model_.tools->options.out_features();
  auto present = torch::zeros({k}, torch::kDouble), annotated = torch::zeros({k}, torch::kDouble);
  for (int64_t i = 0; i < train_set_.size(); ++i) {
    const auto tools = train_set_.tools(i).to(torch::kDouble);
    present += tools.clamp_min(0).sum(0);
    annotated += tools.ge(0).sum(0).to(torch::kDouble);
  }
  const auto positive = engine::tool_positive_weights(present, annotated);
  info("tool weights of present frames (absent over present annotated training frames): " +
       describe_class_weights(positive, config_.data.tools));
  options.tool_positive_weight = positive.to(device);
}

EpochSteps PhasesRun::start_epoch() {
  struct Epoch {
    std::vector<int64_t> order;
    std::optional<data::Prefetcher> prefetcher;
    std::vector<Video> batch;           // the next step's videos
    std::vector<int64_t> batch_videos;  // their indices in train_set_
  };
  const auto& tc = config_.train;
  const int64_t videos = train_set_.size();
  auto epoch = std::make_shared<Epoch>();
  epoch->order = data::epoch_order(videos, tc.seed, progress_.epoch, true);
  std::vector<data::Prefetcher::Job> jobs;
  int64_t from_cache = 0;
  for (int64_t k = progress_.position; k < videos; ++k) {
    const int64_t v = epoch->order[k];
    const auto augmentation = train_set_.augmentation(v, tc.seed, progress_.epoch);
    auto load = [this, v, augmentation] { return train_set_.load(v, augmentation); };
    if (feature_cache_) {
      from_cache += feature_cache_->has(v);
      jobs.push_back(feature_cache_->job(train_set_, v, load, model_.feature_dim));
    } else {
      jobs.push_back({load, train_set_.frame_bytes(v)});
    }
  }
  if (from_cache > 0) {
    info(c10::str("epoch ", progress_.epoch + 1, ": ", from_cache, " of ", jobs.size(),
                  " videos' features from the feature cache"));
  }
  epoch->prefetcher.emplace(std::move(jobs), static_cast<int>(config_.data.workers),
                            budget_.prefetch);
  EpochSteps steps;
  steps.done = [this, videos] { return progress_.position >= videos; };
  steps.fetch = [this, epoch, videos] {
    while (static_cast<int64_t>(epoch->batch.size()) < config_.train.accumulate &&
           progress_.position < videos) {
      const int64_t v = epoch->order[progress_.position];
      ++progress_.position;
      try {
        epoch->batch.push_back(epoch->prefetcher->next());
        epoch->batch_videos.push_back(v);
      } catch (const c10::Error& e) {
        if (!data::skips_error(train_set_.options().skip_bad, e)) throw;
        ++progress_.skipped;
        emit(Event::note(Event::Kind::Warning,
                         std::string("skipping a video: ") + e.what_without_backtrace()));
      }
    }
    return !epoch->batch.empty();
  };
  steps.step = [this, epoch](double lr) {
    // Taken out of the epoch, so that they are let go when the step ends.
    const auto batch = std::move(epoch->batch);
    const auto batch_videos = std::move(epoch->batch_videos);
    epoch->batch.clear();
    epoch->batch_videos.clear();
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    model_.encoder_module().train();  // validation and prediction leave it in eval mode
    model_.head->train();
    if (model_.tools) model_.tools->train();
    const auto report = step_->step(batch);
    if (feature_cache_) {
      for (size_t i = 0; i < batch.size(); ++i) {
        if (!batch[i].features.defined())
          feature_cache_->write(batch_videos[i], report.features[i]);
      }
    }
    // A step that ran out of memory was retried with new settings: later steps and
    // checkpoints (so a resumed run) use them.
    progress_.settings.chunk = step_->options().chunked.chunk;
    progress_.settings.keep = step_->options().chunked.keep;
    progress_.settings.cache_frozen = step_->options().chunked.cache_frozen;
    for (const auto& r : report.replans) emit(Event::note(Event::Kind::Warning, r));
    return StepOutcome{report.loss,       report.frames,
                       "frames",          report.seconds,
                       report.peak_bytes, report.overflow_skipped || report.not_finite_skipped,
                       report.phases};
  };
  steps.release = [epoch] { epoch->prefetcher.reset(); };
  return steps;
}

// 10 s of a video's sampled frames, from their times: 10 at Cholec80's usual 1 fps.
int64_t ten_seconds_of_frames(const std::vector<double>& seconds, const std::string& name) {
  const auto n = seconds.size();
  const double span = n > 1 ? seconds.back() - seconds.front() : 0;
  TORCH_CHECK(span > 0, "video ", name,
              ": relaxed boundaries are 10 s long, and its frames' times are unknown (a features "
              "file needs its rows' rate in the manifest's fps column)");
  return std::llround(10 * static_cast<double>(n - 1) / span);
}

Evaluation evaluate_phases(const EvaluationRequest& request, const EventCallback& on_event) {
  auto model = load_model(request.checkpoint, request.overrides);
  Evaluation out;
  out.config = model.config;
  out.classes = model.classes;
  out.split = request.split.empty() ? model.config.data.test_split : request.split;
  const auto dataset = make_dataset(model.config, out.split, false, on_event);
  TORCH_CHECK(dataset.size() > 0, no_videos_in_split(model.config, out.split));
  const auto& folder = request.predictions_folder;
  if (!folder.empty()) {
    std::error_code error;
    std::filesystem::create_directories(folder, error);
    TORCH_CHECK(!error, "--predictions ", folder, ": cannot create the folder (", error.message(),
                ")");
  }
  const bool relaxed = !request.relaxed_rules.empty();
  const auto rules = relaxed ? parse_relaxed_rules(request.relaxed_rules) : RelaxedRules::General;
  check_relaxed_rules(rules, model.classes.size());  // before any video is scored
  const auto on_prediction = [&](int64_t i, const Prediction& prediction) {
    const auto& name = dataset.entry(i).name;
    if (relaxed) {
      out.relaxed.push_back(
          relaxed_video_metrics(prediction.labels, dataset.labels(i), model.classes.size(),
                                ten_seconds_of_frames(dataset.source_seconds(i), name), rules));
      out.relaxed.back().name = name;
    }
    if (folder.empty()) return;
    // One file per video, named by the manifest (a name with '/' keeps it within the folder).
    auto file = name;
    std::replace(file.begin(), file.end(), '/', '_');
    const auto path = folder + "/" + file + ".csv";
    std::ofstream csv(path);
    csv << phase_csv(prediction, dataset.source_frames(i), dataset.source_seconds(i), model.classes,
                     model.config.data.tools, dataset.labels(i));
    TORCH_CHECK(csv.good(), "cannot write ", path);
    data::write_image(folder + "/" + file + ".png",
                      timeline_image({dataset.labels(i), prediction.labels}));
  };
  out.metrics = evaluate(model, dataset, on_event, &out.per_video, on_prediction);
  return out;
}

class PhasesTask final : public Task {
 public:
  std::vector<plan::Finding> check_settings(const Config& config) const override {
    return diagnose_label_settings(config);
  }
  std::unique_ptr<TaskRun> start(const Config& config, const RunStart& start,
                                 memory::Tracker& tracker,
                                 const EventCallback& on_event) const override {
    return std::make_unique<PhasesRun>(config, start, tracker, on_event);
  }
  RunPlan plan(const Config& config, memory::Tracker& tracker,
               const EventCallback& on_event) const override {
    return phase_run_plan(config, plan_phases(config, tracker, on_event));
  }
  Diagnosis diagnose(const Config& config, const TrainingBudget& budget) const override {
    Diagnosis out;
    std::string summary;
    out.findings = diagnose_phases(config, budget, &summary);
    if (!summary.empty()) out.summary.push_back(summary);
    return out;
  }
  Evaluation evaluate(const EvaluationRequest& request,
                      const EventCallback& on_event) const override {
    return evaluate_phases(request, on_event);
  }
  ExportedWeights export_weights(const std::string& checkpoint) const override {
    const auto model = load_model(checkpoint, {"device=cpu"});
    return {export_state_dict(model), model.features_input
                                          ? "head.*; the model has no encoder"
                                          : "encoder.* in torchvision names, head.*"};
  }
  DataThroughput read_split(const Config& config, const std::string& split,
                            const EventCallback& on_event) const override {
    const auto dataset = videos_to_train_on(config, split, on_event);
    std::vector<data::Prefetcher::Job> jobs;
    for (int64_t i = 0; i < dataset.size(); ++i) {
      const auto augmentation = dataset.augmentation(i, config.train.seed, 0);
      jobs.push_back({[&dataset, i, augmentation] { return dataset.load(i, augmentation); },
                      dataset.frame_bytes(i)});
    }
    auto out = time_loading(std::move(jobs), config);
    out.unit_name = out.feature_dim > 0 ? "features file" : "video";
    out.sample_name = out.feature_dim > 0 ? "feature row" : "frame";
    return out;
  }
};

}  // namespace

const Task& detail::phases_task() {
  static const PhasesTask task;
  return task;
}

}  // namespace framefit::train
