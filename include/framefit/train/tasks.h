#pragma once
// Clip classification and segmentation: batch networks (a layer-list network, R3D-18,
// R(2+1)D-18, a UNet, or a TorchScript module) trained on batches of clips or images with the
// run features of phase recognition: the batch and layer checkpointing planned for the budget,
// mixed precision, per-epoch validation, atomic checkpoints (keep-last-N plus best) and exact
// resume. train() runs these for config.task clips and segmentation.
#include <torch/types.h>

#include <string>
#include <vector>

#include "framefit/data/labels.h"
#include "framefit/engine/amp.h"
#include "framefit/engine/checkpoint.h"
#include "framefit/train/config.h"
#include "framefit/train/metrics.h"
#include "framefit/train/trainer.h"

namespace framefit::train {

bool is_batch_task(const Config& config);  // task clips or segmentation

// The network config.model.network names, with "" resolved for the task.
std::string network_kind(const Config& config);

struct BatchModel {
  Config config;
  data::ClassList classes;
  engine::ChainNetwork network;
  std::vector<int64_t> input;  // per sample: [3,L,H,W] (clips) or [3,H,W] (segmentation)
  torch::Device device = torch::kCPU;
  engine::Precision precision = engine::Precision::FP32;  // inference autocast
  int64_t batch = 8;                                      // inference batch
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
PhaseMetrics evaluate_batch(BatchModel& model, const std::string& split,
                            const EventCallback& on_event = {});

// Training for task clips or segmentation; as train().
TrainResult train_batch(const Config& config, const std::string& resume = "",
                        const EventCallback& on_event = {});

}  // namespace framefit::train
