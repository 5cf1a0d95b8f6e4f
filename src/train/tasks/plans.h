#pragma once
// What each task plans and checks for a config, in full: Task::plan (RunPlan) and
// Task::diagnose (Diagnosis) give them to callers (train/task.h); start() plans with the same
// functions. Private to src/train (and its tests).
#include <cstdint>
#include <string>
#include <vector>

#include "framefit/memory/tracker.h"
#include "framefit/plan/doctor.h"
#include "framefit/plan/memory_model.h"
#include "framefit/plan/planner.h"
#include "framefit/train/budget.h"
#include "framefit/train/config.h"
#include "framefit/train/events.h"

namespace framefit::train {

// What `train` will run a phases config with, without training: the step settings for the
// longest training video at the largest frame size, within train.budget less the prefetch
// reserve (data.prefetch_bytes, at most a quarter), and the predicted peak in parts. Calibrates
// the encoder when not cached (seconds); a TorchScript encoder each time.
struct PhasePlan {
  bool planned = false;  // false: train.chunk, train.keep and train.precision fix the settings
  bool fits = false;
  plan::StepSettings settings;
  plan::Breakdown breakdown;  // planned only
  std::string advice;         // when it does not fit: the least budget and how
  int64_t videos = 0, longest_frames = 0, frame_size = 0;
  // train.budget, the runtime's share of it, the tensors', the prefetch reserve and the step
  // budget the plan fits (for the largest training video).
  TrainingBudget budget;
};
// `tracker`: config.device's, which the calibration probes are measured on.
PhasePlan plan_phases(const Config& config, memory::Tracker& tracker,
                      const EventCallback& on_event = {});

// `framefit doctor --config` on a phases config: nothing trained, calibrated or decoded. Every
// split's videos are probed as training probes them (manifest, files, frame counts against the
// annotations, phase names), each bad video one error rather than the first alone; then the
// step for the longest training video is checked by plan::diagnose within the step budget of
// `budget` (resolve_budget's). `summary`, when given, says what was checked.
std::vector<plan::Finding> diagnose_phases(const Config& config, const TrainingBudget& budget,
                                           std::string* summary = nullptr);

// What a clips or segmentation run will use: the batch and the stages recomputed, with the
// predicted peak in parts. Planned (train.batch or train.checkpointing auto) from the network
// calibrated on a probe copy for train.budget less the prefetch reserve; capped at the number
// of training samples.
struct BatchTaskPlan {
  bool planned = false;       // false: train.batch and train.checkpointing fixed by the config
  int64_t batch = 0;          // 0: not even one sample fits
  int64_t largest_batch = 0;  // what the budget fits, before the cap
  int64_t samples = 0;        // training samples
  int64_t accumulate = 1;     // batches per optimizer step (train.accumulate), run one by one
  // A fixed train.batch the budget does not hold even with recomputation runs as this many
  // micro-batches (the fewest that fit), as a step that ran out of memory would end up doing.
  int64_t micro_batches = 1;
  std::vector<int64_t> input;  // per sample
  engine::Precision precision = engine::Precision::FP32;
  std::string checkpointing;
  std::vector<engine::ChainSegment> segments;  // what to recompute (engine/checkpoint.h)
  // What a step that runs out of memory is retried with first (engine/batch_step.h): the plan
  // that holds the least at this batch; empty (not planned): every stage recomputed.
  std::vector<engine::ChainSegment> fallback_segments;
  // The video ResNets' lean convolution backward (models/conv3d.h, model.lean_backward).
  bool lean_backward = false;
  // BatchNorm and ReLU between convolutions recomputed in backward (models/norm_relu_conv.h):
  // the cheapest recomputation, with train.checkpointing all, or auto unless a fixed batch
  // needs none (R3D-18, R(2+1)D-18, UNet).
  bool recompute_norm = false;
  // Convolutions with the ReLU and pooling after them run over this many slices along time
  // (models/network.h; 0: whole), where BatchNorm recomputation would be (layer-list networks
  // without a norm after the convolution: seeds/001's).
  int64_t time_slices = 0;
  // train.budget as the run spends it; the plan fits budget.step, for the largest decoded unit.
  TrainingBudget budget;
  // The budget is a CUDA device's: the decoded data is in host memory, and the step budget is
  // the budget less plan::allocator_margin_bytes.
  bool cuda_budget = false;
  // Predicted peak = static (parameters, buffers, gradients, optimizer state) + inputs (stored
  // samples and labels of the accumulated batches, on CUDA only the running batch's copy of
  // them, and the float input of one) + activations (the chain plan's); 0 when not planned.
  int64_t static_bytes = 0, input_bytes = 0, activation_bytes = 0, predicted_peak_bytes = 0;
  int64_t library_bytes = 0;             // CUDA's math libraries' workspaces, in the predicted peak
  int64_t minimum_bytes_one_sample = 0;  // with everything recomputed
  // Validation's batch (eval mode, no grad: plan::calibrate_inference) and its predicted peak
  // (0 when train.eval_batch is a count).
  int64_t eval_batch = 0, eval_peak_bytes = 0;
  // Predicted peaks per batch size for the step budget (`framefit plan --config --table`).
  std::vector<plan::BatchRow> table;
  std::string describe() const;  // one line, as `framefit train` logs it
};
// `tracker`: config.device's, which the probes are measured on.
BatchTaskPlan plan_batch_task(const Config& config, memory::Tracker& tracker,
                              const EventCallback& on_event = {});

// The doctor for a clips or segmentation config whose network is named (r3d_18, r2plus1d_18,
// unet, torchscript; layer lists have plan::diagnose_network): sizes from the options alone (a
// TorchScript file's tensors read into host memory), nothing allocated on the device, no data
// read (diagnose_batch_data reads it). Errors: a network that does not fit the task, a UNet whose
// depth does not divide data.resize, frames smaller than a video ResNet's stride, a TorchScript
// file that does not load, static memory (parameters, buffers, gradients, optimizer state) above
// the budget. `static_bytes` receives that static memory.
std::vector<plan::Finding> diagnose_batch_task(const Config& config, int64_t budget_bytes,
                                               int64_t* static_bytes = nullptr);

}  // namespace framefit::train
