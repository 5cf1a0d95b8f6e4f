// The clips task: fixed-length clips cut from videos (data.clip_length, data.clip_stride), each
// with one class, classified by a 3D network (the batch task, tasks/batch.cpp, trains it): the
// clips of a split, and predicting the clips of a video.
#include <torch/torch.h>

#include <algorithm>
#include <optional>

#include "batch_data.h"
#include "framefit/data/clips.h"
#include "framefit/data/media.h"
#include "framefit/train/tasks.h"
#include "framefit/train/trainer.h"

namespace framefit::train {

namespace detail {
namespace {

// A split's videos, each unit a video and its samples the clips cut from it.
class ClipData final : public BatchData {
 public:
  ClipData(const Config& config, const std::string& split, bool training,
           const EventCallback& on_event)
      : config_(config),
        training_(training),
        videos_(make_dataset(config, split, training, on_event)) {
    clip_.length = config.data.clip_length;
    clip_.stride = config.data.clip_stride;
    clip_.label = data::parse_clip_label(config.data.clip_label);
    index_.emplace(videos_, clip_);
    first_clip_.assign(static_cast<size_t>(videos_.size()) + 1, 0);
    for (int64_t i = 0; i < index_->size(); ++i) ++first_clip_[index_->at(i).video + 1];
    for (size_t v = 1; v < first_clip_.size(); ++v) first_clip_[v] += first_clip_[v - 1];
    for (int64_t v = 1; v < videos_.size(); ++v) {
      TORCH_CHECK(videos_.frame_size(v) == videos_.frame_size(0), "clips of ",
                  videos_.entry(v).video, " are ", videos_.frame_size(v).first, "x",
                  videos_.frame_size(v).second, " but those of ", videos_.entry(0).video, " are ",
                  videos_.frame_size(0).first, "x", videos_.frame_size(0).second,
                  ": batches need one frame size; set data.resize and data.crop");
    }
  }

  int64_t units() const override { return videos_.size(); }
  int64_t samples() const override { return index_->size(); }
  int64_t unit_samples(int64_t unit) const override {
    return first_clip_[unit + 1] - first_clip_[unit];
  }
  bool skip_bad() const override { return videos_.options().skip_bad; }
  int64_t skipped_at_start() const override { return videos_.skipped(); }
  std::string describe() const override {
    return c10::str(index_->size(), " clip", index_->size() == 1 ? "" : "s", " of ", clip_.length,
                    " frames from ", videos_.size(), " video", videos_.size() == 1 ? "" : "s");
  }
  std::string no_samples(const std::string& split) const override {
    if (data::select_split(data::read_manifest(config_.data.manifest), split).empty())
      return no_videos_in_split(config_, split);
    return c10::str("no clips in split \"", split, "\" of ", config_.data.manifest,
                    ": videos shorter than one clip give none; lower data.clip_length");
  }
  const std::vector<int64_t>& sample_shape() const override {
    TORCH_CHECK(units() > 0, "no samples to take the input shape from");
    if (shape_.empty()) {
      const auto [h, w] = videos_.frame_size(0);
      shape_ = {3, clip_.length, h, w};
    }
    return shape_;
  }
  torch::Tensor class_counts(int64_t classes) const override {
    return torch::tensor(index_->label_counts(classes), torch::kLong);
  }
  int64_t unit_bytes(int64_t unit) const override { return videos_.frame_bytes(unit); }
  // The epoch's crop, flip, colour jitter and rotation where the split is for training.
  Video load(int64_t unit, uint64_t seed, int64_t epoch) const override {
    return videos_.load(unit,
                        training_ ? videos_.augmentation(unit, seed, epoch) : data::Augmentation{});
  }
  std::pair<torch::Tensor, torch::Tensor> sample(const Video& loaded, int64_t unit,
                                                 int64_t k) const override {
    const auto& clip = index_->at(first_clip_[unit] + k);
    return {loaded.frames.narrow(0, clip.start, clip_.length).permute({1, 0, 2, 3}),
            torch::tensor(clip.label, torch::kLong)};
  }

