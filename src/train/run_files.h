#pragma once
// The files of a training run, shared by every task's trainer: atomic checkpoint writes, the
// checkpoint folder (newest, pruning), the random generator's state, and the budget scope.
// Private to src/train; run_loop.h runs the epochs.
#include <torch/serialize.h>
#include <torch/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framefit/engine/amp.h"
#include "framefit/engine/step.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/weights.h"
#include "framefit/plan/doctor.h"
#include "framefit/train/config.h"
#include "framefit/train/events.h"
#include "framefit/train/metrics.h"
#include "framefit/train/task.h"

namespace framefit::models {
class TorchScriptEncoderImpl;
}

namespace framefit::train::detail {

// What a checkpoint records about its run, every field by name: the run's position and the
// task's settings (integers: "chunk", "precision", ...; tensors: layer checkpointing's
// segments). One format for every task, written under the checkpoint's "run" key with
// kRunRecordFormat; a reader meets fields it does not know (a newer framefit's) and lacks ones
// added later, so each setting is read with the value that means "as before it existed".
struct RunRecord {
  RunPosition position;
  std::map<std::string, int64_t> settings;
  std::map<std::string, torch::Tensor> tensors;
  int64_t setting(const std::string& name, int64_t absent) const;
  torch::Tensor tensor(const std::string& name) const;  // undefined where absent
};
constexpr int64_t kRunRecordFormat = 2;  // 1: a positional "progress" tensor, read by its task
void write_run_record(torch::serialize::OutputArchive& archive, const RunRecord& record);
// Format 1's position, which every task wrote alike: step, epoch, position and skipped first in
// the int64 `progress` tensor, best score and seconds in the double `progress_real`.
RunPosition first_format_position(const torch::Tensor& progress, const torch::Tensor& real);
// The record of a checkpoint of format 2 or later, nullopt for format 1. A format newer than
// this framefit reads is an error naming `checkpoint` and what to do.
std::optional<RunRecord> read_run_record(torch::serialize::InputArchive& archive,
                                         const std::string& checkpoint);

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start);

void make_directories(const std::string& path);

// plan::budget_beyond_device's warning for train.budget on the config's device, as a Warning
// event, where there is one.
void warn_if_budget_beyond_device(const Config& config, const memory::Tracker& tracker,
                                  const EventCallback& on_event);

// "train.budget changed from 8 GiB to 2 GiB" where a resumed run's budget is not its
// checkpoint's (which then checks its settings against the new one), "" where it is the same.
std::string budget_change(const Config& stored, const Config& resumed_with);

// Held for a training run's whole life on train.out_dir/.lock: a second framefit train on the
// same folder (both would write its checkpoints, best.pt and log) is refused, naming the
// holder's process. flock: the kernel lets go when the process ends, however it ends, so a
// killed run resumes without a stale lock to remove.
class RunFolderLock {
 public:
  explicit RunFolderLock(const std::string& out_dir);
  ~RunFolderLock();
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

 private:
  int fd_ = -1;
};

// model.weights loaded into `module` (its fc.* left out, model.weights_prefix or the prefix found
// where the keys do not match as they are); errors name the file and the key that can help.
// Non-strict loading reports what did not fit instead of failing.
models::LoadReport load_model_weights(torch::nn::Module& module, const Config& config, bool strict);
// Files in `folder` named prefix*suffix, sorted (step_00000012.pt sorts by step).
std::vector<std::string> list_files(const std::string& folder, const std::string& prefix,
                                    const std::string& suffix);
// Written to a temporary file, flushed to disk, then renamed over the target: a crash at any
// point leaves either the old file or the new one, never a partial checkpoint. A failed write
// (a full disk) is an error that says so and that the checkpoints before are kept.
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path);
torch::serialize::InputArchive open_archive(const std::string& path);
// Loads `module` from a checkpoint's archive `key`, checking every tensor's size. Weights that do
// not fit are an error naming the checkpoint and what built the model (`built_from`: "the config
// this run resumes with"), since a changed model.* key is the usual cause: a missing submodule
// used to end in "No such serialized submodule: 'head.stages'" and nothing more, and a tensor of
// another size was taken as it was stored.
void load_module(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                 const std::string& key, const std::string& checkpoint,
                 const std::string& built_from);
