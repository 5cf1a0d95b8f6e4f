#pragma once
// Videos with per-frame labels, ready for the training step: decoded (FFmpeg) from video files
// or frame folders, sampled at a frame rate, resized, cropped and flipped (the same crop and
// flip for every frame of a video), with reproducible, resumable epoch orders and a
// memory-bounded prefetch queue decoding in worker threads.
#include <torch/types.h>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "framefit/core/video.h"
#include "framefit/data/features.h"
#include "framefit/data/labels.h"

namespace framefit::data {

struct TransformOptions {
  int64_t resize = 0;        // shorter side after decoding; 0 keeps the source size
  int64_t crop = 0;          // square crop side; 0: no crop
  bool random_crop = false;  // training: a random crop offset per video (else centered)
  bool flip = false;         // training: flip a video horizontally with probability 1/2
  // Training: torchvision's ColorJitter(brightness, contrast, saturation, hue): factors drawn
  // from [max(0, 1 - x), 1 + x] (hue: a shift from [-hue, hue] turns, hue <= 0.5) and applied
  // in a random order, drawn once per video so all its frames agree; 0 leaves one alone.
  double brightness = 0, contrast = 0, saturation = 0, hue = 0;
  // Training: torchvision's RandomRotation(rotation): an angle from [-rotation, rotation]
  // degrees per video, about the frame's centre, nearest neighbour, corners filled black.
  double rotation = 0;
};

struct DataOptions {
  double fps = 0;  // sampling rate; 0 keeps every source frame
  // The annotations' frame rate for entries without their own labels_fps; 0: one label per
  // source frame.
  double labels_fps = 0;
  TransformOptions transform;
  bool skip_bad = false;  // data.on_error: skip: drop a bad video with a warning (else: error)
  int decoder_threads = 1;
  bool skip_unsampled = true;  // VideoReader: leave out unsampled frames nothing refers to
  bool pinned = false;  // page-locked frame memory (training on CUDA)
  // Each video is its precomputed features (VideoEntry::features, data/features.h), one row per
  // labelled frame, taken as they are: nothing is decoded, sampled or transformed.
  bool features = false;
  FeatureLayout features_layout = FeatureLayout::Auto;
  int64_t features_stride = 1;  // rows 0, k, 2k, ... of each features file (MS-TCN's sample_rate)
  // Tool presence to read with each video (VideoEntry::tools, the columns of these names);
  // empty: none. Every video then needs its tool annotation file.
  std::vector<std::string> tools;
};

// The random choices applied to one video, drawn once so all its frames agree.
struct Augmentation {
  int64_t top = -1;  // crop offset; -1: centered
  int64_t left = -1;
  bool flip = false;
  // Colour jitter (TransformOptions): factors, 1 (hue 0) for none, and the order they apply in
  // (0 brightness, 1 contrast, 2 saturation, 3 hue).
  double brightness = 1, contrast = 1, saturation = 1, hue = 0;
  std::array<int, 4> jitter_order = {0, 1, 2, 3};
  bool jitters() const { return brightness != 1 || contrast != 1 || saturation != 1 || hue != 0; }
  double degrees = 0;  // rotation, counterclockwise (TransformOptions::rotation)
};
// Deterministic in (seed, epoch, video): resuming a run redraws the same augmentation.
Augmentation draw_augmentation(const TransformOptions& options, int64_t height, int64_t width,
                               uint64_t seed, int64_t epoch, int64_t video);

// The augmentation's colour jitter applied to uint8 frames [T,3,H,W] (RGB), as torchvision's
// tensor functions adjust_brightness, adjust_contrast (mean gray per frame), adjust_saturation
// and adjust_hue compute it on uint8 images, in its order: a new tensor, equal to torchvision's
// output (tested). Works through the frames a few at a time, so its float temporaries stay small.
torch::Tensor adjust_colors(const torch::Tensor& frames, const Augmentation& augmentation);
// uint8 frames [T,3,H,W] turned `degrees` counterclockwise about their centre as torchvision's
// rotate (nearest, no expansion, fill 0) turns uint8 images: a new tensor, equal to its output.
torch::Tensor rotate_frames(const torch::Tensor& frames, double degrees);
// A class-id mask [H,W] (int64) turned as rotate_frames turns its image (the same nearest
// pixels), `fill` where the turned image has no source pixel.
torch::Tensor rotate_mask(const torch::Tensor& mask, double degrees, int64_t fill);
// A segmentation sample (image uint8 [3,H,W], mask int64 [H,W]) with the augmentation's flip,
// colour jitter (the image) and rotation (both; the mask's corners get `ignore_id`, which must
// then be a class-free id >= 0).
// An error asking for data.ignore_id when masks are to be turned (degrees != 0) without one.
void check_mask_rotation(double degrees, int64_t ignore_id);
std::pair<torch::Tensor, torch::Tensor> augment_image(torch::Tensor image, torch::Tensor mask,
                                                      const Augmentation& augmentation,
                                                      int64_t ignore_id);

// The order of `count` videos in `epoch`: a permutation that depends only on (seed, epoch), so a
// resumed run continues the same order from its saved position. shuffle=false: 0, 1, 2, ...
std::vector<int64_t> epoch_order(int64_t count, uint64_t seed, int64_t epoch, bool shuffle);

// The image files (.jpg, .jpeg, .png, .bmp, .webp, .tif, .tiff) of a folder, as paths sorted by
// name; hidden files left out. A folder that cannot be opened is an error naming it.
std::vector<std::string> list_images(const std::string& folder);

// One video file or frame folder, decoded for inference (no labels): sampled, resized and
// center-cropped as `options` say. folder_fps: the frame rate of a frame folder.
struct DecodedVideo {
  torch::Tensor frames;                // [T,3,H,W] uint8
  std::vector<int64_t> source_frames;  // the source frame index of each
  std::vector<double> source_seconds;  // and its time in the video (from its timestamps)
  double source_fps = 0;               // average rate
};
DecodedVideo decode_video(const std::string& path, double folder_fps, const DataOptions& options);
// decode_video a piece at a time: `on_frames` receives the sampled frames `piece` at a time
// ([k,3,H,W] uint8, k <= piece, in order; overwritten once the call returns: clone to keep),
// so a video of any length is decoded in the memory of one piece. The result has no frames.
using FramesCallback = std::function<void(const torch::Tensor& frames)>;
DecodedVideo decode_video_pieces(const std::string& path, double folder_fps,
                                 const DataOptions& options, int64_t piece,
                                 const FramesCallback& on_frames);

class VideoDataset {
 public:
  // Probes every video (frame count, frame size) and reads its annotations, so a missing file or
  // a label count that does not match the frames is found before training. With
  // options.skip_bad such a video is left out and reported through `on_warning`.
  VideoDataset(std::vector<VideoEntry> entries, ClassList classes, DataOptions options,
               const std::function<void(const std::string&)>& on_warning = {});

