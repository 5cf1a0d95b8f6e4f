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

// How labels are read and scored: data.ignore_id and data.mask_values set for a task without
// masks, or not fitting data.classes; data.background and a segmental train.best_by (edit,
// f1@k) for a task without frame sequences, or a background naming no class. Errors: part of
// diagnose_task_settings, and checked for task phases too.
std::vector<plan::Finding> diagnose_label_settings(const Config& config);

// train.* settings a clips or segmentation config sets that do not apply to it (train.smoothing,
// for frame sequences) as errors; training and planning refuse such a config.
std::vector<plan::Finding> diagnose_task_settings(const Config& config);

// The doctor on a clips or segmentation config's data: each of its splits built as training
// builds it, every video probed (each bad one named, not only the first) and for segmentation
// every image and mask read whole, as training reads them (a corrupt image, a mask of another
// size, a class id outside the classes). Errors also for a training split without samples.
// `summary` receives what each split holds.
std::vector<plan::Finding> diagnose_batch_data(const Config& config,
                                               std::string* summary = nullptr);

}  // namespace framefit::train
