#pragma once
// The epochs and steps of a training run, shared by every task's trainer: the learning-rate
// schedule, each step's event and log record, the time spent getting data, validation and the
// best weights, step checkpoints, stop requests, train.patience and a diverging loss. The
// trainers supply the data and the step (EpochSteps) and how their checkpoints are written.
// Private to src/train.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/serialize/output-archive.h>

#include "framefit/engine/amp.h"
#include "framefit/memory/tracker.h"
#include "framefit/train/config.h"
#include "framefit/train/metrics.h"
#include "framefit/train/trainer.h"
#include "run_files.h"

namespace framefit::train::detail {

// A run's length and learning-rate schedule for `steps_per_epoch` optimizer steps of
// `samples_per_step` samples (videos, clips or images) each.
struct RunLength {
  int64_t steps_per_epoch = 1;
  int64_t total_steps = 0;  // train.max_steps, else epochs x steps_per_epoch
  int64_t epochs = 0;       // epochs those steps reach into
  Schedule schedule;        // train.lr and train.min_lr, scaled for train.lr_batch
  std::string lr_note;      // what the scaling did, for the run's start; empty without one
};
RunLength run_length(const TrainConfig& train, int64_t steps_per_epoch, int64_t samples_per_step);

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

// One epoch of a trainer's data and steps, from the run's position in that epoch.
struct EpochSteps {
  std::function<bool()> done;  // whether the epoch's order is used up
  // Gets the next step's data, moving the run's position past it and counting what was
  // skipped; false when all of it was skipped and there is nothing to train on.
  std::function<bool()> fetch;
  // Trains one optimizer step on the data fetched, at learning rate `lr` (model in train mode;
  // a re-plan after running out of memory is kept in the trainer's settings and told).
  std::function<StepOutcome(double lr)> step;
  std::function<void()> release;  // optional: lets go of what the epoch holds before validation
};

struct RunHooks {
  // The epoch at the run position's epoch, from its position.
  std::function<EpochSteps()> start_epoch;
  // Writes the model and the run's record at `at` (with the trainer's settings) into a
  // checkpoint; run_epochs adds the optimizer's and the loss scaler's state to step checkpoints.
  std::function<void(const RunPosition& at, torch::serialize::OutputArchive& archive)> write;
  torch::optim::Optimizer* optimizer = nullptr;
  const engine::LossScaler* scaler = nullptr;
  std::function<PhaseMetrics()> validate;  // empty: the run has no validation split
  std::vector<std::string> class_names;
  std::vector<std::string> tool_names;  // data.tools: names the tool metrics in the log
  const char* rate_unit = "frames";     // of the Step events' rate
  engine::Precision precision = engine::Precision::FP32;  // advice when the run diverges
};

// A trainer's record (which extends RunPosition) moved to `at`.
template <class Record>
Record at_position(Record record, const RunPosition& at) {
  static_cast<RunPosition&>(record) = at;
  return record;
}

// Trains from `progress` (zeros for a fresh run, a checkpoint's position when `resumed`) until
// train.epochs or train.max_steps, a stop request (at a step boundary), train.patience, or a
// loss that stays not finite (an error after a checkpoint). Writes log.jsonl (a resumed run
// drops the records after its checkpoint first, so the log reads as if it had never stopped),
// checkpoints every train.checkpoint_every steps and at the end of each epoch (after its
// validation), and best.pt. Warns when the bytes training keeps between steps (the data
// pipeline's left out) grow: memory::LeakDetector. Fills the result but for skipped_videos.
TrainResult run_epochs(RunPosition& progress, const RunLength& run, const Config& config,
                       bool resumed, const RunHooks& hooks, const StopRequest& stop,
                       const EventCallback& on_event);

}  // namespace framefit::train::detail
