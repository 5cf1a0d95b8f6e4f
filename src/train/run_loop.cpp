#include "run_loop.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <thread>

#include "framefit/core/errors.h"
#include "framefit/memory/monitor.h"
#include "framefit/memory/tracker.h"
#include "run_files.h"

namespace framefit::train::detail {
namespace {

// One epoch's steps so far: their mean loss, and how the loop's time split between getting
// data and running steps.
struct EpochTotals {
  double loss_sum = 0;
  int64_t steps = 0;  // with a finite loss
  double data_seconds = 0, step_seconds = 0;
  double data_fraction() const {
    const double total = data_seconds + step_seconds;
    return total > 0 ? data_seconds / total : 0;
  }
};

// The log of steps and epochs; on resume, records after the checkpoint are dropped first, so
// the log reads as if the run had never stopped.
class JsonlLog {
 public:
  JsonlLog(const std::string& path, int64_t resume_step, bool resuming) : path_(path) {
    std::vector<std::string> kept;
    if (resuming) {
      std::ifstream in(path);
      std::string line;
      while (std::getline(in, line)) {
        const auto record = nlohmann::json::parse(line, nullptr, false);
        if (record.is_discarded() || record.value("step", int64_t{0}) > resume_step) continue;
        kept.push_back(line);
        if (record.value("best", false) && record.contains("val")) best_validation_ = record["val"];
      }
    }
    out_.open(path, std::ios::trunc);
    TORCH_CHECK(out_.good(), "cannot write the training log ", path);
    for (const auto& line : kept) out_ << line << '\n';
    out_.flush();
  }
  void write(const nlohmann::json& record) {
    out_ << record.dump() << '\n';
    out_.flush();
    TORCH_CHECK(out_.good(), "cannot write the training log ", path_,
                " (is the disk full?). Checkpoints written before are kept: make room and resume "
                "with --resume auto");
  }
  // A resumed run's: the validation metrics of the last epoch before it marked best; null if none.
  const nlohmann::json& best_validation() const { return best_validation_; }

