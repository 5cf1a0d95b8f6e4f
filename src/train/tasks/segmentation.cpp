// The segmentation task: images with per-pixel class masks (data.images, data.masks), segmented
// by a network of the batch task (tasks/batch.cpp trains it): the images of a split, and
// predicting the masks of image files.
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <optional>

#include "batch_data.h"
#include "framefit/data/media.h"
#include "framefit/data/segmentation.h"
#include "framefit/train/tasks.h"

namespace framefit::train {

namespace detail {
namespace {

// A split's images, each unit an image and its mask, one sample.
class ImageData final : public BatchData {
 public:
  ImageData(const Config& config, const std::string& split, bool training)
      : training_(training),
        augment_(config.data.augment),
        images_pattern_(config.data.images),
        skip_bad_(config.data.on_error == "skip"),
        ignore_id_(config.data.ignore_id) {
    TORCH_CHECK(!config.data.images.empty() && !config.data.masks.empty(),
                "task segmentation needs data.images and data.masks (folders; {split} is "
                "replaced by the split's name)");
    TORCH_CHECK(!config.data.classes.empty(),
                "data.classes is not set: list the class names in mask-id order");
    data::SegmentationOptions options;
    options.classes = static_cast<int64_t>(config.data.classes.size());
    options.size = config.data.resize;
    options.ignore_id = config.data.ignore_id;
    options.values = config.data.mask_values;
    options.mask_suffix = config.data.mask_suffix;
    // Flip, colour jitter and rotation as for videos; no crop (images are resized whole).
    augmentation_.flip = true;
    augmentation_.brightness = config.data.brightness;
    augmentation_.contrast = config.data.contrast;
    augmentation_.saturation = config.data.saturation;
    augmentation_.hue = config.data.hue;
    augmentation_.rotation = config.data.rotation;
    data::check_mask_rotation(config.data.rotation, config.data.ignore_id);
    const auto images = replace_split(config.data.images, split);
    const auto masks = replace_split(config.data.masks, split);
    if (::access(images.c_str(), F_OK) == 0 || split == config.data.train_split) {
      images_.emplace(images, masks, options);
    }
  }

  int64_t units() const override { return images_ ? images_->size() : 0; }
  int64_t samples() const override { return units(); }
  int64_t unit_samples(int64_t) const override { return 1; }
  bool skip_bad() const override { return skip_bad_; }
  int64_t skipped_at_start() const override { return 0; }
  std::string describe() const override {
    return c10::str(units(), " image", units() == 1 ? "" : "s");
  }
  std::string no_samples(const std::string& split) const override {
    const auto images = replace_split(images_pattern_, split);
    return c10::str("no images in split \"", split, "\": ", images,
                    ::access(images.c_str(), F_OK) == 0 ? " holds none" : " does not exist",
                    " (data.images ", images_pattern_,
                    images_pattern_.find("{split}") != std::string::npos
                        ? ", {split} replaced by the split's name)"
                        : ")");
  }
  // The first image's, read once.
  const std::vector<int64_t>& sample_shape() const override {
    TORCH_CHECK(units() > 0, "no samples to take the input shape from");
    if (shape_.empty()) shape_ = images_->load(0).first.sizes().vec();
    return shape_;
  }
  // Mask pixels per class, each mask read once; one that fails to read is passed over under
  // data.on_error skip.
  torch::Tensor class_counts(int64_t classes) const override {
    auto counts = torch::zeros({classes}, torch::kLong);
    for (int64_t i = 0; i < units(); ++i) {
      try {
        const auto ids = images_->mask(i).flatten();
        counts += torch::bincount(ignore_id_ >= 0 ? ids.masked_select(ids.ne(ignore_id_)) : ids, {},
                                  classes);
      } catch (const c10::Error& e) {
        if (!data::skips_error(skip_bad_, e)) throw;
      }
    }
    return counts;
  }
  int64_t unit_bytes(int64_t) const override {
    const auto& shape = sample_shape();
    return shape[1] * shape[2] * (3 + 8);
  }
  // The epoch's flip, colour jitter and rotation (of image and mask alike) where the split is
  // for training with data.augment.
  Video load(int64_t unit, uint64_t seed, int64_t epoch) const override {
    auto [image, mask] = images_->load(unit);
    if (training_ && augment_) {
      std::tie(image, mask) = data::augment_image(
          image, mask,
          data::draw_augmentation(augmentation_, image.size(1), image.size(2), seed, epoch, unit),
          ignore_id_);
    }
    Video v;
    v.frames = image.unsqueeze(0);
    v.labels = mask;
    v.name = images_->name(unit);
    return v;
  }
  std::pair<torch::Tensor, torch::Tensor> sample(const Video& loaded, int64_t,
                                                 int64_t) const override {
    return {loaded.frames[0], loaded.labels};
  }

 private:
  bool training_;
  bool augment_;
  std::string images_pattern_;  // data.images
  bool skip_bad_;
  int64_t ignore_id_;  // data.ignore_id
  data::TransformOptions augmentation_;
  std::optional<data::SegmentationDataset> images_;
  mutable std::vector<int64_t> shape_;  // sample_shape(), once known
};

}  // namespace

std::unique_ptr<BatchData> image_data(const Config& config, const std::string& split,
                                      bool training) {
  return std::make_unique<ImageData>(config, split, training);
}

}  // namespace detail

std::vector<torch::Tensor> predict_masks(BatchModel& model, const std::vector<std::string>& images,
                                         const EventCallback& on_event) {
  TORCH_CHECK(model.config.task == "segmentation",
              "predict_masks needs a segmentation model; this one is ", model.config.task);
  const int64_t height = model.input[1], width = model.input[2];
  std::vector<torch::Tensor> masks;
  for (size_t begin = 0; begin < images.size();) {
    const size_t count = std::min(images.size() - begin, static_cast<size_t>(model.batch));
    auto batch = torch::empty({static_cast<int64_t>(count), 3, height, width}, torch::kUInt8);
    for (size_t i = 0; i < count; ++i) data::read_image(images[begin + i], batch[i]);
    const auto classes = predict_batch(model, batch, on_event).argmax(1);
    for (size_t i = 0; i < count; ++i) {
      const auto [h, w] = data::image_size(images[begin + i]);
      masks.push_back(data::resize_labels(classes[i], h, w));
    }
    begin += count;
  }
  return masks;
}

}  // namespace framefit::train
