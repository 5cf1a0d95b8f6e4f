#include "framefit/data/segmentation.h"

#include <dirent.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "framefit/data/media.h"

namespace framefit::data {

namespace {

// name without extension -> path, for the regular files of a folder.
std::map<std::string, std::string> files_by_stem(const std::string& dir) {
  DIR* handle = ::opendir(dir.c_str());
  TORCH_CHECK(handle != nullptr, "segmentation data: cannot open folder ", dir);
  std::map<std::string, std::string> files;
  while (const dirent* e = ::readdir(handle)) {
    const std::string file = e->d_name;
    if (file.empty() || file[0] == '.') continue;
    const auto dot = file.rfind('.');
    const std::string stem = dot == std::string::npos ? file : file.substr(0, dot);
    const auto [it, fresh] = files.emplace(stem, dir + "/" + file);
    if (!fresh) {
      ::closedir(handle);
      TORCH_CHECK(false, "segmentation data: ", it->second, " and ", dir + "/" + file,
                  " have the same name; keep one file per sample");
    }
  }
  ::closedir(handle);
  return files;
}

}  // namespace

torch::Tensor resize_labels(const torch::Tensor& labels, int64_t h, int64_t w) {
  if (labels.size(0) == h && labels.size(1) == w) return labels;
  return torch::nn::functional::interpolate(labels.to(torch::kFloat).unsqueeze(0).unsqueeze(0),
                                            torch::nn::functional::InterpolateFuncOptions()
                                                .size(std::vector<int64_t>{h, w})
                                                .mode(torch::kNearest))
      .squeeze(0)
      .squeeze(0)
      .to(torch::kLong);
}

SegmentationDataset::SegmentationDataset(const std::string& images_dir,
                                         const std::string& masks_dir, SegmentationOptions options)
    : options_(options) {
  TORCH_CHECK(options.classes >= 2, "segmentation data: at least 2 classes; got ", options.classes);
  TORCH_CHECK(options.size >= 0, "segmentation data: size must not be negative");
  const auto images = files_by_stem(images_dir);
  // A mask is named as its image, plus options.mask_suffix (ISIC: "_segmentation").
  std::map<std::string, std::string> masks;
  const auto& suffix = options.mask_suffix;
  for (const auto& [stem, mask] : files_by_stem(masks_dir)) {
    const bool suffixed = stem.size() > suffix.size() &&
                          stem.compare(stem.size() - suffix.size(), suffix.size(), suffix) == 0;
    TORCH_CHECK(suffixed, "segmentation data: mask ", mask, " does not end in data.mask_suffix \"",
                suffix, "\"");
    const auto image_stem = stem.substr(0, stem.size() - suffix.size());
    TORCH_CHECK(images.count(image_stem), "segmentation data: mask ", mask, " has no image named ",
                image_stem, " in ", images_dir,
                suffix.empty() && stem.find('_') != std::string::npos
                    ? " (masks named as their image plus a suffix such as _mask: set "
                      "data.mask_suffix)"
                    : "");
    masks.emplace(image_stem, mask);
  }
  for (const auto& [stem, image] : images) {
    const auto m = masks.find(stem);
    TORCH_CHECK(m != masks.end(), "segmentation data: image ", image, " has no mask named ",
                stem + suffix, " in ", masks_dir);
    const auto image_hw = image_size(image);
    const auto mask_hw = image_size(m->second, "mask");
    TORCH_CHECK(image_hw == mask_hw, "segmentation data: image ", image, " is ", image_hw.second,
                "x", image_hw.first, " but its mask ", m->second, " is ", mask_hw.second, "x",
                mask_hw.first);
    items_.push_back({stem, image, m->second, image_hw.first, image_hw.second});
  }
  TORCH_CHECK(!items_.empty(), "segmentation data: no images in ", images_dir);
}

std::pair<int64_t, int64_t> SegmentationDataset::output_size(const Item& item) const {
  if (options_.size > 0) return {options_.size, options_.size};
  return {item.height, item.width};
}

torch::Tensor SegmentationDataset::nearest_ids(const Item& item) const {
  // Compression moves values near edges (Kvasir-SEG's masks hold 0-30 and 220-255 for 0 and
  // 255): each pixel takes the listed value nearest to it, by squared distance over channels.
  const auto& values = options_.values;
  auto rgb = torch::empty({3, item.height, item.width}, torch::kUInt8);
  read_image(item.mask, rgb);
  const bool colour = values.front().size() == 3;
  const auto pixels = colour ? rgb.to(torch::kFloat).view({3, -1}).t()
                             : rgb.to(torch::kFloat).mean(0).view({-1, 1});  // [N, channels]
  std::vector<float> listed;
  for (const auto& v : values) {
    for (const int64_t x : v) listed.push_back(static_cast<float>(x));
  }
  const auto ignore = !colour && options_.ignore_id >= 0;
  if (ignore) listed.push_back(static_cast<float>(options_.ignore_id));
  const int64_t channels = colour ? 3 : 1;
  const auto candidates =
      torch::tensor(listed).view({static_cast<int64_t>(listed.size()) / channels, channels});
  auto ids = torch::cdist(pixels, candidates).argmin(1);
  if (ignore) ids.masked_fill_(ids.eq(static_cast<int64_t>(values.size())), options_.ignore_id);
  return ids.view({item.height, item.width});
}

torch::Tensor SegmentationDataset::read_ids(const Item& item) const {
  const auto& values = options_.values;
  if (values.empty()) return read_label_image(item.mask);
  if (is_jpeg_file(item.mask)) return nearest_ids(item);
  // Each pixel's value as one number (a colour packed as R * 65536 + G * 256 + B), looked up in
  // the listed values, sorted.
  const bool colour = values.front().size() == 3;
  auto pack = [](const std::vector<int64_t>& v) {
    return v.size() == 3 ? (v[0] << 16) | (v[1] << 8) | v[2] : v[0];
  };
  torch::Tensor pixels;
  if (colour) {
    auto rgb = torch::empty({3, item.height, item.width}, torch::kUInt8);
    read_image(item.mask, rgb);
    const auto c = rgb.to(torch::kLong);
    pixels = (c[0] * 65536 + c[1] * 256 + c[2]).flatten();
  } else {
    pixels = read_label_image(item.mask).flatten();
  }
  std::vector<int64_t> packed;
  for (const auto& v : values) packed.push_back(pack(v));
  // The sort's order of the values is the class id of each sorted value.
  const auto [keys, class_of_key] = torch::tensor(packed, torch::kLong).sort();
  const auto at = torch::searchsorted(keys, pixels).clamp_max(keys.size(0) - 1);
  auto found = keys.index_select(0, at).eq(pixels);
  auto ids = class_of_key.index_select(0, at);
  if (!colour && options_.ignore_id >= 0) {
    const auto ignored = pixels.eq(options_.ignore_id);
    ids.masked_fill_(ignored, options_.ignore_id);
    found.logical_or_(ignored);
  }
  if (!found.all().item<bool>()) {
    const int64_t first = found.logical_not().nonzero()[0][0].item<int64_t>();
    const int64_t value = pixels[first].item<int64_t>();
    const auto shown =
        colour ? c10::str("RGB ", value >> 16, ",", (value >> 8) & 255, ",", value & 255)
               : c10::str(value);
    TORCH_CHECK(false, "segmentation data: mask ", item.mask, " has value ", shown,
                " at x=", first % item.width, " y=", first / item.width,
                ", which data.mask_values does not list",
                colour ? "" : " (nor is it data.ignore_id)");
  }
  return ids.view({item.height, item.width});
}

torch::Tensor SegmentationDataset::mask(int64_t i) const {
  const auto& item = items_.at(static_cast<size_t>(i));
  const auto [h, w] = output_size(item);
  // Masks are read at their own size and resized by nearest neighbour: class ids never blend.
  const auto mask = resize_labels(read_ids(item), h, w);
  const auto outside = mask.ge(options_.classes).logical_and(mask.ne(options_.ignore_id));
  if (outside.any().item<bool>()) {
    const int64_t id = mask.masked_select(outside).max().item<int64_t>();
    TORCH_CHECK(false, "segmentation data: mask ", item.mask, " has class id ", id,
                " but there are ", options_.classes, " classes (ids 0..", options_.classes - 1, ")",
                options_.ignore_id >= 0 ? c10::str(" and ignore id ", options_.ignore_id) : "",
                options_.ignore_id < 0 && id == 255
                    ? "; if 255 marks pixels to leave out (object borders, unlabelled), set "
                      "data.ignore_id: 255; if the mask is binary, stored as 0 and 255, set "
                      "data.mask_values: [0, 255]"
                    : "");
  }
  return mask;
}

std::pair<torch::Tensor, torch::Tensor> SegmentationDataset::load(int64_t i) const {
  const auto& item = items_.at(static_cast<size_t>(i));
  const auto [h, w] = output_size(item);
  auto image = torch::empty({3, h, w}, torch::kUInt8);
  read_image(item.image, image);
  return {image, mask(i)};
}

std::pair<torch::Tensor, torch::Tensor> SegmentationDataset::batch(
    const std::vector<int64_t>& indices) const {
  TORCH_CHECK(!indices.empty(), "segmentation data: an empty batch");
  std::vector<torch::Tensor> images, masks;
  for (int64_t i : indices) {
    auto [image, mask] = load(i);
    TORCH_CHECK(images.empty() || image.sizes() == images.front().sizes(),
                "segmentation data: ", name(i), " is ", image.size(2), "x", image.size(1),
                ", unlike the rest of its batch; set a size to resize every sample");
    images.push_back(image);
    masks.push_back(mask);
  }
  return {torch::stack(images), torch::stack(masks)};
}

}  // namespace framefit::data