  int64_t size() const { return static_cast<int64_t>(videos_.size()); }
  const VideoEntry& entry(int64_t i) const { return videos_.at(i).entry; }
  const ClassList& classes() const { return classes_; }
  const DataOptions& options() const { return options_; }
  int64_t frames(int64_t i) const;  // after sampling
  // A features data set's feature size (every video's the same); 0 for videos.
  int64_t feature_dim() const { return feature_dim_; }
  int64_t total_frames() const { return offsets_.empty() ? 0 : offsets_.back(); }
  int64_t skipped() const { return skipped_; }  // videos left out by skip_bad
  // Frame size after resizing and cropping: {height, width}.
  std::pair<int64_t, int64_t> frame_size(int64_t i) const;
  int64_t frame_bytes(int64_t i) const;  // uint8 bytes of video i's frames (features: float32)

  // (video, frame within it) of a frame counted across all videos, in O(log n).
  std::pair<int64_t, int64_t> locate(int64_t global_frame) const;
  // Labels of video i's sampled frames (no decoding).
  torch::Tensor labels(int64_t i) const;
  // With DataOptions::tools: their presence in video i's sampled frames, [T,K] float (1, 0, or
  // -1 where the frame is not annotated); else undefined.
  torch::Tensor tools(int64_t i) const;
  // Video i's sampled frames: their source frame indices and times in seconds (0 for a frame
  // folder of unknown rate).
  const std::vector<int64_t>& source_frames(int64_t i) const { return videos_.at(i).sampled; }
  const std::vector<double>& source_seconds(int64_t i) const { return videos_.at(i).seconds; }

