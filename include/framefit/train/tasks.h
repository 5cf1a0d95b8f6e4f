#pragma once
// Clip classification and segmentation: batch networks (a layer-list network, R3D-18,
// R(2+1)D-18, a UNet, or a TorchScript module) trained on batches of clips or images with the
// run features of phase recognition: the batch and layer checkpointing planned for the budget,
// mixed precision, per-epoch validation, atomic checkpoints (keep-last-N plus best) and exact
// resume. train() (train/task.h) trains them for config.task clips and segmentation.
#include <torch/types.h>

#include <string>
#include <vector>

#include "framefit/data/labels.h"
#include "framefit/engine/amp.h"
#include "framefit/engine/checkpoint.h"
#include "framefit/plan/doctor.h"
#include "framefit/plan/planner.h"
#include "framefit/train/budget.h"
#include "framefit/train/config.h"
#include "framefit/train/metrics.h"
#include "framefit/train/trainer.h"

namespace framefit::train {

// The network config.model.network names, with "" resolved for the task.
std::string network_kind(const Config& config);
// A batch task's per-sample input where the config alone fixes it - clips:
// [3, data.clip_length, data.crop, data.crop]; segmentation: [3, data.resize, data.resize] -
// else empty (without a crop or resize only the data can tell).
std::vector<int64_t> configured_sample_shape(const Config& config);

struct BatchModel {
  Config config;
  data::ClassList classes;
  engine::ChainNetwork network;
  std::vector<int64_t> input;  // per sample: [3,L,H,W] (clips) or [3,H,W] (segmentation)
  torch::Device device = torch::kCPU;
  engine::Precision precision = engine::Precision::FP32;  // inference autocast
  int64_t batch = 8;  // inference batch (train.eval_batch); lowered where it runs out of memory
};

// The network for samples of shape `input`, initialised from train.seed (and model.weights:
// a torchvision state_dict for r3d_18 / r2plus1d_18, its classifier left out). Errors name the
// config key to change: a network that does not fit the task, a layer list whose output is not
// one score per class.
BatchModel build_batch_model(const Config& config, const std::vector<int64_t>& input);
// The model in a checkpoint of a clips or segmentation run; `overrides` change its stored
// config first (device=cpu, data.images=...).
BatchModel load_batch_model(const std::string& checkpoint,
                            const std::vector<std::string>& overrides = {});

// Stored samples (uint8 clips [N,3,L,H,W] or images [N,3,H,W]) as the network's input: scaled,
// normalised (Kinetics statistics for the video ResNets, ImageNet otherwise), on the device.
torch::Tensor batch_input(const BatchModel& model, const torch::Tensor& samples);

// Metrics of `split` (center crop, no flip): over clips for clips, over pixels for segmentation
// (the Jaccard index is the IoU; macro_jaccard the mean IoU). Evaluate events count batches.
// In batches of model.batch; one that runs out of memory is split in halves (a Warning event)
// and model.batch lowered to what ran.
PhaseMetrics evaluate_batch(BatchModel& model, const std::string& split,
                            const EventCallback& on_event = {});

// Class probabilities (softmax of the logits) of stored samples as the network takes them
// (uint8 clips [N,3,L,H,W] or images [N,3,H,W]), computed as evaluation does: eval mode, no
// grad, model.precision, batches of model.batch, a batch that runs out of memory split in halves
// (a Warning event). [N,C] for clips, [N,C,H,W] for segmentation; float32 on the CPU.
torch::Tensor predict_batch(BatchModel& model, const torch::Tensor& samples,
                            const EventCallback& on_event = {});

// A video's clips as training cuts them (data.clip_length, data.clip_stride) from its frames
// [T,3,H,W] uint8 (decoded with data_options(config, false)), each with its class.
struct ClipPrediction {
  std::vector<int64_t> starts;  // each clip's first frame (index into the frames)
  torch::Tensor labels;         // [K] int64
  torch::Tensor confidence;     // [K] float: the probability of the label
};
ClipPrediction predict_clips(BatchModel& model, const torch::Tensor& frames,
                             const EventCallback& on_event = {});
// predict_clips on a video file or frame folder (`folder_fps`: a folder's frame rate) decoded
// with data_options(config, false) a piece at a time: memory holds the frames of the clips not
// yet cut and one batch of clips (model.batch), however long the video. `decoded`, when given,
// receives the sampled frames' source numbers and times (no frames).
ClipPrediction predict_clips_file(BatchModel& model, const std::string& video, double folder_fps,
                                  const EventCallback& on_event = {},
                                  data::DecodedVideo* decoded = nullptr);

// Per-pixel classes of image files of any size: each image read at the network's input size (as
// data.resize made the training images), its class map resized back to the image's own size by
// nearest neighbour. One [H,W] int64 map per image.
std::vector<torch::Tensor> predict_masks(BatchModel& model, const std::vector<std::string>& images,
                                         const EventCallback& on_event = {});

// What a clips or segmentation run will use: the batch and the stages recomputed, with the
// predicted peak in parts. Planned (train.batch or train.checkpointing auto) from the network
// calibrated on a probe copy for train.budget less the prefetch reserve; capped at the number
// of training samples.
struct BatchTaskPlan {
  bool planned = false;        // false: train.batch and train.checkpointing fixed by the config
  int64_t batch = 0;           // 0: not even one sample fits
  int64_t largest_batch = 0;   // what the budget fits, before the cap
  int64_t samples = 0;         // training samples
  int64_t accumulate = 1;      // batches per optimizer step (train.accumulate), run one by one
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
  int64_t library_bytes = 0;  // CUDA's math libraries' workspaces, in the predicted peak
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

// How labels are read and scored: data.ignore_id and data.mask_values set for a task without
// masks, or not fitting data.classes; data.background and a segmental train.best_by (edit,
// f1@k) for a task without frame sequences, or a background naming no class. Errors: part of
// diagnose_task_settings, and checked for task phases too.
std::vector<plan::Finding> diagnose_label_settings(const Config& config);

// train.* settings a clips or segmentation config sets that do not apply to it (train.smoothing,
// for frame sequences) as errors; training and planning refuse such a config.
std::vector<plan::Finding> diagnose_task_settings(const Config& config);

// The doctor for a clips or segmentation config whose network is named (r3d_18, r2plus1d_18,
// unet, torchscript; layer lists have plan::diagnose_network): sizes from the options alone (a
// TorchScript file's tensors read into host memory), nothing allocated on the device, no data
// read (diagnose_batch_data reads it). Errors: a network that does not fit the task, a UNet whose
// depth does not divide data.resize, frames smaller than a video ResNet's stride, a TorchScript
// file that does not load, static memory (parameters, buffers, gradients, optimizer state) above
// the budget. `static_bytes` receives that static memory.
std::vector<plan::Finding> diagnose_batch_task(const Config& config, int64_t budget_bytes,
                                               int64_t* static_bytes = nullptr);

// The doctor on a clips or segmentation config's data: each of its splits built as training
// builds it, every video probed (each bad one named, not only the first) and for segmentation
// every image and mask read whole, as training reads them (a corrupt image, a mask of another
// size, a class id outside the classes). Errors also for a training split without samples.
// `summary` receives what each split holds.
std::vector<plan::Finding> diagnose_batch_data(const Config& config,
                                               std::string* summary = nullptr);

}  // namespace framefit::train
