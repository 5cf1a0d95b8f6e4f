#pragma once
// Image + mask folders for segmentation (UNet): images/<name>.<ext> and masks/<name>.png, the
// mask's first channel holding each pixel's class id (0..classes-1).
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace framefit::data {

struct SegmentationOptions {
  int64_t classes = 2;
  int64_t size = 0;        // resize images and masks to size x size (masks: nearest); 0 keeps
  // A mask's name is its image's (extension aside) plus this: "_segmentation" for ISIC, "_mask"
  // for Carvana.
  std::string mask_suffix;
  int64_t ignore_id = -1;  // a mask id allowed besides the classes' (pixels to leave out); -1: none
  // Class i's value in the mask files: one number each (as read_label_image reads them; a value
  // equal to ignore_id stays ignored) or an [R, G, B] colour each (the mask read as a picture);
  // empty: the values are the ids. A value not listed is an error naming the pixel. A JPEG mask
  // (lossy: refused without values) takes the nearest listed value (or ignore_id) per pixel.
  std::vector<std::vector<int64_t>> values;
};

// A label map [H,W] int64 at h x w by nearest neighbour, so class ids never blend.
torch::Tensor resize_labels(const torch::Tensor& labels, int64_t h, int64_t w);

class SegmentationDataset {
 public:
  // Pairs every image with the mask of the same name (extension aside) and checks their sizes
  // from the file headers: a missing mask, a mask without an image, or sizes that differ are
  // errors naming the files.
  SegmentationDataset(const std::string& images_dir, const std::string& masks_dir,
                      SegmentationOptions options);
  int64_t size() const { return static_cast<int64_t>(items_.size()); }
  const std::string& name(int64_t i) const { return items_.at(static_cast<size_t>(i)).name; }
  // Image [3,H,W] uint8 and mask [H,W] int64 (data::read_label_image). A class id outside
  // [0, classes), other than options.ignore_id, is an error naming the mask file and the value.
  std::pair<torch::Tensor, torch::Tensor> load(int64_t i) const;
  // The mask alone [H,W] int64, as load() gives it (e.g. to count pixels per class).
  torch::Tensor mask(int64_t i) const;
  // A batch of samples: images [N,3,H,W] uint8, masks [N,H,W] int64 (same size required).
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& indices) const;

 private:
  struct Item {
    std::string name, image, mask;
    int64_t height = 0, width = 0;
  };
  SegmentationOptions options_;
  std::vector<Item> items_;
  // The size a sample comes out at: options.size square, or the item's own.
  std::pair<int64_t, int64_t> output_size(const Item& item) const;
  // The item's mask as class ids [H,W] at its own size: options.values mapped.
  torch::Tensor read_ids(const Item& item) const;
  // A JPEG mask's ids: each pixel's nearest value of options.values (or the ignore id).
  torch::Tensor nearest_ids(const Item& item) const;
};

}  // namespace framefit::data
