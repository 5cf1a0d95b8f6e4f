#pragma once
// One split of a batch task's data (clips: tasks/clips.cpp; segmentation:
// tasks/segmentation.cpp) as units that are loaded whole - a video for clips, an image and its
// mask for segmentation - each holding one or more samples, and the batches of an epoch drawn
// from them. Private to src/train.
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "framefit/core/video.h"
#include "framefit/data/dataset.h"
#include "framefit/train/config.h"
#include "framefit/train/events.h"

namespace framefit::train::detail {

class BatchData {
 public:
  virtual ~BatchData() = default;
  virtual int64_t units() const = 0;
  virtual int64_t samples() const = 0;
  virtual int64_t unit_samples(int64_t unit) const = 0;
  virtual bool skip_bad() const = 0;             // data.on_error skip
  virtual int64_t skipped_at_start() const = 0;  // units passed over while opening the split
  virtual std::string describe() const = 0;      // "12 clips of 8 frames from 3 videos"
  // The error for a split without samples: what is missing and how to fix it.
  virtual std::string no_samples(const std::string& split) const = 0;
  // Per sample, as stored: [3,L,H,W] or [3,H,W] uint8.
  virtual const std::vector<int64_t>& sample_shape() const = 0;
  // Training labels per class [C] (clips per label, or mask pixels per class), for class weights.
  virtual torch::Tensor class_counts(int64_t classes) const = 0;
  virtual int64_t unit_bytes(int64_t unit) const = 0;  // decoded, as the prefetcher holds it
  // A unit with the epoch's augmentation where the split is for training.
  virtual Video load(int64_t unit, uint64_t seed, int64_t epoch) const = 0;
  // Sample k of a loaded unit: stored sample and label ([] for a clip, [H,W] for a mask).
  virtual std::pair<torch::Tensor, torch::Tensor> sample(const Video& loaded, int64_t unit,
                                                         int64_t k) const = 0;

  // The epoch's samples as (unit, sample within the unit), grouped by unit so each unit is
  // loaded once: units shuffled, and a unit's samples shuffled among themselves. Depends only
  // on (seed, epoch), so a resumed run continues the same order.
  std::vector<std::pair<int64_t, int64_t>> order(uint64_t seed, int64_t epoch, bool shuffle) const;
  int64_t largest_unit_bytes() const;
};

// The split's data of the config's task (clips or segmentation); `training`: augmented.
std::unique_ptr<BatchData> batch_data(const Config& config, const std::string& split, bool training,
                                      const EventCallback& on_event);
// As batch_data; a split without samples is an error saying why (BatchData::no_samples).
std::unique_ptr<BatchData> batch_data_with_samples(const Config& config, const std::string& split,
                                                   bool training, const EventCallback& on_event);
std::unique_ptr<BatchData> clip_data(const Config& config, const std::string& split, bool training,
                                     const EventCallback& on_event);
std::unique_ptr<BatchData> image_data(const Config& config, const std::string& split,
                                      bool training);

// data.images or data.masks with {split} replaced by the split's name.
std::string replace_split(std::string path, const std::string& split);

// Batches of an epoch's samples from `position` on, units decoded ahead in worker threads.
class SampleStream {
 public:
  SampleStream(const BatchData& data, std::vector<std::pair<int64_t, int64_t>> order,
               int64_t position, uint64_t seed, int64_t epoch, int workers, int64_t max_bytes);

  bool done() const { return next_ >= order_.size(); }
  int64_t position() const { return static_cast<int64_t>(next_); }

  struct Batch {
    torch::Tensor samples, labels;  // empty when every unit in reach failed to load
    std::vector<std::string> warnings;
    int64_t skipped_units = 0;
  };
  // Up to n samples. A unit that fails to load is an error, or (data.on_error skip) a warning
  // and its samples are passed over. Samples are copied into the batch as they are taken, and
  // a unit is let go before the next is taken: only one loaded unit is held beside the batch
  // (samples are views of their unit, so stacking views at the end held every unit in reach).
  Batch next(int64_t n);
  // Lets the loaded unit go (the epoch's stream is done with it).
  void release() {
    loaded_ = {};
    loaded_unit_ = -1;
  }

 private:
  const BatchData& data_;
  std::vector<std::pair<int64_t, int64_t>> order_;
  size_t next_;
  std::optional<data::Prefetcher> prefetcher_;
  int64_t loaded_unit_ = -1;
  Video loaded_;
};

}  // namespace framefit::train::detail