  // Video i's random crop and flip for `epoch` (draw_augmentation with its frame size).
  Augmentation augmentation(int64_t i, uint64_t seed, int64_t epoch) const;

  // Decodes video i: frames [T,3,H,W] uint8 and labels [T] (features: Video::features [T,D]
  // float32 instead of frames). Errors name the file.
  Video load(int64_t i, const Augmentation& augmentation = {}) const;
  // load(i) without augmentation, its frames handed to `on_frames` `piece` at a time as
  // decode_video_pieces hands them: the video returned has no frames. A features data set's
  // video comes with its features, as from load(); `on_frames` is not called.
  Video load_pieces(int64_t i, int64_t piece, const FramesCallback& on_frames) const;

 private:
  struct Item {
    VideoEntry entry;
    std::vector<std::string> frame_files;  // a frame folder's images, sorted
    std::vector<int64_t> sampled;          // source frame indices kept
    std::vector<double> seconds;           // their times
    std::vector<int64_t> labels;           // per source frame
    std::vector<float> tools;              // per sampled frame x DataOptions::tools (-1: unknown)
    int64_t height = 0, width = 0;         // after resizing, before cropping
    bool time_first = true;                // features: stored [T,D] (else [D,T])
    int64_t feature_dim = 0;               // features: D
  };
  Item probe(const VideoEntry& entry) const;
  Item probe_features(const VideoEntry& entry) const;
  // Item::tools of the sampled frames (Item::sampled) from the entry's tool file, given each
  // source frame's annotation frame; `count`: the phase annotation's frames (the tool file's
  // must be among them).
  void read_tools(Item& item, const std::vector<int64_t>& annotation_frames, int64_t count) const;

  ClassList classes_;
  DataOptions options_;
  std::vector<Item> videos_;
  std::vector<int64_t> offsets_;  // offsets_[i]: frames of videos 0..i
  int64_t skipped_ = 0;
  int64_t feature_dim_ = 0;
};

// Whether data.on_error skip (`skip_bad`) passes over `error`, raised loading a video or image:
// a bad file, yes; running out of memory, never (it is no fault of the file).
bool skips_error(bool skip_bad, const std::exception& error);

// Decodes videos ahead of the consumer in worker threads, in order, holding at most
// `max_bytes` of decoded frames (a video larger than that is decoded alone).
class Prefetcher {
 public:
  struct Job {
    std::function<Video()> load;
    int64_t bytes = 0;  // decoded size, for the memory bound
  };
  Prefetcher(std::vector<Job> jobs, int workers, int64_t max_bytes);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  bool done() const;
  // The next video in job order; a job's error is rethrown here, in order, except running out
  // of memory (memory::is_out_of_memory) in a worker: that job is run again here, once.
  Video next();

 private:
  struct Slot {
    bool ready = false;
    Video video;
    std::exception_ptr error;
  };
  void work();

  std::vector<Job> jobs_;
  int64_t max_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Slot> slots_;  // jobs started and not consumed, in order
  size_t started_ = 0;      // jobs handed to workers
  size_t consumed_ = 0;     // jobs returned by next()
  int64_t held_bytes_ = 0;  // decoded or being decoded, not consumed
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace framefit::data
