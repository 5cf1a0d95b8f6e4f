#pragma once
// Fixed-length clips for clip classifiers (3D CNNs): a video from the video pipeline cut into
// clips of `length` sampled frames every `stride` frames, each with one label drawn from its
// frames' labels.
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "framefit/core/video.h"
#include "framefit/data/dataset.h"

namespace framefit::data {

enum class ClipLabel {
  Majority,  // the most frequent frame label (ties: the smallest id)
  Center,    // the label of the middle frame
  Last,      // the label of the last frame (online recognition)
};
ClipLabel parse_clip_label(const std::string& name);  // "majority" | "center" | "last"

struct ClipOptions {
  int64_t length = 16;  // frames per clip
  int64_t stride = 16;  // frames between clip starts; < length overlaps, > length skips
  ClipLabel label = ClipLabel::Majority;
};

// Start frames of a video's clips: 0, stride, ... while a whole clip fits (a shorter tail and a
// video shorter than one clip give none).
std::vector<int64_t> clip_starts(int64_t frames, const ClipOptions& options);
// One clip's label from its frame labels [length].
int64_t clip_label(const torch::Tensor& frame_labels, ClipLabel rule);

struct Clips {
  torch::Tensor clips;   // [K,3,length,H,W] uint8, what a 3D CNN takes
  torch::Tensor labels;  // [K] int64; undefined for a video without labels
  std::vector<int64_t> starts;
};
// Cuts a decoded video (frames [T,3,H,W], labels [T] or none, to predict) into its clips.
Clips cut_clips(const Video& video, const ClipOptions& options);

// Every clip of a data set, known without decoding: (video, start) and the label.
class ClipIndex {
 public:
  ClipIndex(const VideoDataset& videos, const ClipOptions& options);
  int64_t size() const { return static_cast<int64_t>(clips_.size()); }
  struct Entry {
    int64_t video = 0;
    int64_t start = 0;
    int64_t label = 0;
  };
  const Entry& at(int64_t i) const { return clips_.at(static_cast<size_t>(i)); }
  // Clips per label, e.g. for class weights.
  std::vector<int64_t> label_counts(int64_t classes) const;

 private:
  std::vector<Entry> clips_;
};

}  // namespace framefit::data