 private:
  Config config_;
  bool training_;
  data::VideoDataset videos_;
  data::ClipOptions clip_;
  std::optional<data::ClipIndex> index_;
  std::vector<int64_t> first_clip_;     // per video, its clips' first index in index_ (+ total)
  mutable std::vector<int64_t> shape_;  // sample_shape(), once known
};

}  // namespace

std::unique_ptr<BatchData> clip_data(const Config& config, const std::string& split, bool training,
                                     const EventCallback& on_event) {
  return std::make_unique<ClipData>(config, split, training, on_event);
}

}  // namespace detail

namespace {
void check_clip_model(const BatchModel& model, const char* function) {
  TORCH_CHECK(model.config.task == "clips", function, " needs a clips model; this one is ",
              model.config.task);
}
void check_clip_frames(const BatchModel& model, const torch::Tensor& frames) {
  TORCH_CHECK(frames.dim() == 4 && frames.size(1) == 3 && frames.size(2) == model.input[2] &&
                  frames.size(3) == model.input[3],
              "the network was trained on clips of ", model.input[2], "x", model.input[3],
              " frames; got frames of ", frames.sizes(),
              ": set data.resize and data.crop so the video's frames come out at that size");
}
void check_one_clip(int64_t frames, int64_t length) {
  TORCH_CHECK(frames >= length, "the video has ", frames,
              " sampled frames, fewer than one clip of ", length, " (data.clip_length)");
}
}  // namespace

ClipPrediction predict_clips(BatchModel& model, const torch::Tensor& frames,
                             const EventCallback& on_event) {
  check_clip_model(model, "predict_clips");
  const int64_t length = model.input[1];
  check_clip_frames(model, frames);
  check_one_clip(frames.size(0), length);
  data::ClipOptions options;
  options.length = length;
  options.stride = model.config.data.clip_stride;
  Video video;
  video.frames = frames;
  auto clips = data::cut_clips(video, options);
  const auto probabilities = predict_batch(model, clips.clips, on_event);
  ClipPrediction out;
  out.starts = std::move(clips.starts);
  std::tie(out.confidence, out.labels) = probabilities.max(1);
  return out;
}

ClipPrediction predict_clips_file(BatchModel& model, const std::string& video, double folder_fps,
                                  const EventCallback& on_event, data::DecodedVideo* decoded) {
  check_clip_model(model, "predict_clips_file");
  const int64_t length = model.input[1], stride = model.config.data.clip_stride;
  const int64_t batch = std::max<int64_t>(1, model.batch);
  // The sampled frames [first, seen) that a clip still to be cut may take, and a batch of clips.
  torch::Tensor pending, clips;
  int64_t first = 0, seen = 0, next_start = 0, filled = 0;
  std::vector<int64_t> starts;
  std::vector<torch::Tensor> probabilities;
  const auto run_batch = [&] {
    if (filled > 0)
      probabilities.push_back(predict_batch(model, clips.narrow(0, 0, filled), on_event));
    filled = 0;
  };
  const auto on_frames = [&](const torch::Tensor& frames) {
    check_clip_frames(model, frames);
    pending = pending.defined() ? torch::cat({pending, frames}) : frames.clone();
    seen += frames.size(0);
    if (!clips.defined()) {
      clips = torch::empty({batch, 3, length, frames.size(2), frames.size(3)}, torch::kUInt8);
    }
    for (; next_start + length <= seen; next_start += stride) {
      // [L,3,H,W] -> [3,L,H,W], as cut_clips makes them.
      clips[filled++].copy_(pending.narrow(0, next_start - first, length).permute({1, 0, 2, 3}));
      starts.push_back(next_start);
      if (filled == batch) run_batch();
    }
    // Frames before the next clip's start belong to no clip still to come.
    const int64_t drop = std::min(next_start, seen) - first;
    if (drop > 0) {
      pending = pending.narrow(0, drop, pending.size(0) - drop).clone();
      first += drop;
    }
  };
  auto sampled = data::decode_video_pieces(video, folder_fps, data_options(model.config, false),
                                           std::max(length, batch), on_frames);
  run_batch();
  check_one_clip(seen, length);
  ClipPrediction out;
  out.starts = std::move(starts);
  std::tie(out.confidence, out.labels) = torch::cat(probabilities).max(1);
  if (decoded) *decoded = std::move(sampled);
  return out;
}

}  // namespace framefit::train
