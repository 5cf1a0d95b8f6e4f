#pragma once
// Phase recognition's model and plan: a per-frame encoder and a temporal head built from a config
// or loaded from a checkpoint; the step a phases run trains with (train/task.h's train() runs
// it); evaluation, prediction, feature extraction and export. The library never prints:
// everything worth saying arrives as an Event.
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "framefit/data/dataset.h"
#include "framefit/engine/amp.h"
#include "framefit/engine/chunked.h"
#include "framefit/models/heads.h"
#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"
#include "framefit/plan/doctor.h"
#include "framefit/plan/memory_model.h"
#include "framefit/train/budget.h"
#include "framefit/train/config.h"
#include "framefit/train/events.h"
#include "framefit/train/metrics.h"

namespace framefit::models {
class TorchScriptEncoderImpl;
}

namespace framefit::train {

// The config stored in a checkpoint (its task says whether load_model or load_batch_model reads
// it).
Config checkpoint_config(const std::string& checkpoint);

// A trained (or freshly initialised) model and the config it came from.
struct Model {
  Config config;
  data::ClassList classes;
  // The per-frame encoder: a ResNet (model.encoder resnet18|34|50), or a TorchScript module
  // (model.encoder torchscript, the file in model.script) of feature_dim features per frame;
  // or none (model.encoder features: features_input, a module without parameters, stands in
  // for it and the head reads precomputed features).
  models::ResNet encoder{nullptr};
  std::shared_ptr<models::TorchScriptEncoderImpl> script;
  std::shared_ptr<torch::nn::Module> features_input;
  int64_t feature_dim = 0;
  std::shared_ptr<models::TemporalHead> head;
  // With data.tools: per-frame tool presence logits from the features (Linear D -> tools),
  // trained with the phases.
  torch::nn::Linear tools{nullptr};
  torch::Device device = torch::kCPU;
  engine::Precision precision = engine::Precision::FP32;  // inference autocast
  int64_t chunk = 64;                                     // inference chunk

  // Whichever encoder it is: its module (parameters, buffers, train/eval, save/load), and the
  // chunked engine's view of it.
  torch::nn::Module& encoder_module() const;
  engine::FrameEncoder frame_encoder() const;
};
Model build_model(const Config& config);  // initialised from train.seed (and model.weights)
// The model saved in a checkpoint. `overrides` ("key=value", as --set) change its stored
// config first: device=cpu evaluates a CUDA checkpoint on a CPU, data.manifest another data set.
Model load_model(const std::string& checkpoint, const std::vector<std::string>& overrides = {});

// Per-frame predictions for one video's frames [T,3,H,W] uint8: ids [T] and probabilities
// [T,C] (the last stage of a multi-stage head).
struct Prediction {
  torch::Tensor labels;
  torch::Tensor probabilities;
  torch::Tensor tool_probabilities;  // [T,K] sigmoid of the tool head; undefined without one
};
// Per-frame phases as CSV (`framefit predict`, `eval --predictions`): the source frame, its time
// (`frames` and `seconds`, one per prediction), the predicted phase and its probability, with
// `truth` ([T] class ids) the labelled phase, and with tool probabilities one more column per
// tool (named by `tools`).
std::string phase_csv(const Prediction& prediction, const std::vector<int64_t>& frames,
                      const std::vector<double>& seconds, const data::ClassList& classes,
                      const std::vector<std::string>& tools, const torch::Tensor& truth = {});
// model.chunk frames at a time; a video that runs out of memory is predicted again with the
// chunk halved (a Warning event), and model.chunk keeps the chunk that ran.
Prediction predict(Model& model, const torch::Tensor& frames, const EventCallback& on_event = {});
// predict() on a video file or frame folder (`folder_fps`: a folder's frame rate), sampled,
// resized and centre-cropped as the model's config says (data_options(config, false)), decoded
// and encoded model.chunk frames at a time: memory holds one piece of frames and the video's
// features, however long it is. `decoded`, when given, receives the sampled frames' source
// numbers and times (no frames).
Prediction predict_file(Model& model, const std::string& video, double folder_fps,
                        const EventCallback& on_event = {}, data::DecodedVideo* decoded = nullptr);
// A model without encoder (model.encoder features): predictions from features [T,D].
Prediction predict_features(Model& model, const torch::Tensor& features,
                            const EventCallback& on_event = {});

// Stage one of two-stage training: every video of the config's splits (data.train_split,
// val_split, test_split) through the model's encoder as evaluation runs it (centre crop, no
// flip, model.chunk frames at a time), written to `out_dir` as NAME.pt (features [T,D] float32,
// one row per sampled frame), NAME.txt (the labels of those frames, one line each), with
// data.tools NAME-tools.txt (their tool presence, frames numbered by row), and
// manifest.csv (name, labels, split, features, fps, tools) - the data set model.encoder: features
// trains on. Returns the manifest's path. Not for a model that has no encoder.
std::string extract_features(Model& model, const std::string& out_dir,
                             const EventCallback& on_event = {});

// Online recognition, as in the operating room: frames (or features) arrive a few at a time and
// each gets its phase from itself and the frames before it. The predictions are predict()'s on
// the whole video so far (up to float rounding: other matrix shapes), at a cost per frame that
// does not grow with the video: the LSTM head carries its state, the causal TCN reruns only its
// receptive field, the linear head needs nothing. A head that looks ahead (bidirectional LSTM,
// non-causal TCN) is refused.
class OnlinePredictor {
 public:
  explicit OnlinePredictor(Model& model);
  // The next frames [N,3,H,W] uint8 (a model with an encoder) or features [N,D]: their
  // predictions ([N] ids, [N,C] probabilities).
  Prediction push(const torch::Tensor& frames);
  Prediction push_features(const torch::Tensor& features);
  int64_t frames() const { return frames_; }  // pushed since the start (or reset)
  void reset();                               // a new video

 private:
  Model& model_;
  int64_t frames_ = 0;
  torch::Tensor history_;                  // causal TCN: the last receptive field - 1 features
  std::vector<torch::Tensor> lstm_state_;  // LSTM: (h, c); empty at the start
};

// Every video of `dataset` (center crop, no flip), predicted as predict() does.
// `per_video`, when given, receives each evaluated video's own metrics, in dataset order;
// `on_prediction` each video's index in `dataset` and prediction.
using PredictionCallback = std::function<void(int64_t video, const Prediction& prediction)>;
PhaseMetrics evaluate(Model& model, const data::VideoDataset& dataset,
                      const EventCallback& on_event = {},
                      std::vector<VideoMetrics>* per_video = nullptr,
                      const PredictionCallback& on_prediction = {});

// How the config's data.* keys decode videos; training adds the random crop and flip.
data::DataOptions data_options(const Config& config, bool training);

// The data set of `split` as the config describes it (training augmentation off).
data::VideoDataset make_dataset(const Config& config, const std::string& split, bool training,
                                const EventCallback& on_event = {});

// The error for a split that gave no videos: names the manifest and, when the manifest has no
// video in that split at all (a typo), the splits it has, with their video counts.
std::string no_videos_in_split(const Config& config, const std::string& split);

// A Warning event when the manifest has videos in splits that none of data.train_split,
// val_split and test_split names (data::unused_splits).
void warn_unused_splits(const Config& config, const EventCallback& on_event);

// Weights as a PyTorch state_dict: "encoder.<torchvision name>" (a TorchScript encoder: its
// own names), "head.<name>", and with data.tools "tools.weight" and "tools.bias".
models::StateDict export_state_dict(const Model& model);

}  // namespace framefit::train
