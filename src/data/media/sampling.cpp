// Which source frames a video's sampling takes, and the size frames are resized to: no decoding.
#include "framefit/data/media.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>

namespace framefit::data {

std::vector<int64_t> sample_indices(int64_t source_frames, double source_fps, double target_fps) {
  TORCH_CHECK(source_frames >= 0, "sample_indices: source_frames must be >= 0, got ",
              source_frames);
  std::vector<int64_t> indices;
  if (target_fps <= 0 || target_fps >= source_fps) {
    indices.resize(static_cast<size_t>(source_frames));
    for (int64_t i = 0; i < source_frames; ++i) indices[static_cast<size_t>(i)] = i;
    return indices;
  }
  TORCH_CHECK(source_fps > 0 && std::isfinite(source_fps),
              "sample_indices: source_fps must be a positive frame rate, got ", source_fps);
  // The small slack keeps exact ratios (50 frames at 25 -> 5 fps: 10 frames; 1.5 + 0.5 rounds up)
  // exact despite floating-point error.
  constexpr double kSlack = 1e-9;
  const auto count =
      static_cast<int64_t>(std::ceil(source_frames * target_fps / source_fps - kSlack));
  indices.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const auto j = static_cast<int64_t>(std::floor(i * source_fps / target_fps + 0.5 + kSlack));
    indices.push_back(std::min(j, source_frames - 1));
  }
  return indices;
}

std::vector<int64_t> sample_times(const std::vector<double>& times, double end_seconds,
                                  double target_fps) {
  TORCH_CHECK(std::is_sorted(times.begin(), times.end()),
              "sample_times: the frame times must be ascending");
  std::vector<int64_t> indices;
  const auto n = static_cast<int64_t>(times.size());
  if (target_fps <= 0 || n == 0) {
    indices.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) indices[static_cast<size_t>(i)] = i;
    return indices;
  }
  TORCH_CHECK(std::isfinite(target_fps) && std::isfinite(end_seconds),
              "sample_times: the frame rate and the end must be finite, got ", target_fps, " and ",
              end_seconds);
  constexpr double kSlack = 1e-9;  // as in sample_indices: exact ratios stay exact
  int64_t j = 0;                   // the last frame at or before the current time
  for (int64_t i = 0;; ++i) {
    const double t = times.front() + static_cast<double>(i) / target_fps;
    if (t >= end_seconds - kSlack) break;
    while (j + 1 < n && times[j + 1] <= t + kSlack) ++j;
    const bool later = j + 1 < n && times[j + 1] - t <= t - times[j] + kSlack;
    indices.push_back(later ? j + 1 : j);
  }
  return indices;
}

bool is_jpeg_file(const std::string& path) {
  unsigned char magic[3] = {0, 0, 0};
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return false;
  const size_t n = std::fread(magic, 1, sizeof(magic), file);
  std::fclose(file);
  return n == 3 && magic[0] == 0xFF && magic[1] == 0xD8 && magic[2] == 0xFF;
}

std::pair<int64_t, int64_t> resized_hw(int64_t height, int64_t width, int64_t shorter_side) {
  TORCH_CHECK(height > 0 && width > 0, "resized_hw: the source size must be positive, got ", height,
              "x", width, " (height x width)");
  if (shorter_side <= 0) return {height, width};
  // round(longer * shorter_side / shorter) with halves up, in integers.
  auto scale = [&](int64_t longer, int64_t shorter) {
    return std::max<int64_t>(1, (2 * longer * shorter_side + shorter) / (2 * shorter));
  };
  if (height <= width) return {shorter_side, scale(width, height)};
  return {scale(height, width), shorter_side};
}
}  // namespace framefit::data
