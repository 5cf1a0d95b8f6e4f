#include "framefit/data/clips.h"

#include <torch/torch.h>

namespace framefit::data {

ClipLabel parse_clip_label(const std::string& name) {
  if (name == "majority") return ClipLabel::Majority;
  if (name == "center") return ClipLabel::Center;
  if (name == "last") return ClipLabel::Last;
  TORCH_CHECK(false, "clip label rule \"", name, "\" is not one of majority, center, last");
}

std::vector<int64_t> clip_starts(int64_t frames, const ClipOptions& options) {
  TORCH_CHECK(options.length >= 1, "clips need a length of at least 1 frame; got ", options.length);
  TORCH_CHECK(options.stride >= 1, "clips need a stride of at least 1 frame; got ", options.stride);
  std::vector<int64_t> starts;
  for (int64_t s = 0; s + options.length <= frames; s += options.stride) starts.push_back(s);
  return starts;
}

int64_t clip_label(const torch::Tensor& frame_labels, ClipLabel rule) {
  TORCH_CHECK(frame_labels.dim() == 1 && frame_labels.numel() > 0,
              "clip_label: expected a non-empty [length] label tensor; got ", frame_labels.sizes());
  const auto labels = frame_labels.to(torch::kLong).contiguous();
  const int64_t n = labels.numel();
  switch (rule) {
    case ClipLabel::Center: return labels[n / 2].item<int64_t>();
    case ClipLabel::Last: return labels[n - 1].item<int64_t>();
    case ClipLabel::Majority: break;
  }
  TORCH_CHECK(labels.min().item<int64_t>() >= 0, "clip_label: negative frame label");
  const auto counts = torch::bincount(labels);
  return counts.argmax().item<int64_t>();  // the first maximum: ties go to the smallest id
}

Clips cut_clips(const Video& video, const ClipOptions& options) {
  TORCH_CHECK(video.frames.dim() == 4 && video.frames.size(1) == 3, "cut_clips: frames of ",
              video.name, " must be [T,3,H,W]; got ", video.frames.sizes());
  const bool labelled = video.labels.defined();
  TORCH_CHECK(
      !labelled || (video.labels.dim() == 1 && video.labels.size(0) == video.frames.size(0)),
      "cut_clips: ", video.name, " has ", video.frames.size(0), " frames but ",
      video.labels.numel(), " labels");
  Clips out;
  out.starts = clip_starts(video.frames.size(0), options);
  const auto k = static_cast<int64_t>(out.starts.size());
  out.clips = torch::empty({k, 3, options.length, video.frames.size(2), video.frames.size(3)},
                           video.frames.options());
  if (labelled) out.labels = torch::empty({k}, torch::kLong);
  for (int64_t c = 0; c < k; ++c) {
    const int64_t s = out.starts[static_cast<size_t>(c)];
    // [L,3,H,W] -> [3,L,H,W]: channels first, as Conv3d wants.
    out.clips[c].copy_(video.frames.narrow(0, s, options.length).permute({1, 0, 2, 3}));
    if (labelled)
      out.labels[c] = clip_label(video.labels.narrow(0, s, options.length), options.label);
  }
  return out;
}

ClipIndex::ClipIndex(const VideoDataset& videos, const ClipOptions& options) {
  for (int64_t v = 0; v < videos.size(); ++v) {
    const auto labels = videos.labels(v);
    for (int64_t s : clip_starts(videos.frames(v), options)) {
      clips_.push_back({v, s, clip_label(labels.narrow(0, s, options.length), options.label)});
    }
  }
}

std::vector<int64_t> ClipIndex::label_counts(int64_t classes) const {
  std::vector<int64_t> counts(static_cast<size_t>(classes), 0);
  for (const auto& c : clips_) {
    TORCH_CHECK(c.label >= 0 && c.label < classes, "clip label ", c.label, " outside ", classes,
                " classes");
    ++counts[static_cast<size_t>(c.label)];
  }
  return counts;
}

}  // namespace framefit::data
