#pragma once
// The files of a training run, shared by every task's trainer: atomic checkpoint writes, the
// checkpoint folder (newest, pruning), the JSON-lines log, the random generator's state, and the
// budget scope. Private to src/train.
#include <torch/serialize.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framefit/engine/amp.h"
#include "framefit/engine/step.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/weights.h"
#include "framefit/train/config.h"
#include "framefit/train/metrics.h"
#include "framefit/train/trainer.h"

namespace framefit::models {
class TorchScriptEncoderImpl;
}

namespace framefit::train::detail {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start);

void make_directories(const std::string& path);

// model.weights loaded into `module` (its fc.* left out, model.weights_prefix or the prefix found
// where the keys do not match as they are); errors name the file and the key that can help.
// Non-strict loading reports what did not fit instead of failing.
models::LoadReport load_model_weights(torch::nn::Module& module, const Config& config, bool strict);
// Files in `folder` named prefix*suffix, sorted (step_00000012.pt sorts by step).
std::vector<std::string> list_files(const std::string& folder, const std::string& prefix,
                                    const std::string& suffix);
// Written to a temporary file, flushed to disk, then renamed over the target: a crash at any
// point leaves either the old file or the new one, never a partial checkpoint.
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path);
torch::serialize::InputArchive open_archive(const std::string& path);
// The config stored in a checkpoint (which must be a framefit checkpoint).
Config read_config(torch::serialize::InputArchive& archive, const std::string& path);
// Whether `stop` asks the run to end after `step`; if so, marks the result and tells on_event.
bool stop_requested(const StopRequest& stop, int64_t step, TrainResult& result,
                    const EventCallback& on_event);
// Whether a run that ends here writes its last weights as best.pt: a finished run (not stopped)
// without a validation split has nothing to choose the best by, and one where no validation has
// chosen a best yet (`best_score` < 0: train.max_steps ended it within its first epoch, resumed
// or not) would leave no best.pt for eval and export, or a stale one; told through on_event.
bool last_weights_are_best(bool validation_split, double best_score, const TrainResult& result,
                           const EventCallback& on_event);
// A Warning event naming the keys where the config a run resumes with differs from the one its
// checkpoint stored (the run goes on with the new values: a changed train.lr or train.epochs
// is allowed, but should not pass unnoticed). A changed train.best_by makes the stored best
// score (of the other metric) meaningless: `best_score` is reset, so the next validation is best.
void warn_config_changes(const Config& stored, const Config& resumed_with, double& best_score,
                         const EventCallback& on_event);
// A TorchScript network's module (code and weights) stored in a checkpoint, so that it loads
// without the file it was trained from; read_script gives nullptr when none is stored.
void write_script(torch::serialize::OutputArchive& archive,
                  const models::TorchScriptEncoderImpl& script);
std::shared_ptr<models::TorchScriptEncoderImpl> read_script(torch::serialize::InputArchive& archive,
                                                            const std::string& checkpoint,
                                                            torch::Device device);
// Keeps the newest `keep` step checkpoints.
void prune_checkpoints(const std::string& folder, int64_t keep);
// The checkpoint a run resumes from: "" (a fresh run: out_dir must hold no checkpoints), "auto"
// (the newest in checkpoint_dir) or a path.
std::string resume_path(const std::string& resume, const std::string& out_dir,
                        const std::string& checkpoint_dir);
// A config count that may be "auto" (train.chunk, train.keep, train.batch; the config checked
// the text): nullopt for auto.
std::optional<int64_t> fixed_count(const std::string& text);
// Writes config.yaml into out_dir.
void write_config(const Config& config, const std::string& out_dir);

torch::Tensor generator_state();  // the CPU default generator's
void set_generator_state(const torch::Tensor& state);

// checkpoint_dir/step_00000012.pt
std::string step_checkpoint_path(const std::string& checkpoint_dir, int64_t step);
// What resuming needs besides the model: the optimizer's state, the loss scaler's and the
// random generator's.
void write_resume_state(torch::serialize::OutputArchive& archive,
                        torch::optim::Optimizer& optimizer, const engine::LossScaler& scaler);
void read_resume_state(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer,
                       engine::LossScaler& scaler);

engine::OptimizerOptions optimizer_options(const TrainConfig& train);

// train.class_weights for the log: "name weight, ..." in class order.
std::string describe_class_weights(const torch::Tensor& weights,
                                   const std::vector<std::string>& names);

// A run's length and learning-rate schedule for `steps_per_epoch` optimizer steps per epoch.
struct RunLength {
  int64_t steps_per_epoch = 1;
  int64_t total_steps = 0;  // train.max_steps, else epochs x steps_per_epoch
  int64_t epochs = 0;       // epochs those steps reach into
  Schedule schedule;
};
RunLength run_length(const TrainConfig& train, int64_t steps_per_epoch);

// What one optimizer step did, for its Step event and its log.jsonl record.
struct StepOutcome {
  double loss = 0, lr = 0;
  int64_t count = 0;         // frames or samples the step trained on
  const char* counted = "";  // "frames" | "samples": the log's name for count
  double seconds = 0;
  double data_seconds = 0;  // getting the step's data, before it ran
  int64_t peak_bytes = 0;
  bool update_skipped = false;  // fp16 overflow, or gradients that are not finite
};

// One epoch's steps so far: their mean loss, and how the loop's time split between getting
// data and running steps.
struct EpochTotals {
  double loss_sum = 0;
  int64_t steps = 0;  // with a finite loss
  double data_seconds = 0, step_seconds = 0;
  double data_fraction() const;
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
        if (!record.is_discarded() && record.value("step", int64_t{0}) <= resume_step)
          kept.push_back(line);
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
  }

 private:
  std::string path_;
  std::ofstream out_;
};

// Fills the Step event `e` (rate, ETA from `seconds_per_step`, memory now), writes the step's
// log record and adds the step to its epoch's totals.
void report_step(Event& e, const StepOutcome& step, double seconds_per_step, JsonlLog& log,
                 EpochTotals& epoch);

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
               JsonlLog& log);
// Says once per run (`warned`) that getting data took a large share of an epoch's training
// time, and what to change: decoding, not the model, limits the speed.
void warn_if_data_bound(const EpochTotals& epoch, int64_t epoch_number, const Config& config,
                        bool& warned, const EventCallback& emit);
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
                             engine::Precision precision) const;

 private:
  int64_t in_a_row_ = 0;
};
// Whether train.patience ends the run after this epoch (`stale_epochs` validated epochs without
// a better train.best_by); if so, says why and marks the result.
bool patience_exhausted(const Config& config, int64_t stale_epochs, TrainResult& result,
                        const EventCallback& emit);

// Sets the tracker's budget for the run and lifts it when the run ends, however it ends.
class BudgetScope {
 public:
  BudgetScope(memory::Tracker& tracker, int64_t bytes) : tracker_(tracker) {
    tracker_.set_budget(bytes);
  }
  ~BudgetScope() { tracker_.set_budget(0); }

 private:
  memory::Tracker& tracker_;
};

}  // namespace framefit::train::detail