// A checkpoint's stored config with the --set `overrides` of eval, predict, export or extract:
// data and run settings may change, the trained model may not. `task` or a model.* key that changes
// what the network computes is an error naming it (a BatchNorm model loaded as GroupNorm found
// weights of the same shapes and ran); model.layout and model.lean_backward choose how it runs,
// model.weights, model.weights_prefix and model.freeze only matter to training. A device this
// machine does not have (a model trained on CUDA, read without a GPU) is an error with the fix.
Config config_with_overrides(const Config& stored, const std::string& checkpoint,
                             const std::vector<std::string>& overrides);
// "its stored config", or with --set overrides, "its stored config with --set a=1 --set b=2".
std::string stored_config_with(const std::vector<std::string>& overrides);
// The config stored in a checkpoint (which must be a framefit checkpoint).
Config read_config(torch::serialize::InputArchive& archive, const std::string& path);
// The checkpoint a run resumes from, opened before the run reads its data (nullopt for a fresh
// run, `checkpoint` ""), with the config it stored. A checkpoint of another task (a phases run
// resumed from a segmentation checkpoint) is an error saying so, instead of a missing tensor's
// name.
struct ResumedRun {
  torch::serialize::InputArchive archive;
  Config stored;
};
std::optional<ResumedRun> open_resumed(const std::string& checkpoint, const Config& resumed_with);
// A run's folder, made ready before the run reads its data: train.out_dir and its checkpoints/
// created, locked against a second run for as long as this lives, and the checkpoint `resume`
// names ("" for a fresh run, "auto" or a path; resume_path) opened.
struct RunFolder {
  RunFolder(const Config& config, const std::string& resume);
  std::string out_dir;
  RunFolderLock lock;
  std::string resume_from;  // "" for a fresh run
  std::optional<ResumedRun> resumed;
};
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
// The config's training, validation and test splits, each once (they may name one split).
std::vector<std::string> distinct_splits(const Config& config);
// For the doctor's data probes: adds an error to `findings` unless one says the same (a bad
// manifest fails every split alike: said once).
void add_error_once(std::vector<plan::Finding>& findings, const std::string& problem,
                    const std::string& fix);
// The event callback of a probe under data.on_error skip: each "skipping NAME: why" warning
// becomes an error "NAME: why" with `fix`, added once; other events are dropped.
EventCallback skipped_as_errors(std::vector<plan::Finding>& findings, const std::string& fix);

// Keeps the newest `keep` step checkpoints.
void prune_checkpoints(const std::string& folder, int64_t keep);
// The checkpoint a run resumes from: "" (a fresh run: out_dir must hold no checkpoints), "auto"
// (the newest in checkpoint_dir) or a path.
std::string resume_path(const std::string& resume, const std::string& out_dir,
                        const std::string& checkpoint_dir);
// Writes config.yaml into out_dir.
void write_config(const Config& config, const std::string& out_dir);

// checkpoint_dir/step_00000012.pt
std::string step_checkpoint_path(const std::string& checkpoint_dir, int64_t step);
// What resuming needs besides the model: the optimizer's state, the loss scaler's and the
// random generators' (the CPU's, and on CUDA the device's).
void write_resume_state(torch::serialize::OutputArchive& archive,
                        torch::optim::Optimizer& optimizer, const engine::LossScaler& scaler,
                        torch::Device device);
void read_resume_state(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer,
                       engine::LossScaler& scaler, torch::Device device);

engine::OptimizerOptions optimizer_options(const TrainConfig& train);

// train.class_weights for the log: "name weight, ..." in class order.
std::string describe_class_weights(const torch::Tensor& weights,
                                   const std::vector<std::string>& names);

}  // namespace framefit::train::detail
