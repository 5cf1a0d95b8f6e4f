#include "framefit/train/timeline.h"

#include <torch/torch.h>

namespace framefit::train {

std::array<uint8_t, 3> class_color(int64_t c) {
  // matplotlib's tab20: each hue dark then light.
  static constexpr std::array<std::array<uint8_t, 3>, 20> kTab20 = {{
      {31, 119, 180}, {174, 199, 232}, {255, 127, 14}, {255, 187, 120}, {44, 160, 44},
      {152, 223, 138}, {214, 39, 40},  {255, 152, 150}, {148, 103, 189}, {197, 176, 213},
      {140, 86, 75},  {196, 156, 148}, {227, 119, 194}, {247, 182, 210}, {127, 127, 127},
      {199, 199, 199}, {188, 189, 34}, {219, 219, 141}, {23, 190, 207},  {158, 218, 229},
  }};
  TORCH_CHECK(c >= 0, "class_color: class ids are >= 0, got ", c);
  return kTab20[static_cast<size_t>(c % 20)];
}

torch::Tensor timeline_image(const std::vector<torch::Tensor>& rows, int64_t max_width,
                             int64_t row_height) {
  TORCH_CHECK(!rows.empty(), "timeline_image: no rows to draw");
  TORCH_CHECK(max_width >= 1 && row_height >= 1, "timeline_image: max_width and row_height must "
              "be >= 1, got ", max_width, " and ", row_height);
  const int64_t frames = rows.front().numel();
  TORCH_CHECK(frames > 0, "timeline_image: the rows are empty");
  for (const auto& row : rows) {
    TORCH_CHECK(row.dim() == 1 && row.numel() == frames, "timeline_image: every row must be [",
                frames, "] class ids, got ", row.sizes());
  }
  constexpr int64_t kGap = 4;
  const int64_t width = std::min(frames, max_width);
  const auto count = static_cast<int64_t>(rows.size());
  const int64_t height = count * row_height + (count - 1) * kGap;
  auto image = torch::full({3, height, width}, 255, torch::kUInt8);
  auto pixels = image.accessor<uint8_t, 3>();
  for (int64_t r = 0; r < count; ++r) {
    const auto ids = rows[static_cast<size_t>(r)].to(torch::kLong).contiguous();
    const auto* id = ids.data_ptr<int64_t>();
    for (int64_t x = 0; x < width; ++x) {
      // The frame at the column's centre.
      const int64_t t = std::min(frames - 1, (2 * x + 1) * frames / (2 * width));
      const std::array<uint8_t, 3> gray = {220, 220, 220};
      const auto color = id[t] < 0 ? gray : class_color(id[t]);
      for (int64_t y = r * (row_height + kGap); y < r * (row_height + kGap) + row_height; ++y) {
        for (int64_t ch = 0; ch < 3; ++ch) pixels[ch][y][x] = color[static_cast<size_t>(ch)];
      }
    }
  }
  return image;
}

}  // namespace framefit::train
