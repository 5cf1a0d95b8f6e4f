#pragma once
// The epochs and steps of a training run, for every task (train/task.h): the learning-rate
// schedule, each step's event and log record, the time spent getting data, validation and the
// best weights, step checkpoints, stop requests, train.patience and a diverging loss. The task's
// run supplies the data and the step (EpochSteps) and its checkpoint record. Private to
// src/train.
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
#include "framefit/train/schedule.h"
#include "framefit/train/task.h"
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

// A task's record (which extends RunPosition) moved to `at`.
template <class Record>
Record at_position(Record record, const RunPosition& at) {
  static_cast<RunPosition&>(record) = at;
  return record;
}

// Trains `run` from its position (zeros for a fresh run, a checkpoint's when `resumed`) until
// train.epochs or train.max_steps, a stop request (at a step boundary), train.patience, or a
// loss that stays not finite (an error after a checkpoint). Writes log.jsonl (a resumed run
// drops the records after its checkpoint first, so the log reads as if it had never stopped),
// checkpoints every train.checkpoint_every steps and at the end of each epoch (after its
// validation), and best.pt. Warns when the bytes training keeps between steps (the data
// pipeline's left out) grow: memory::LeakDetector. Fills the result but for skipped_videos.
// `tracker`: the run's device's, whose bytes between steps the leak detector watches.
TrainResult run_epochs(TaskRun& run, const RunLength& length, bool resumed,
                       memory::Tracker& tracker, const StopRequest& stop,
                       const EventCallback& on_event);

}  // namespace framefit::train::detail