 private:
  std::string path_;
  nlohmann::json best_validation_;
  std::ofstream out_;
};

// Whether `stop` asks the run to end after `step`; if so, marks the result and tells on_event.
bool stop_requested(const StopRequest& stop, int64_t step, TrainResult& result,
                    const EventCallback& on_event) {
  if (!stop || !stop()) return false;
  result.stopped = true;
  if (on_event)
    on_event(Event::note(Event::Kind::Info, c10::str("stopping at step ", step, " as requested")));
  return true;
}

// Whether a run that ends here writes its last weights as best.pt: a finished run (not stopped)
// without a validation split has nothing to choose the best by, and one where no validation has
// chosen a best yet (`best_score` < 0: train.max_steps ended it within its first epoch, resumed
// or not) would leave no best.pt for eval and export, or a stale one; told through on_event.
bool last_weights_are_best(bool validation_split, double best_score, const TrainResult& result,
                           const EventCallback& on_event) {
  if (result.stopped) return false;
  if (!validation_split) return true;
  if (best_score >= 0) return false;
  if (on_event) {
    on_event(Event::note(Event::Kind::Info, "the run ended before a validation chose a best: " +
                                                result.best_checkpoint +
                                                " holds the last weights"));
  }
  return true;
}

// Fills the Step event `e` (rate, ETA from `seconds_per_step`, memory now), writes the step's
// log record (`data_seconds`: getting its data, before it ran) and adds the step to its epoch's
// totals.
// `tracker`: the device's, whose held and pipeline bytes the record names.
void report_step(Event& e, const StepOutcome& step, double lr, double data_seconds,
                 double seconds_per_step, const memory::Tracker& tracker, JsonlLog& log,
                 EpochTotals& epoch) {
  if (std::isfinite(step.loss)) {  // a skipped step (LossWatch) does not make the mean NaN
    epoch.loss_sum += step.loss;
    ++epoch.steps;
  }
  epoch.data_seconds += data_seconds;
  epoch.step_seconds += step.seconds;
  e.data_seconds = data_seconds;
  e.loss = step.loss;
  e.lr = lr;
  e.frames_per_second = step.count / std::max(1e-9, step.seconds);
  e.eta_seconds = seconds_per_step * static_cast<double>(e.total_steps - e.step);
  e.peak_bytes = step.peak_bytes;
  const auto process = memory::process_memory();
  e.rss_bytes = process.rss_bytes;
  log.write({{"type", "step"},
             {"step", e.step},
             {"epoch", e.epoch},
             {"loss", e.loss},
             {"lr", e.lr},
             {step.counted, step.count},
             {"seconds", step.seconds},
             {"data_seconds", data_seconds},
             {"peak_bytes", step.peak_bytes},
             {"rss_bytes", e.rss_bytes},
             // Since the run's first step: the highest resident memory, within steps included.
             {"rss_peak_bytes", process.rss_peak_bytes},
             {"held_bytes", tracker.reserved_bytes()},
             {"pipeline_bytes", tracker.pipeline_bytes()},
             {"skipped_optimizer_step", step.update_skipped}});
}

// The end of an epoch: the Epoch event `e` gets the epoch's mean loss and data time and, where
// `validate` is given, the validation metrics; metrics that beat `best_score` in `best_by` become
// the run's best (`save_best` writes them). Emits the event and writes the epoch's log record.
struct EpochValidation {
  std::function<PhaseMetrics()> validate;  // empty: the run has no validation split
  std::string best_by;                     // metric_value's name
  std::function<void()> save_best;
  std::vector<std::string> tool_names;  // data.tools: names the tool metrics in the log
};
// `stale_epochs` counts the validated epochs since the best one.
void end_epoch(Event e, const EpochTotals& totals, const EpochValidation& validation,
               const std::vector<std::string>& class_names, double& best_score,
               int64_t& stale_epochs, TrainResult& result, const EventCallback& emit,
               JsonlLog& log) {
  e.loss = totals.steps ? totals.loss_sum / static_cast<double>(totals.steps) : 0;
  e.data_seconds = totals.data_seconds;
  e.data_fraction = totals.data_fraction();
  nlohmann::json record = {{"type", "epoch"},
                           {"step", e.step},
                           {"epoch", e.epoch},
                           {"loss", e.loss},
                           {"data_seconds", totals.data_seconds},
                           {"step_seconds", totals.step_seconds}};
  if (validation.validate) {
    e.metrics = validation.validate();
    e.validated = true;
    record["val"] = nlohmann::json::parse(to_json(e.metrics, class_names, validation.tool_names));
    const double score = metric_value(e.metrics, validation.best_by);
    ++stale_epochs;
    if (score > best_score) {
      best_score = score;
      stale_epochs = 0;
      e.best = true;
      validation.save_best();
      result.best = e.metrics;
      result.validated = true;
    }
    record["best"] = e.best;
  }
  // Validation included: the run's resident peak so far.
  record["rss_peak_bytes"] = memory::process_memory().rss_peak_bytes;
  emit(e);
  log.write(record);
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

// A fifth of the time or more, and a second at least: an epoch always waits for its first video.
bool data_bound(const EpochTotals& epoch) {
  return epoch.data_seconds >= 1 && epoch.data_fraction() >= 0.2;
}
// Says once per run (`warned`) that getting data took a large share of an epoch's training
// time, and what to change: decoding, not the model, limits the speed.
void warn_if_data_bound(const EpochTotals& epoch, int64_t epoch_number, const Config& config,
                        bool& warned, const EventCallback& emit) {
  if (warned || !data_bound(epoch)) return;
  warned = true;
  const auto& d = config.data;
  std::string text = c10::str(
      "epoch ", epoch_number, ": ", static_cast<int>(100 * epoch.data_fraction() + 0.5),
      "% of the training time went to getting data (", seconds_text(epoch.data_seconds), " of ",
      seconds_text(epoch.data_seconds + epoch.step_seconds),
      "), not to training steps: the input pipeline sets the speed. Try more data.workers (now ",
      d.workers, "; this machine has ", std::max(1u, std::thread::hardware_concurrency()),
      " cores, shared with training)");
  const bool jitter = d.brightness > 0 || d.contrast > 0 || d.saturation > 0 || d.hue > 0;
  if (config.model.encoder == "features") {
    text += "; the features files are read from disk";
  } else if (d.augment && (jitter || d.rotation > 0)) {
    text += "; colour jitter and rotation run in the workers too";
  }
  if (config.task != "segmentation" && config.model.encoder != "features") {
    text +=
        "; a video file is decoded from its start to its last sampled frame, a frame folder "
        "reads only the sampled frames";
  }
  emit(Event::note(Event::Kind::Warning, text));
}

// Diverging training: a step whose loss is not finite (NaN or infinite) leaves the weights as
// they were (the engine drops its gradients) with a warning; kInARow such steps in a row end the
// run with an error naming the checkpoint of the weights before them and what to change.
class LossWatch {
 public:
  static constexpr int64_t kInARow = 3;
  // After each optimizer step: true when the run must end (the caller writes a checkpoint, then
  // calls diverged).
  bool diverging(double loss, int64_t step, const EventCallback& emit);
  [[noreturn]] void diverged(const std::string& checkpoint, const Config& config,
                             const RunLength& run, engine::Precision precision) const;

 private:
  int64_t in_a_row_ = 0;
};

bool LossWatch::diverging(double loss, int64_t step, const EventCallback& emit) {
  if (std::isfinite(loss)) {
    in_a_row_ = 0;
    return false;
  }
  ++in_a_row_;
  if (emit) {
    emit(
        Event::note(Event::Kind::Warning,
                    c10::str("step ", step, ": the loss is ", std::isnan(loss) ? "NaN" : "infinite",
                             ": the update was skipped (the weights and BatchNorm statistics are "
                             "those before the step)")));
  }
  return in_a_row_ >= kInARow;
}

void LossWatch::diverged(const std::string& checkpoint, const Config& config, const RunLength& run,
                         engine::Precision precision) const {
  const auto& tc = config.train;
  TORCH_CHECK(false, "training diverged: the loss was not finite (NaN or infinite) in ", in_a_row_,
              " steps in a row; their updates were skipped. ", checkpoint,
              " holds the weights the last finite step left, which may already be far off: lower "
              "train.lr (now ",
              tc.lr,
              run.schedule.lr != tc.lr ? c10::str(", scaled to ", run.schedule.lr) : std::string(),
              ")", tc.clip_grad_norm > 0 ? "" : ", set train.clip_grad_norm (e.g. 1)",
              precision == engine::Precision::FP16 ? ", train in bf16 or fp32 instead of fp16" : "",
              ", and resume from it or an earlier checkpoint (--resume PATH, --set for the changed "
              "keys), or start again");
}

// Whether train.patience ends the run after this epoch (`stale_epochs` validated epochs without
// a better train.best_by); if so, says why and marks the result.
bool patience_exhausted(const Config& config, int64_t stale_epochs, TrainResult& result,
                        const EventCallback& emit) {
  const int64_t patience = config.train.patience;
  if (patience <= 0 || stale_epochs < patience) return false;
  result.stopped_early = true;
  emit(Event::note(Event::Kind::Info, c10::str("stopping early: validation ", best_metric(config),
                                               " has not improved for ", stale_epochs,
                                               " epochs (train.patience ", patience, ")")));
  return true;
}

}  // namespace

RunLength run_length(const TrainConfig& train, int64_t steps_per_epoch, int64_t samples_per_step) {
  RunLength run;
  const double lr_factor = learning_rate_factor(train, samples_per_step);
  run.lr_note = describe_learning_rate(train, samples_per_step);
  run.steps_per_epoch = std::max<int64_t>(1, steps_per_epoch);
  run.total_steps = train.max_steps > 0 ? train.max_steps : train.epochs * run.steps_per_epoch;
  run.epochs = (run.total_steps + run.steps_per_epoch - 1) / run.steps_per_epoch;
  run.schedule.kind = train.schedule;
  run.schedule.lr = train.lr * lr_factor;
  run.schedule.warmup = train.warmup_steps;
  run.schedule.step_size = train.step_size > 0 ? train.step_size : run.steps_per_epoch;
  run.schedule.gamma = train.gamma;
  run.schedule.min_lr = train.min_lr * lr_factor;
  return run;
}

TrainResult run_epochs(TaskRun& task_run, const RunLength& run, bool resumed,
                       memory::Tracker& tracker, const StopRequest& stop,
                       const EventCallback& on_event) {
  auto emit = [&](Event e) {
    if (on_event) on_event(e);
  };
  const Config& config = task_run.config();
  RunPosition& progress = task_run.position();
  const RunNames names = task_run.names();
  const bool validates = task_run.validates();
  const auto& tc = config.train;
  const torch::Device device(config.device);
  const std::string checkpoint_dir = tc.out_dir + "/checkpoints";
  JsonlLog log(tc.out_dir + "/log.jsonl", progress.step, resumed);
  TrainResult result;
  result.best_checkpoint = tc.out_dir + "/best.pt";
  // A run resumed after its best epoch reports that epoch's metrics (best.pt holds its weights),
  // read from the log where they are the checkpoint's best (train.best_by unchanged).
  if (resumed && validates && progress.best_score >= 0 && !log.best_validation().is_null()) {
    try {
      auto best = metrics_from_json(log.best_validation().dump(), names.classes, names.tools);
      if (metric_value(best, best_metric(config)) == progress.best_score) {
        result.best = std::move(best);
        result.validated = true;
      }
    } catch (const std::exception& e) {  // a hand-edited log: nlohmann's type errors too
      emit(Event::note(Event::Kind::Warning,
                       "the best validation in " + tc.out_dir + "/log.jsonl cannot be read (" +
                           error_text(e) + "): the result reports this run's own"));
    }
  }
  // A stop request ends the run at a step boundary; the checkpoint written below resumes it.
  auto stop_now = [&] { return stop_requested(stop, progress.step, result, on_event); };
  // The steps' resident peak (rss_peak_bytes in the log) leaves out planning and calibration.
  memory::reset_rss_peak();
  const auto start = Clock::now();
  const int64_t first_step = progress.step;
  auto with_time = [&](RunPosition at) {
    at.seconds += seconds_since(start);
    return at;
  };
  int64_t last_saved_step = resumed ? progress.step : -1;
  if (!run.lr_note.empty() && on_event) on_event(Event::note(Event::Kind::Info, run.lr_note));
  auto save = [&](const RunPosition& at, const std::string& path, bool resumable) {
    torch::serialize::OutputArchive archive;
    task_run.write(with_time(at), archive);
    if (resumable) write_resume_state(archive, task_run.optimizer(), task_run.scaler(), device);
    save_atomically(archive, path);
  };
  auto checkpoint = [&](const RunPosition& at) {
    result.last_checkpoint = step_checkpoint_path(checkpoint_dir, at.step);
    save(at, result.last_checkpoint, true);
    prune_checkpoints(checkpoint_dir, tc.keep_last);
    last_saved_step = at.step;
  };
  // best.pt: what eval, predict and export need.
  auto save_best = [&] { save(progress, result.best_checkpoint, false); };
  auto progress_event = [&](Event::Kind kind) {
    Event e;
    e.kind = kind;
    e.step = progress.step;
    e.total_steps = run.total_steps;
    e.epoch = progress.epoch + 1;
    e.epochs = run.epochs;
    e.elapsed_seconds = progress.seconds + seconds_since(start);
    e.rate_unit = names.rate_unit;
    return e;
  };

  bool data_bound_warned = false;
  LossWatch loss_watch;
  memory::LeakDetectorOptions leak_options;
  leak_options.min_growth_bytes = int64_t(1) << 20;
  memory::LeakDetector leaks(leak_options);
  for (; progress.epoch < run.epochs && progress.step < run.total_steps; ++progress.epoch) {
    auto epoch = task_run.start_epoch();
    EpochTotals totals;
    double data_seconds = 0;  // getting the next step's data (skipped units included)
    while (!epoch.done() && progress.step < run.total_steps) {
      const auto asked = Clock::now();
      const bool fetched = epoch.fetch();
      data_seconds += seconds_since(asked);
      if (!fetched) continue;
      const double lr = learning_rate(run.schedule, progress.step, run.total_steps);
      const auto outcome = epoch.step(lr);
      // The step's freed small blocks and the libraries' scratch, back to the system: otherwise
      // resident outside any budget.
      memory::release_free_heap();
      ++progress.step;

      Event e = progress_event(Event::Kind::Step);
      const double per_step =
          seconds_since(start) / static_cast<double>(progress.step - first_step);
      report_step(e, outcome, lr, data_seconds, per_step, tracker, log, totals);
      data_seconds = 0;
      emit(e);
      // After the Step event: a callback that keeps tensors across steps leaks as well.
      if (auto leak =
              leaks.record(tracker.current_bytes() - tracker.pipeline_bytes(), outcome.phases)) {
        emit(Event::note(Event::Kind::Warning, c10::str("step ", progress.step, ": ", *leak)));
      }
      if (loss_watch.diverging(outcome.loss, progress.step, on_event)) {
        checkpoint(progress);
        loss_watch.diverged(result.last_checkpoint, config, run, names.precision);
      }
      // A checkpoint that completes the epoch is written after its validation, below.
      if (tc.checkpoint_every > 0 && progress.step % tc.checkpoint_every == 0 && !epoch.done()) {
        checkpoint(progress);
      }
      // At the epoch's end the stop waits for its validation and checkpoint, below.
      if (!epoch.done() && stop_now()) break;
    }
    if (!epoch.done()) break;  // max_steps reached or stopped mid-epoch
    if (epoch.release) epoch.release();

    EpochValidation validation;
    if (validates) {
      validation.validate = [&] { return task_run.validate(); };
      validation.best_by = best_metric(config);
      validation.save_best = save_best;
      validation.tool_names = names.tools;
    }
    end_epoch(progress_event(Event::Kind::Epoch), totals, validation, names.classes,
              progress.best_score, progress.stale_epochs, result, emit, log);
    warn_if_data_bound(totals, progress.epoch + 1, config, data_bound_warned, on_event);
    progress.position = 0;
    if (tc.checkpoint_every == 0 || progress.step % tc.checkpoint_every == 0) {
      RunPosition next = progress;
      ++next.epoch;
      checkpoint(next);
    }
    if (progress.step < run.total_steps && progress.epoch + 1 < run.epochs &&
        (patience_exhausted(config, progress.stale_epochs, result, emit) || stop_now())) {
      ++progress.epoch;  // a checkpoint written below starts the next epoch
      break;
    }
  }
  if (last_saved_step != progress.step) checkpoint(progress);
  if (last_weights_are_best(validates, progress.best_score, result, emit)) {
    save_best();
  }
  result.steps = progress.step;
  result.seconds = seconds_since(start);
  return result;
}

}  // namespace framefit::train::detail
