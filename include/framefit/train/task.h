#pragma once
// A task is one kind of training job - the phases of long videos, clip classification,
// segmentation - behind one interface, so that one training loop (train(), below) runs every
// task the same way: the learning-rate schedule, each step's event and log record, validation
// and the best weights, checkpoints, stop requests, train.patience and a diverging loss are the
// loop's; the data, the model, the step planned for the budget and what a checkpoint records of
// them are the task's. The loop asks; the task never calls back into it.
//
// A task starts a TaskRun for one run: the run's data read, its step planned (or a resumed
// checkpoint's kept), its model, optimizer and step built. The loop then takes the run's epochs
// one at a time (EpochSteps) and asks it to write its checkpoint record at a position.
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "framefit/data/labels.h"
#include "framefit/engine/amp.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/weights.h"
#include "framefit/plan/doctor.h"
#include "framefit/train/budget.h"
#include "framefit/train/config.h"
#include "framefit/train/events.h"
#include "framefit/train/metrics.h"

namespace framefit::train {

struct TrainResult {
  int64_t steps = 0;
  double seconds = 0;
  bool validated = false;
  PhaseMetrics best;  // best validation metrics (train.best_by decides)
  std::string best_checkpoint;
  std::string last_checkpoint;
  int64_t skipped_videos = 0;  // units passed over under data.on_error: skip
  // Ended early on a stop request: last_checkpoint continues it (--resume auto).
  bool stopped = false;
  // Ended by train.patience: validation had not improved for that many epochs.
  bool stopped_early = false;
};

// Trains the config's task (config.task: phases, clips or segmentation) until train.epochs or
// train.max_steps, a stop request (at a step boundary), train.patience, or a loss that stays
// not finite. Writes train.out_dir: checkpoints/ (every train.checkpoint_every steps and each
// epoch's end, the newest train.keep_last kept), best.pt, log.jsonl and config.yaml.
// resume: "" starts afresh (refusing an out_dir that holds checkpoints), "auto" continues from
// the newest checkpoint in out_dir, anything else is a checkpoint path; a resumed run goes on
// exactly as the uninterrupted one would have.
TrainResult train(const Config& config, const std::string& resume = "",
                  const EventCallback& on_event = {}, const StopRequest& stop = {});

// Where a run stands: what every task's checkpoint records besides its settings.
struct RunPosition {
  int64_t step = 0;
  int64_t epoch = 0;     // 0-based epoch in progress
  int64_t position = 0;  // units (videos, clips, images) of that epoch's order already used
  int64_t skipped = 0;   // units passed over (data.on_error skip)
  double best_score = -1;
  int64_t stale_epochs = 0;  // validated epochs since the best
  double seconds = 0;        // training time up to this position, over every resumed run
};

// What one optimizer step did, for its Step event and its log.jsonl record.
struct StepOutcome {
  double loss = 0;
  int64_t count = 0;         // frames or samples the step trained on
  const char* counted = "";  // "frames" | "samples": the log's name for count
  double seconds = 0;
  int64_t peak_bytes = 0;
  bool update_skipped = false;  // fp16 overflow, or gradients that are not finite
  std::map<std::string, memory::PhaseStats> phases;  // where the step has named phases
};

// One epoch of a run's data and steps, from the run's position in that epoch.
struct EpochSteps {
  std::function<bool()> done;  // whether the epoch's order is used up
  // Gets the next step's data, moving the run's position past it and counting what was
  // skipped; false when all of it was skipped and there is nothing to train on.
  std::function<bool()> fetch;
  // Trains one optimizer step on the data fetched, at learning rate `lr` (model in train mode;
  // a re-plan after running out of memory is kept in the run's settings and told).
  std::function<StepOutcome(double lr)> step;
  std::function<void()> release;  // optional: lets go of what the epoch holds before validation
};

// How a run's events and log name what it trains on.
struct RunNames {
  std::vector<std::string> classes;
  std::vector<std::string> tools;    // data.tools: names the tool metrics in the log
  const char* rate_unit = "frames";  // of the Step events' rate
  engine::Precision precision = engine::Precision::FP32;  // advice when the run diverges
};

// One run of a task, as Task::start made it. Lives for the run; the loop drives it.
class TaskRun {
 public:
  virtual ~TaskRun() = default;
  // The config the run trains with (a phases run on features: model.feature_dim from the data).
  virtual const Config& config() const = 0;
  // Zeros for a fresh run, the checkpoint's position when resumed; the loop moves it.
  virtual RunPosition& position() = 0;
  // train.budget as the run spends it: the tracker's budget and held limit while it trains.
  virtual TrainingBudget budget() const = 0;
  virtual int64_t steps_per_epoch() const = 0;   // optimizer steps
  virtual int64_t samples_per_step() const = 0;  // videos, clips or images (train.lr_batch)
  // The epoch at the position's epoch, from its position.
  virtual EpochSteps start_epoch() = 0;
  // The model and the run's record at `at` (with the run's settings) into a checkpoint; the
  // loop adds the optimizer's and the loss scaler's state to step checkpoints.
  virtual void write(const RunPosition& at, torch::serialize::OutputArchive& archive) = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;
  virtual const engine::LossScaler& scaler() = 0;
  virtual bool validates() const = 0;  // false: no validation split (or train.validate false)
  virtual PhaseMetrics validate() = 0;
  virtual RunNames names() const = 0;
  virtual int64_t skipped() const = 0;  // units skipped so far, reading the data included
};

// The run folder a run starts in: train.out_dir (created and locked), and for a resumed run
// the checkpoint it resumes from, opened, with the config it stored.
struct RunStart {
  std::string out_dir;
  std::string resume_from;                            // "" for a fresh run
  torch::serialize::InputArchive* archive = nullptr;  // the checkpoint's; null for a fresh run
  const Config* stored = nullptr;                     // its config
  bool resumed() const { return archive != nullptr; }
};

// framefit bench-data: every unit of a split (a video, a features file, or an image with its
// mask) loaded as training loads it (with epoch 0's augmentation) through data.workers
// prefetching threads, timed. Tensor bytes and RSS are the caller's to measure around it.
struct DataThroughput {
  int64_t units = 0;              // videos, features files or images read
  int64_t samples = 0;            // frames, feature rows or images
  int64_t height = 0, width = 0;  // the first unit's frame or image size (0 for features)
  int64_t feature_dim = 0;        // features files: features per row (else 0)
  double seconds = 0;
  std::string unit_name;    // "video", "features file", "image"
  std::string sample_name;  // "frame", "feature row", "image"
};

// What the doctor found in a task's config: its findings, and lines saying what was checked.
struct Diagnosis {
  std::vector<plan::Finding> findings;
  std::vector<std::string> summary;
};

// What `framefit plan --config` says of a run, without training: whether its step fits the
// budget, the plan as a record (`plan --config --json`; fits, planned, step_budget_bytes and
// predicted_peak_bytes mean the same for every task, the rest is the task's: chunk and keep, or
// batch and recomputed stages) and as lines for a person.
struct RunPlan {
  bool fits = false;
  nlohmann::json record;
  std::vector<std::string> lines;
  // `plan --config --table`: the predicted peak per batch size (clips and segmentation); empty
  // where the task has none.
  std::vector<std::string> table;
};

// framefit eval: a checkpoint and the split to score it on.
struct EvaluationRequest {
  std::string checkpoint;
  std::vector<std::string> overrides;  // "key=value" (as --set) on the checkpoint's config
  std::string split;                   // "": the config's data.test_split
  // Phases checkpoints only (the other tasks refuse them): a folder (created) that gets each
  // video's per-frame predictions, NAME.csv (phase_csv with the labelled phases), and its
  // ribbons, NAME.png (truth over prediction); and relaxed-boundary scoring of 10 s with these
  // rules (parse_relaxed_rules: general | cholec80 | m2cai16).
  std::string predictions_folder;
  std::string relaxed_rules;
};

// A checkpoint scored on a split: over the whole split (frames, clips or pixels) and, for
// phases, per video.
struct Evaluation {
  Config config;  // the checkpoint's, with the overrides
  data::ClassList classes;
  std::string split;
  PhaseMetrics metrics;
  std::vector<VideoMetrics> per_video;       // phases: each video's, in the split's order
  std::vector<RelaxedVideoMetrics> relaxed;  // with relaxed_rules: each video's
};

// A checkpoint's weights as a PyTorch state_dict (on the CPU), and how they are named.
struct ExportedWeights {
  models::StateDict state;
  std::string names;  // "encoder.* in torchvision names, head.*", ...
};

class Task {
 public:
  virtual ~Task() = default;
  // Errors for settings this task cannot train with (train.* keys that do not apply to it,
  // label settings that do not fit its labels): train() refuses them before it touches the
  // run's folder.
  virtual std::vector<plan::Finding> check_settings(const Config& config) const = 0;
  // A run ready for the loop: its data read (an Info event says what), config.yaml written into
  // start.out_dir, its step planned for the budget (a resumed run keeps its checkpoint's
  // settings where the budget holds them), its model, optimizer and step built from train.seed,
  // and a resumed checkpoint's weights and optimizer state loaded. `tracker`: the tracker of
  // config.device, which the plan is calibrated and the steps measured on; it outlives the run.
  virtual std::unique_ptr<TaskRun> start(const Config& config, const RunStart& start,
                                         memory::Tracker& tracker,
                                         const EventCallback& on_event) const = 0;
  // framefit plan --config: the run's data read and its step planned for the budget, as
  // start() plans it (calibrating where the cache lacks the costs: Info events say so), on
  // `tracker`, config.device's.
  virtual RunPlan plan(const Config& config, memory::Tracker& tracker,
                       const EventCallback& on_event) const = 0;
  // framefit doctor --config for a model the task builds (not a layer list, which
  // plan::diagnose_network checks): every split's data probed as training probes it, each bad
  // unit named, and the model's memory checked against `budget` (resolve_budget's); nothing
  // trained, calibrated or allocated on the device.
  virtual Diagnosis diagnose(const Config& config, const TrainingBudget& budget) const = 0;
  // framefit eval on a checkpoint of this task (center crop, no flip). Evaluate events count
  // the videos or batches.
  virtual Evaluation evaluate(const EvaluationRequest& request,
                              const EventCallback& on_event) const = 0;
  // framefit export: the model a checkpoint of this task holds, as a state_dict.
  virtual ExportedWeights export_weights(const std::string& checkpoint) const = 0;
  // A split's units loaded as training loads them, timed (framefit bench-data).
  virtual DataThroughput read_split(const Config& config, const std::string& split,
                                    const EventCallback& on_event) const = 0;
};

// The task config.task names.
const Task& task_for(const Config& config);

// Task::evaluate of the task the checkpoint's config names.
Evaluation evaluate_checkpoint(const EvaluationRequest& request,
                               const EventCallback& on_event = {});

// read_split of the config's task.
DataThroughput read_split(const Config& config, const std::string& split,
                          const EventCallback& on_event = {});

}  // namespace framefit::train
