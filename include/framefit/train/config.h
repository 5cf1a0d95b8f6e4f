#pragma once
// A training run's configuration: a YAML file whose keys are all listed in one table
// (config_keys()), each overridable from the command line as `--set key=value`. Unknown keys and
// bad values are errors naming the file (or override) and the key.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "framefit/data/features.h"
#include "framefit/engine/amp.h"
#include "framefit/models/heads.h"
#include "framefit/models/network.h"
#include "framefit/models/resnet.h"
#include "framefit/plan/planner.h"

namespace framefit::train {

struct ModelConfig {
  // resnet18 | resnet34 | resnet50 | torchscript | features (no encoder: the head trains on
  // precomputed per-frame features, the manifest's `features` files)
  std::string encoder = "resnet18";
  int64_t feature_dim = 0;           // encoder features: D; 0: the training data's
  std::string norm = "group_norm";   // bn | frozen_bn | group_norm
  int64_t groups = 32;
  std::string freeze;         // last frozen stage (conv1, layer1..layer4), "" for none
  std::string head = "lstm";  // lstm | tcn | linear
  models::HeadSettings head_settings;  // model.lstm_*, model.tcn_*, bidirectional, causal
  std::string weights;        // torchvision state_dict for the encoder, "" for random
  // The weights' key prefix in that file ("encoder." for a framefit export); "" finds it.
  std::string weights_prefix;
  models::ActivationLayout layout = models::ActivationLayout::Auto;  // auto | nchw | channels_last
  // The ResNet blocks' BatchNorm and ReLU recomputed in backward: true | false | nullopt (auto:
  // the planner's choice where it plans the step).
  std::optional<bool> recompute_norm;
  // A network written as a list of layers (models/network.h) and its input per sample,
  // [C,H,W] or [C,T,H,W]; checked by `framefit doctor --config`.
  std::vector<models::LayerSpec> layers;
  std::vector<int64_t> input;
  // Tasks clips and segmentation: the network (layers | r3d_18 | r2plus1d_18 | unet |
  // torchscript; "" picks r3d_18, or layers when model.layers is set, for clips and unet for
  // segmentation), the TorchScript file, and the UNet's shape.
  std::string network;
  std::string script;
  int64_t width = 32;
  int64_t depth = 4;
  bool bilinear = false;
  // r3d_18 / r2plus1d_18 and model.layers' conv3d layers on the CPU: the backward of
  // convolutions with few output positions (layer4) without oneDNN's weight-sized workspace
  // (models/conv3d.h): true, false, nullopt (auto: the planner takes it where it fits at least
  // twice the batch).
  std::optional<bool> lean_backward;
};

struct DataConfig {
  std::string manifest;              // CSV (name, video, labels, split, fps)
  std::vector<std::string> classes;  // phase names, in label-id order
  double fps = 1;                    // sampling rate; 0 keeps every frame
  double labels_fps = 0;  // annotations' own frame rate (manifest rows without one); 0: video's
  // model.encoder features: the files' axes, auto | T,D | D,T.
  data::FeatureLayout features_layout = data::FeatureLayout::Auto;
  int64_t features_stride = 1;  // model.encoder features: every k-th row (MS-TCN's sample_rate)
  int64_t resize = 0;                // shorter side; 0 keeps
  int64_t crop = 0;                  // square crop; 0 none
  bool augment = true;               // training: random crop offset and horizontal flip
  // Training, with augment: torchvision ColorJitter's ranges, drawn once per video; 0: off.
  double brightness = 0, contrast = 0, saturation = 0, hue = 0;
  double rotation = 0;  // training, with augment: torchvision RandomRotation's degrees; 0: off
  std::string on_error = "fail";     // fail | skip
  int64_t workers = 2;               // decoding threads
  bool skip_unsampled = true;        // decoding leaves out unsampled frames nothing refers to
  int64_t prefetch_bytes = 256ll << 20;
  std::string train_split = "train";
  std::string val_split = "val";
  std::string test_split = "test";
  // Task clips: clips of clip_length sampled frames every clip_stride frames, labelled by
  // clip_label (majority | center | last).
  int64_t clip_length = 16;
  int64_t clip_stride = 16;
  std::string clip_label = "majority";
  // Task segmentation: image and mask folders; "{split}" is replaced by the split's name.
  std::string images;
  std::string masks;
  // Task segmentation: a mask id whose pixels count in neither the loss nor the metrics (255
  // marks object borders in Pascal VOC); -1: none.
  int64_t ignore_id = -1;
  std::string mask_suffix;  // segmentation: a mask's name is its image's plus this
  // Task segmentation: class i's pixel value in the mask files, one number each (e.g. [0, 255]
  // for binary masks) or an [R, G, B] colour each (colour-coded masks); empty: the values are
  // the ids.
  std::vector<std::vector<int64_t>> mask_values;
  // Task phases: classes whose segments the segmental metrics (edit, F1@k) leave out, as MS-TCN
  // leaves out "background"; frame metrics count them.
  std::vector<std::string> background;
  // Task phases: tool presence also learned and scored (multi-label), the tool annotation
  // files' columns of these names (Cholec80's Grasper, Bipolar, ...); empty: none.
  std::vector<std::string> tools;
};

struct TrainConfig {
  int64_t epochs = 10;
  int64_t max_steps = 0;            // optimizer steps; 0: epochs decide
  std::string optimizer = "adamw";  // sgd | adam | adamw
  double lr = 1e-3;
  double weight_decay = 1e-4;
  double momentum = 0.9;
  std::string schedule = "cosine";  // constant | step | cosine
  int64_t warmup_steps = 0;
  int64_t step_size = 0;  // step schedule: steps between decays (0: one epoch)
  double gamma = 0.1;
  double min_lr = 0;               // cosine floor
  // Samples per optimizer step that lr and min_lr were set for; > 0: both are scaled to the
  // run's samples per step (a planned batch), linearly or by the square root (lr_scaling).
  int64_t lr_batch = 0;
  std::string lr_scaling = "linear";  // linear | sqrt
  std::optional<engine::Precision> precision;  // nullopt: auto (the planner's)
  int64_t budget = 0;              // bytes; 0: the device's free memory
  // On the CPU, what train.budget bounds: process (the process's resident memory, what a
  // container's limit sees: the runtime's own memory comes off before tensors plan in it) |
  // tensors (the tracked tensors alone). On CUDA it is the device's memory either way.
  std::string budget_covers = "process";
  // Counts where nullopt is auto (the planner's): frames per chunk (0: naive), chunks kept.
  std::optional<int64_t> chunk;
  std::optional<int64_t> keep;
  int64_t accumulate = 1;          // videos per optimizer step
  double clip_grad_norm = 0;
  double smoothing = 0;        // MS-TCN smoothing loss weight
  double tool_weight = 1;      // with data.tools: weight of the tool presence loss
  double label_smoothing = 0;  // PyTorch's cross-entropy label_smoothing
  bool class_weights = false;  // weight classes by inverse frequency in the training split
  uint64_t seed = 0;
  std::string out_dir = "runs/train";
  int64_t keep_last = 2;         // checkpoints kept besides the best
  int64_t checkpoint_every = 0;  // optimizer steps; 0: at the end of each epoch
  bool validate = true;          // evaluate the validation split after each epoch
  // Early stopping: end the run once train.best_by has not improved for this many validated
  // epochs in a row; 0: never.
  int64_t patience = 0;
  // The validation metric that picks best.pt: accuracy | macro_f1 | macro_jaccard, or for
  // phases edit | f1@10 | f1@25 | f1@50 (segmental); auto: macro_jaccard (mean IoU) for
  // segmentation, accuracy otherwise (nullopt; best_metric resolves it).
  std::optional<std::string> best_by;
  // Tasks clips and segmentation: samples per batch (nullopt, auto: the largest the planner fits
  // in the budget), and layer checkpointing (auto: only what the batch needs | off | all).
  std::optional<int64_t> batch;
  plan::Recompute checkpointing = plan::Recompute::AsNeeded;
  // Phases with an encoder that trains nothing (model.freeze at its last stage) and no
  // augmentation: auto keeps each video's features on disk after its first step (validation:
  // evaluation) and runs the head on them in later epochs, without decoding or encoding; off.
  bool cache_features = true;  // auto (true) | off
  // Evaluation (validation, framefit eval) runs without grad in eval mode, so a larger batch
  // fits; nullopt (auto): the planner's, measured (plan::calibrate_inference).
  std::optional<int64_t> eval_batch;
};

struct Config {
  // phases: per-frame labels over whole videos (chunked encoder + temporal head); clips: one
  // label per fixed-length clip (3D CNNs); segmentation: per-pixel labels of images (UNet).
  std::string task = "phases";
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  std::string device = "cpu";
};

struct ConfigKey {
  std::string name;  // "train.lr"
  std::string help;
};
const std::vector<ConfigKey>& config_keys();

// `overrides` are "key=value" (value in YAML syntax: 0.001, bf16, [a, b]).
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {});
std::string to_yaml(const Config& config);  // every key, loadable by parse_config
// Task clips or segmentation: trained on batches of samples (train/tasks.h), not video by video.
bool is_batch_task(const Config& config);
// train.best_by with auto resolved: the metric_value name that picks best.pt.
std::string best_metric(const Config& config);

// The keys whose values differ, as "key: A -> B" with the values in YAML flow style, in the
// order of config_keys().
std::vector<std::string> config_differences(const Config& before, const Config& after);

}  // namespace framefit::train
