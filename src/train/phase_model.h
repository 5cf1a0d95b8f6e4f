#pragma once
// What the phases task's training (tasks/phases.cpp) shares with the phases model's functions
// (phase_model.cpp): the encoder kinds, the planner's view of the model, the checkpoint's
// model and run record, and validation with a feature cache. Private to src/train.
#include <torch/types.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framefit/data/dataset.h"
#include "framefit/models/weights.h"
#include "framefit/plan/planner.h"
#include "framefit/train/trainer.h"
#include "run_files.h"

namespace framefit::models {
class TorchScriptEncoderImpl;
}

namespace framefit::train::detail {

bool is_script_encoder(const Config& config);  // model.encoder torchscript
bool reads_features(const Config& config);     // model.encoder features
// The layout of the frames fed to the encoder: that of its first stage.
bool channels_last_input(const Config& config, torch::Device device);
// The model as the planner sees it, for frames of `size` x `size`.
plan::ModelSpec model_spec(const Config& config, int64_t size, torch::Device device);
// The memory model assumes square frames: the side with the largest frame's pixel count.
int64_t frame_size_for_planning(const data::VideoDataset& dataset);

engine::FrameEncoder script_frame_encoder(std::shared_ptr<models::TorchScriptEncoderImpl> script);
// A TorchScript encoder from config.model.script (or the module a checkpoint stored), in float32
// like framefit's own models.
std::shared_ptr<models::TorchScriptEncoderImpl> load_script_encoder(
    const Config& config, torch::Device device,
    std::shared_ptr<models::TorchScriptEncoderImpl> stored = nullptr);
// Features per frame of a TorchScript encoder: one frame of the configured size through it in
// eval mode (no BatchNorm statistics move, no dropout draws).
int64_t script_feature_dim(models::TorchScriptEncoderImpl& script, const Config& config,
                           torch::Device device);

// What a checkpoint records about the run's position and settings.
struct Progress : RunPosition {  // position: videos of the epoch's order used
  plan::StepSettings settings;
};

void write_model(torch::serialize::OutputArchive& archive, const Model& model);
// The tool head's weights, where the model has one.
void read_tool_head(torch::serialize::InputArchive& archive, Model& model,
                    const std::string& checkpoint, const std::string& built_from);
void write_progress(torch::serialize::OutputArchive& archive, const Progress& p);
// The checkpoint's record of its run, of either format; nullopt where the file records none.
std::optional<Progress> try_read_video_progress(torch::serialize::InputArchive& archive,
                                                const std::string& checkpoint);
// As try_read_video_progress; a file that records none is an error naming it.
Progress read_video_progress(torch::serialize::InputArchive& archive,
                             const std::string& checkpoint);

// A data set's per-video features of an encoder that trains nothing, one file per video in
// `folder`, valid for the settings that produced them (`fingerprint`): files made under other
// settings are removed first.
class FeatureCache {
 public:
  FeatureCache(std::string folder, const std::string& fingerprint) : folder_(std::move(folder)) {
    const auto stamp = folder_ + "/settings.yaml";
    std::ifstream in(stamp);
    const std::string stored((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
    if (stored != fingerprint) {
      std::filesystem::remove_all(folder_);
      make_directories(folder_);
      std::ofstream(stamp) << fingerprint;
    }
  }
  std::string path(int64_t video) const { return folder_ + "/" + std::to_string(video) + ".pt"; }
  bool has(int64_t video) const { return std::filesystem::exists(path(video)); }
  void write(int64_t video, const torch::Tensor& features) const {
    models::write_tensor(features, path(video));  // atomically: a killed run leaves no half file
  }
  // The prefetch job for video v of `set`: its kept features with its labels, or `load` where
  // none are kept or the file does not read or fit its frames (the manifest changed under the
  // same settings).
  data::Prefetcher::Job job(const data::VideoDataset& set, int64_t v, std::function<Video()> load,
                            int64_t feature_dim) const {
    if (!has(v)) return {std::move(load), set.frame_bytes(v)};
    return {[&set, v, file = path(v), load] {
              Video video;
              video.labels = set.labels(v);
              video.tools = set.tools(v);
              video.name = set.entry(v).name;
              try {
                video.features = models::read_tensor(file);
              } catch (const c10::Error&) {
                return load();
              }
              const bool fits =
                  video.features.dim() == 2 && video.features.size(0) == video.labels.size(0);
              return fits ? video : load();
            },
            set.frames(v) * feature_dim * 4};
  }
  const std::string& folder() const { return folder_; }

 private:
  std::string folder_;
};

// What the cached features depend on: the model, the data and how frames are sampled and
// transformed, the precision they were computed in - not the optimizer or the schedule; and the
// files, by size and modification time.
std::string feature_fingerprint(const Config& config, engine::Precision precision,
                                const std::vector<const data::VideoDataset*>& sets);

// evaluate(), taking and keeping the videos' features in `cache` where one is given, holding
// `prefetch_bytes` of decoded videos ahead (within a training budget, its prefetch reserve).
PhaseMetrics evaluate_with(Model& model, const data::VideoDataset& dataset,
                           const EventCallback& on_event, std::vector<VideoMetrics>* per_video,
                           const PredictionCallback& on_prediction, const FeatureCache* cache,
                           int64_t prefetch_bytes);

}  // namespace framefit::train::detail
