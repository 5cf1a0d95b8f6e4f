#include "framefit/data/dataset.h"

#include <dirent.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <numeric>
#include <random>

#include "framefit/data/media.h"
#include "framefit/memory/tracker.h"

namespace framefit::data {

namespace {

// splitmix64: turns (seed, epoch, video) into independent generator seeds.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool is_image_name(const std::string& name) {
  const auto dot = name.rfind('.');
  if (dot == std::string::npos) return false;
  std::string ext = name.substr(dot + 1);
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext == "jpg" || ext == "jpeg" || ext == "png" || ext == "bmp" || ext == "webp" ||
         ext == "tif" || ext == "tiff";
}

// The number at the end of a file name's stem ("frame_000123.jpg" -> 123), or -1.
int64_t trailing_number(const std::string& name) {
  const auto dot = name.rfind('.');
  const std::string stem = name.substr(0, dot);
  size_t begin = stem.size();
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(stem[begin - 1]))) --begin;
  if (begin == stem.size() || stem.size() - begin > 18) return -1;
  return std::stoll(stem.substr(begin));
}

// A frame folder's images in frame order, numbered consecutively where numbered. When every name
// ends in a number they are ordered by it, so unpadded names (ffmpeg's frame_%d.jpg: frame_9,
// frame_10) keep their order; a number given twice (5.jpg beside 000005.jpg) or a gap (a missing
// frame, which would shift every later label by one) is an error. Otherwise name order is all
// there is.
std::vector<std::string> list_frames(const std::string& folder) {
  auto paths = list_images(folder);
  std::vector<std::pair<int64_t, std::string>> numbered;  // (number, name)
  for (const auto& p : paths) {
    const auto name = p.substr(folder.size() + 1);
    const int64_t number = trailing_number(name);
    if (number < 0) return paths;
    numbered.emplace_back(number, name);
  }
  std::stable_sort(numbered.begin(), numbered.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < numbered.size(); ++i) {
    const auto& [previous, previous_name] = numbered[i - 1];
    const auto& [current, name] = numbered[i];
    TORCH_CHECK(current != previous, "frame folder ", folder, ": ", previous_name, " and ", name,
                " are both frame ", current, "; keep one image per frame number");
    TORCH_CHECK(current == previous + 1, "frame folder ", folder, ": frame ", previous + 1,
                " is missing (", previous_name, " is followed by ", name,
                "); every frame needs its image for the labels to line up");
  }
  for (size_t i = 0; i < numbered.size(); ++i) paths[i] = folder + "/" + numbered[i].second;
  return paths;
}

}  // namespace

// POSIX listing: pip's LibTorch exports its own std::filesystem, which crashed our directory
// walks when linked against it.
std::vector<std::string> list_images(const std::string& folder) {
  DIR* dir = ::opendir(folder.c_str());
  TORCH_CHECK(dir != nullptr, "image folder ", folder, ": cannot open");
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name[0] != '.' && is_image_name(name)) names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  for (auto& n : names) n = folder + "/" + n;
  return names;
}

Augmentation draw_augmentation(const TransformOptions& options, int64_t height, int64_t width,
                               uint64_t seed, int64_t epoch, int64_t video) {
  Augmentation a;
  std::mt19937_64 rng(
      mix(mix(mix(seed) ^ static_cast<uint64_t>(epoch)) ^ static_cast<uint64_t>(video)));
  if (options.random_crop && options.crop > 0) {
    a.top = static_cast<int64_t>(rng() % static_cast<uint64_t>(height - options.crop + 1));
    a.left = static_cast<int64_t>(rng() % static_cast<uint64_t>(width - options.crop + 1));
  }
  if (options.flip) a.flip = (rng() & 1) != 0;
  // Drawn after crop and flip, so those stay what they were without jitter.
  const auto uniform = [&rng](double low, double high) {
    return low + (high - low) * static_cast<double>(rng() >> 11) * 0x1.0p-53;
  };
  const auto factor = [&](double x) { return x > 0 ? uniform(std::max(0.0, 1 - x), 1 + x) : 1.0; };
  if (options.brightness > 0 || options.contrast > 0 || options.saturation > 0 || options.hue > 0) {
    for (int i = 3; i > 0; --i) {
      std::swap(a.jitter_order[i], a.jitter_order[rng() % static_cast<uint64_t>(i + 1)]);
    }
    a.brightness = factor(options.brightness);
    a.contrast = factor(options.contrast);
    a.saturation = factor(options.saturation);
    a.hue = options.hue > 0 ? uniform(-options.hue, options.hue) : 0.0;
  }
  if (options.rotation > 0) a.degrees = uniform(-options.rotation, options.rotation);
  return a;
}

namespace {

// torchvision's _blend on uint8: ratio * a + (1 - ratio) * b in float, clamped, truncated.
torch::Tensor blend(const torch::Tensor& a, const torch::Tensor& b, double ratio) {
  return a.mul(ratio).add(b.mul(1.0 - ratio)).clamp(0, 255).to(torch::kUInt8);
}

// [N,1,H,W] uint8 luma, truncated as torchvision's rgb_to_grayscale does.
torch::Tensor gray(const torch::Tensor& rgb) {
  const auto c = rgb.unbind(1);
  return c[0].mul(0.2989).add(c[1].mul(0.587)).add(c[2].mul(0.114)).to(torch::kUInt8).unsqueeze(1);
}

// Hue shifted by `shift` turns through HSV, pixel by pixel, with the float operations of
// torchvision's adjust_hue (its _rgb2hsv, the shift, its _hsv2rgb) in their order, so the bytes
// are its bytes (AugmentationParity); one pass instead of its thirty-odd tensor temporaries. The
// build keeps the compiler from fusing a multiply and an add (-ffp-contract=off).
torch::Tensor shift_hue(const torch::Tensor& rgb8, double shift) {
  const auto in = rgb8.contiguous();
  auto out = torch::empty_like(in);
  const int64_t plane = in.size(2) * in.size(3);
  const auto* src = in.data_ptr<uint8_t>();
  auto* dst = out.data_ptr<uint8_t>();
  const auto h_shift = static_cast<float>(shift);
  for (int64_t n = 0; n < in.size(0); ++n) {
    const uint8_t* s = src + n * 3 * plane;
    uint8_t* d = dst + n * 3 * plane;
    for (int64_t k = 0; k < plane; ++k) {
      const float r = static_cast<float>(s[k]) / 255.0f;
      const float g = static_cast<float>(s[plane + k]) / 255.0f;
      const float b = static_cast<float>(s[2 * plane + k]) / 255.0f;
      const float maxc = std::max(std::max(r, g), b), minc = std::min(std::min(r, g), b);
      const bool equal = maxc == minc;
      const float range = maxc - minc;
      const float sat = range / (equal ? 1.0f : maxc);
      const float divisor = equal ? 1.0f : range;
      const float rc = (maxc - r) / divisor, gc = (maxc - g) / divisor, bc = (maxc - b) / divisor;
      const float hr = static_cast<float>(maxc == r) * (bc - gc);
      const float hg = static_cast<float>(maxc == g && maxc != r) * (2.0f + rc - bc);
      const float hb = static_cast<float>(maxc != g && maxc != r) * (4.0f + gc - rc);
      // fmod(x, 1) and torch.remainder(x, 1), for x in [5/6, 11/6] and [-0.5, 1.5): x - 1 is
      // exact for x in [1, 2), so these branches give fmod's results without its cost.
      float h = (hr + hg + hb) / 6.0f + 1.0f;
      if (h >= 1.0f) h -= 1.0f;
      h += h_shift;
      if (h >= 1.0f) h -= 1.0f;
      if (h < 0.0f) h += 1.0f;
      const float sector = std::floor(h * 6.0f);
      const float f = h * 6.0f - sector;
      const int i = (static_cast<int>(sector) % 6 + 6) % 6;
      const float v = maxc;
      const float p = std::min(std::max(v * (1.0f - sat), 0.0f), 1.0f);
      const float q = std::min(std::max(v * (1.0f - sat * f), 0.0f), 1.0f);
      const float t = std::min(std::max(v * (1.0f - sat * (1.0f - f)), 0.0f), 1.0f);
      const float red[6] = {v, q, p, p, t, v}, green[6] = {t, v, v, q, p, p},
                  blue[6] = {p, p, t, v, v, q};
      d[k] = static_cast<uint8_t>(red[i] * 255.0f);
      d[plane + k] = static_cast<uint8_t>(green[i] * 255.0f);
      d[2 * plane + k] = static_cast<uint8_t>(blue[i] * 255.0f);
    }
  }
  return out;
}

using FrameTransform = std::function<torch::Tensor(const torch::Tensor&)>;

// `apply` to uint8 RGB frames [T,3,H,W] 16 at a time, which bounds its temporaries, into `out`
// (a new tensor by default; `frames` itself transforms them in place); `what` names the
// transform in the error for other frames.
torch::Tensor in_pieces(const torch::Tensor& frames, const char* what, const FrameTransform& apply,
                        torch::Tensor out = {}) {
  TORCH_CHECK(frames.dim() == 4 && frames.size(1) == 3 && frames.scalar_type() == torch::kUInt8,
              what, " expects uint8 RGB frames [T,3,H,W], got ", frames.sizes(), " ",
              frames.scalar_type());
  constexpr int64_t kFramesAtOnce = 16;
  if (!out.defined()) out = torch::empty_like(frames);
  for (int64_t start = 0; start < frames.size(0); start += kFramesAtOnce) {
    const int64_t count = std::min(kFramesAtOnce, frames.size(0) - start);
    out.narrow(0, start, count).copy_(apply(frames.narrow(0, start, count)));
  }
  return out;
}

// torchvision's sampling grid [1,h,w,2] of a rotation by `degrees` about the centre: its inverse
// affine matrix of a rotation by -degrees, over pixel centres normalised by the half sizes.
torch::Tensor rotation_grid(int64_t h, int64_t w, double degrees) {
  const double turn = -degrees * (M_PI / 180.0);
  const auto theta =
      torch::tensor({std::cos(turn), std::sin(turn), 0.0, -std::sin(turn), std::cos(turn), 0.0},
                    torch::kFloat32)
          .reshape({1, 2, 3});
  auto base = torch::empty({1, h, w, 3}, torch::kFloat32);
  base.select(3, 0).copy_(torch::linspace(-w * 0.5 + 0.5, w * 0.5 + 0.5 - 1, w));
  base.select(3, 1).copy_(torch::linspace(-h * 0.5 + 0.5, h * 0.5 + 0.5 - 1, h).unsqueeze(-1));
  base.select(3, 2).fill_(1);
  const auto scaled = theta.transpose(1, 2) / torch::tensor({0.5 * w, 0.5 * h}, torch::kFloat32);
  return base.view({1, h * w, 3}).bmm(scaled).view({1, h, w, 2});
}

// Nearest sampling of float images [N,C,H,W] along `grid`, zeros outside.
torch::Tensor sample_nearest(const torch::Tensor& images, const torch::Tensor& grid) {
  return torch::grid_sampler(images, grid.expand({images.size(0), grid.size(1), grid.size(2), 2}),
                             /*interpolation_mode=nearest*/ 1, /*padding_mode=zeros*/ 0,
                             /*align_corners=*/false);
}

// A rotation of `frames`' pieces by `degrees`.
FrameTransform rotation(const torch::Tensor& frames, double degrees) {
  const auto grid =
      frames.dim() == 4 ? rotation_grid(frames.size(2), frames.size(3), degrees) : torch::Tensor();
  return [grid](const torch::Tensor& x) {
    // Nearest sampling with zeros outside is torchvision's fill 0 (its mask channel, sampled
    // the same way, is 0 exactly where the zeros come from).
    return sample_nearest(x.to(torch::kFloat32), grid).round().to(torch::kUInt8);
  };
}

}  // namespace

torch::Tensor rotate_frames(const torch::Tensor& frames, double degrees) {
  return in_pieces(frames, "rotation", rotation(frames, degrees));
}

torch::Tensor rotate_mask(const torch::Tensor& mask, double degrees, int64_t fill) {
  TORCH_CHECK(mask.dim() == 2, "rotate_mask expects class ids [H,W], got ", mask.sizes());
  // The ids and a plane of ones, sampled alike: where the ones are gone, the source was outside.
  const auto planes =
      torch::stack({mask.to(torch::kFloat32), torch::ones(mask.sizes())}).unsqueeze(0);
  const auto turned = sample_nearest(planes, rotation_grid(mask.size(0), mask.size(1), degrees))[0];
  return torch::where(turned[1] < 0.5, torch::full_like(turned[0], static_cast<double>(fill)),
                      turned[0])
      .round()
      .to(torch::kLong);
}

void check_mask_rotation(double degrees, int64_t ignore_id) {
  TORCH_CHECK(degrees == 0 || ignore_id >= 0,
              "data.rotation turns the masks too, and their corners then show nothing: set "
              "data.ignore_id (e.g. 255) so those pixels count in neither the loss nor the "
              "metrics");
}

std::pair<torch::Tensor, torch::Tensor> augment_image(torch::Tensor image, torch::Tensor mask,
                                                      const Augmentation& a, int64_t ignore_id) {
  if (a.flip) {
    image = image.flip({2}).contiguous();
    mask = mask.flip({1}).contiguous();
  }
  if (a.jitters()) image = adjust_colors(image.unsqueeze(0), a)[0];
  if (a.degrees != 0) {
    check_mask_rotation(a.degrees, ignore_id);
    image = rotate_frames(image.unsqueeze(0), a.degrees)[0];
    mask = rotate_mask(mask, a.degrees, ignore_id);
  }
  return {image, mask};
}

namespace {

// Colour jitter of frames' pieces, as torchvision's ColorJitter in `a`'s order.
FrameTransform color_jitter(const Augmentation& a) {
  TORCH_CHECK(
      a.brightness >= 0 && a.contrast >= 0 && a.saturation >= 0 && a.hue >= -0.5 && a.hue <= 0.5,
      "colour jitter factors must be >= 0 and the hue shift within [-0.5, 0.5]");
  return [a](torch::Tensor x) {
    for (const int step : a.jitter_order) {
      if (step == 0 && a.brightness != 1) {
        x = blend(x, torch::zeros_like(x), a.brightness);
      } else if (step == 1 && a.contrast != 1) {
        x = blend(x, gray(x).to(torch::kFloat32).mean({1, 2, 3}, true), a.contrast);
      } else if (step == 2 && a.saturation != 1) {
        x = blend(x, gray(x), a.saturation);
      } else if (step == 3 && a.hue != 0) {
        x = shift_hue(x, a.hue);
      }
    }
    return x;
  };
}

}  // namespace

torch::Tensor adjust_colors(const torch::Tensor& frames, const Augmentation& a) {
  return in_pieces(frames, "colour jitter", color_jitter(a));
}

std::vector<int64_t> epoch_order(int64_t count, uint64_t seed, int64_t epoch, bool shuffle) {
  std::vector<int64_t> order(count);
  for (int64_t i = 0; i < count; ++i) order[i] = i;
  if (!shuffle) return order;
  std::mt19937_64 rng(mix(mix(seed) ^ mix(static_cast<uint64_t>(epoch) + 1)));
  for (int64_t i = count - 1; i > 0; --i) {
    std::swap(order[i], order[rng() % static_cast<uint64_t>(i + 1)]);
  }
  return order;
}

VideoDataset::VideoDataset(std::vector<VideoEntry> entries, ClassList classes, DataOptions options,
                           const std::function<void(const std::string&)>& on_warning)
    : classes_(std::move(classes)), options_(options) {
  TORCH_CHECK(classes_.size() > 0, "a data set needs a class list (data.classes)");
  TORCH_CHECK(options_.fps >= 0, "data.fps must be >= 0 (0 keeps every frame), got ", options_.fps);
  TORCH_CHECK(options_.transform.resize >= 0 && options_.transform.crop >= 0,
              "data.resize and data.crop must be >= 0");
  const auto& t = options_.transform;
  TORCH_CHECK(
      t.brightness >= 0 && t.contrast >= 0 && t.saturation >= 0 && t.hue >= 0 && t.hue <= 0.5,
      "data.brightness, data.contrast and data.saturation must be >= 0 and data.hue "
      "within [0, 0.5], got ",
      t.brightness, ", ", t.contrast, ", ", t.saturation, ", ", t.hue);
  TORCH_CHECK(t.rotation >= 0 && t.rotation <= 180,
              "data.rotation must be within [0, 180] degrees, got ", t.rotation);
  TORCH_CHECK(options_.features_stride >= 1,
              "data.features_stride must be >= 1 (1 takes every row), got ",
              options_.features_stride);
  int64_t total = 0;
  for (auto& entry : entries) {
    try {
      auto item = options_.features ? probe_features(entry) : probe(entry);
      TORCH_CHECK(feature_dim_ == 0 || item.feature_dim == feature_dim_, "features file ",
                  entry.features, " has ", item.feature_dim, " features per frame where ",
                  videos_.front().entry.features, " has ", feature_dim_,
                  ": every video's features must come from the same encoder");
      if (feature_dim_ == 0) feature_dim_ = item.feature_dim;
      videos_.push_back(std::move(item));
    } catch (const c10::Error& e) {
      if (!skips_error(options_.skip_bad, e)) throw;
      ++skipped_;
      if (on_warning)
        on_warning(std::string("skipping video ") + entry.name + ": " + e.what_without_backtrace());
      continue;
    }
    total += static_cast<int64_t>(videos_.back().sampled.size());
    offsets_.push_back(total);
  }
}

namespace {

// What decoding a video needs to know: its frames (file or folder), rate and size.
struct Source {
  std::string path;
  std::vector<std::string> frame_files;  // a frame folder's images, sorted
  int64_t frames = 0;
  double fps = 0;
  int64_t height = 0, width = 0;  // as displayed
  // The frame times of a variable-rate video or one whose container does not count its frames
  // (VideoReader::frame_times); empty otherwise.
  VideoReader::FrameTimes times;
};

Source open_source(const std::string& path, double folder_fps, double sample_fps) {
  Source source;
  source.path = path;
  if (is_directory(path)) {
    source.frame_files = list_frames(path);
    TORCH_CHECK(!source.frame_files.empty(), "frame folder ", path,
                ": no frame images (.jpg, .jpeg, .png, .bmp, .webp, .tif, .tiff)");
    source.frames = static_cast<int64_t>(source.frame_files.size());
    source.fps = folder_fps;
    TORCH_CHECK(sample_fps == 0 || source.fps > 0, "frame folder ", path,
                ": its frame rate is unknown; give it in the manifest's fps column (or --fps)");
    std::tie(source.height, source.width) = image_size(source.frame_files.front());
  } else {
    VideoReader reader(path);
    const auto& info = reader.info();
    source.frames = info.frames;
    source.fps = info.fps;
    source.height = info.height;
    source.width = info.width;
    if (info.frames_estimated) {
      source.times = reader.frame_times();
      source.frames = static_cast<int64_t>(source.times.seconds.size());
    } else if (info.variable_rate) {
      source.times = reader.frame_times();
      // A container whose packets and frame count disagree keeps the average rate.
      if (static_cast<int64_t>(source.times.seconds.size()) != source.frames) source.times = {};
    }
  }
  return source;
}

// The source frames sampling at `target_fps` keeps: by time where the frames have their own
// times, else by index at the average rate.
std::vector<int64_t> sampled_frames(const Source& source, double target_fps) {
  if (!source.times.seconds.empty()) {
    return sample_times(source.times.seconds, source.times.end_seconds, target_fps);
  }
  return sample_indices(source.frames, source.fps, target_fps);
}

double seconds_of(const Source& source, int64_t frame) {
  if (!source.times.seconds.empty()) return source.times.seconds[static_cast<size_t>(frame)];
  return source.fps > 0 ? static_cast<double>(frame) / source.fps : 0;
}

// One label per source frame from an annotation of its own rate, by the frames' times; the two
// must last as long, within a frame of each.
std::vector<int64_t> labels_by_time(const VideoEntry& entry, const Source& source,
                                    const std::vector<int64_t>& labels, double labels_fps) {
  const bool timed = !source.times.seconds.empty();
  TORCH_CHECK(timed || source.fps > 0, "frame folder ", entry.video, ": labels_fps ", labels_fps,
              " maps its labels by time, which needs the folder's frame rate: give it in the "
              "manifest's fps column");
  std::vector<double> seconds;
  for (int64_t i = 0; i < source.frames; ++i) seconds.push_back(seconds_of(source, i));
  const double video_seconds =
      timed ? source.times.end_seconds : static_cast<double>(source.frames) / source.fps;
  const double labels_seconds = static_cast<double>(labels.size()) / labels_fps;
  const double tolerance =
      1 / labels_fps + video_seconds / static_cast<double>(std::max<int64_t>(1, source.frames));
  TORCH_CHECK(std::abs(video_seconds - labels_seconds) <= tolerance, "annotation file ",
              entry.labels, " has ", labels.size(), " frames at labels_fps ", labels_fps, " (",
              labels_seconds, " s) but ", entry.video, " lasts ", video_seconds, " s (",
              source.frames, " frames): they must describe the same time");
  return labels_at_times(labels, labels_fps, seconds);
}

// Decodes `sampled` source frames at (height, width), cropped as they are converted, then flips,
// jitters and rotates them in place: a video is held once, at its cropped size, while decoded.
// The window data.crop takes of frames resized to height x width (the augmentation's offset, else
// the centre); out_height and out_width: the frames' size after it.
FrameWindow crop_window(int64_t height, int64_t width, const DataOptions& options,
                        const Augmentation& augmentation, int64_t& out_height, int64_t& out_width) {
  FrameWindow window;
  out_height = height;
  out_width = width;
  const int64_t crop = options.transform.crop;
  if (crop > 0 && (crop != height || crop != width)) {
    window.height = height;
    window.width = width;
    window.top = augmentation.top >= 0 ? augmentation.top : (height - crop) / 2;
    window.left = augmentation.left >= 0 ? augmentation.left : (width - crop) / 2;
    TORCH_CHECK(window.top + crop <= height && window.left + crop <= width,
                "crop offset outside the frame");
    out_height = out_width = crop;
  }
  return window;
}

torch::Tensor decode_source(const Source& source, const std::vector<int64_t>& sampled,
                            int64_t height, int64_t width, const DataOptions& options,
                            const Augmentation& augmentation) {
  const int64_t t = static_cast<int64_t>(sampled.size());
  int64_t out_height = 0, out_width = 0;
  const auto window = crop_window(height, width, options, augmentation, out_height, out_width);
  auto frames = torch::empty({t, 3, out_height, out_width},
                             torch::TensorOptions(torch::kUInt8).pinned_memory(options.pinned));
  if (!source.frame_files.empty()) {
    for (int64_t k = 0; k < t; ++k) read_image(source.frame_files[sampled[k]], frames[k], window);
  } else {
    VideoReader reader(source.path, options.decoder_threads, options.skip_unsampled);
    reader.read(sampled, frames, window);
  }
  if (augmentation.flip) {
    in_pieces(
        frames, "flip", [](const torch::Tensor& x) { return x.flip({3}); }, frames);
  }
  if (augmentation.jitters()) {
    in_pieces(frames, "colour jitter", color_jitter(augmentation), frames);
  }
  if (augmentation.degrees != 0) {
    in_pieces(frames, "rotation", rotation(frames, augmentation.degrees), frames);
  }
  return frames;
}

// decode_source without augmentation, `piece` frames at a time into one buffer.
void decode_source_pieces(const Source& source, const std::vector<int64_t>& sampled, int64_t height,
                          int64_t width, const DataOptions& options, int64_t piece,
                          const FramesCallback& on_frames) {
  TORCH_CHECK(piece > 0, "frames are decoded at least one at a time; got pieces of ", piece);
  const int64_t t = static_cast<int64_t>(sampled.size());
  if (t == 0) return;
  int64_t out_height = 0, out_width = 0;
  const auto window = crop_window(height, width, options, {}, out_height, out_width);
  // Pageable, not pinned: the buffer is overwritten as soon as on_frames returns, and a copy
  // to a device from pinned memory (non_blocking) may still be reading it then; one from
  // pageable memory has taken the data when it returns.
  auto buffer = torch::empty({std::min(piece, t), 3, out_height, out_width}, torch::kUInt8);
  const auto hand_on = [&](int64_t count) { on_frames(buffer.narrow(0, 0, count)); };
  if (!source.frame_files.empty()) {
    for (int64_t k = 0; k < t; ++k) {
      read_image(source.frame_files[sampled[k]], buffer[k % piece], window);
      if ((k + 1) % piece == 0 || k + 1 == t) hand_on(k % piece + 1);
    }
  } else {
    VideoReader reader(source.path, options.decoder_threads, options.skip_unsampled);
    reader.read_pieces(sampled, buffer, hand_on, window);
  }
}

void check_crop(const std::string& path, int64_t crop, int64_t height, int64_t width) {
  TORCH_CHECK(crop <= std::min(height, width), "video ", path, ": crop ", crop,
              " is larger than its frames (", height, "x", width,
              " after resizing); lower data.crop or raise data.resize");
}

}  // namespace

namespace {
// decode_video's sampled frames, their times and checks; `decode(source, out, height, width)`
// decodes the frames resized to height x width.
template <typename Decode>
DecodedVideo sampled_video(const std::string& path, double folder_fps, const DataOptions& options,
                           const Decode& decode) {
  const auto source = open_source(path, folder_fps, options.fps);
  DecodedVideo out;
  out.source_fps = source.fps;
  out.source_frames = sampled_frames(source, options.fps);
  for (const int64_t frame : out.source_frames)
    out.source_seconds.push_back(seconds_of(source, frame));
  const auto [height, width] = resized_hw(source.height, source.width, options.transform.resize);
  check_crop(path, options.transform.crop, height, width);
  decode(source, out, height, width);
  return out;
}
}  // namespace

DecodedVideo decode_video(const std::string& path, double folder_fps, const DataOptions& options) {
  return sampled_video(path, folder_fps, options,
                       [&](const Source& source, DecodedVideo& out, int64_t height, int64_t width) {
                         out.frames =
                             decode_source(source, out.source_frames, height, width, options, {});
                       });
}

DecodedVideo decode_video_pieces(const std::string& path, double folder_fps,
                                 const DataOptions& options, int64_t piece,
                                 const FramesCallback& on_frames) {
  return sampled_video(path, folder_fps, options,
                       [&](const Source& source, DecodedVideo& out, int64_t height, int64_t width) {
                         decode_source_pieces(source, out.source_frames, height, width, options,
                                              piece, on_frames);
                       });
}

VideoDataset::Item VideoDataset::probe(const VideoEntry& entry) const {
  const auto source = open_source(entry.video, entry.fps, options_.fps);
  Item item;
  item.entry = entry;
  item.frame_files = source.frame_files;
  item.labels = read_phase_annotations(entry.labels, classes_);
  const double labels_fps = entry.labels_fps > 0 ? entry.labels_fps : options_.labels_fps;
  const auto count = static_cast<int64_t>(item.labels.size());
  std::vector<int64_t> annotation_frames(static_cast<size_t>(count));
  std::iota(annotation_frames.begin(), annotation_frames.end(), 0);
  if (labels_fps > 0) {
    // Each source frame's annotation frame, by time; its label follows.
    annotation_frames = labels_by_time(entry, source, annotation_frames, labels_fps);
    std::vector<int64_t> labels;
    for (const int64_t a : annotation_frames) labels.push_back(item.labels[a]);
    item.labels = std::move(labels);
  } else {
    // Many times more labels than frames: frames extracted at a lower rate than annotated.
    const std::string hint =
        count >= 2 * source.frames
            ? "; if the annotation has its own frame rate (Cholec80's is 25 fps, for frames "
              "extracted at 1 fps), give it as labels_fps (manifest column or data.labels_fps)"
            : "";
    TORCH_CHECK(count == source.frames, "annotation file ", entry.labels, " has ", count,
                " frames but ", entry.video, " has ", source.frames,
                ": they must describe the same frames", hint);
  }
  item.sampled = sampled_frames(source, options_.fps);
  for (const int64_t frame : item.sampled) item.seconds.push_back(seconds_of(source, frame));
  read_tools(item, annotation_frames, count);
  std::tie(item.height, item.width) =
      resized_hw(source.height, source.width, options_.transform.resize);
  check_crop(entry.video, options_.transform.crop, item.height, item.width);
  return item;
}

VideoDataset::Item VideoDataset::probe_features(const VideoEntry& entry) const {
  TORCH_CHECK(!entry.features.empty(), "video ", entry.name,
              " has no features file: the manifest's `features` column names each video's "
              "precomputed features (.npy or .pt) for a model that reads them");
  Item item;
  item.entry = entry;
  const auto labels = read_phase_annotations(entry.labels, classes_);
  const auto count = static_cast<int64_t>(labels.size());
  const auto shape = feature_file_shape(entry.features);
  check_feature_shape(shape, entry.features);
  const double labels_fps = entry.labels_fps > 0 ? entry.labels_fps : options_.labels_fps;
  const auto rows = [&] { return shape[item.time_first ? 0 : 1]; };
  if (labels_fps > 0) {
    // Rows and labels at their own rates (Cholec80's 25 fps phases for features at 1 fps): each
    // row takes the label at its time; the two must last as long, within a row and a label.
    TORCH_CHECK(entry.fps > 0, "features file ", entry.features, ": labels_fps ", labels_fps,
                " maps the annotation to the rows by time, which needs the rows' rate: give it in "
                "the manifest's fps column");
    const double labels_seconds = static_cast<double>(count) / labels_fps;
    const double tolerance = 1 / labels_fps + 1 / entry.fps;
    const auto lasts = [&](int64_t n) {
      return std::abs(static_cast<double>(n) / entry.fps - labels_seconds) <= tolerance;
    };
    if (options_.features_layout == FeatureLayout::Auto) {
      TORCH_CHECK(!(lasts(shape[0]) && lasts(shape[1])), "features file ", entry.features,
                  ": both axes of its shape ", torch::IntArrayRef(shape), " last as long as ",
                  entry.labels, " (", labels_seconds, " s) at ", entry.fps,
                  " rows per second: set data.features_layout to T,D or D,T");
      item.time_first = lasts(shape[0]) || !lasts(shape[1]);
    } else {
      item.time_first = options_.features_layout == FeatureLayout::TimeFirst;
    }
    TORCH_CHECK(lasts(rows()), "annotation file ", entry.labels, " has ", count,
                " labels at labels_fps ", labels_fps, " (", labels_seconds,
                " s) but features file ", entry.features, " has ", rows(), " rows at ", entry.fps,
                " per second (", static_cast<double>(rows()) / entry.fps, " s; shape ",
                torch::IntArrayRef(shape), "): they must describe the same time");
  } else {
    TORCH_CHECK(
        options_.features_layout != FeatureLayout::Auto || shape[0] == count || shape[1] == count,
        "annotation file ", entry.labels, " has ", count, " labels but features file ",
        entry.features, " has shape ", torch::IntArrayRef(shape), ": neither axis is ", count,
        " long; there must be one label per frame (row of features), or give the "
        "annotation's and the rows' rates (labels_fps and the manifest's fps column)");
    item.time_first = time_first(shape, options_.features_layout, count, 0, entry.features);
    TORCH_CHECK(rows() == count, "annotation file ", entry.labels, " has ", count,
                " labels but features file ", entry.features, " has ", rows(), " frames (shape ",
                torch::IntArrayRef(shape), " read as ", item.time_first ? "[T,D]" : "[D,T]",
                "): there must be one label per frame");
  }
  item.feature_dim = shape[item.time_first ? 1 : 0];
  std::vector<double> row_seconds;  // every row's time; labels are kept per row
  for (int64_t k = 0; k < rows(); ++k) {
    row_seconds.push_back(entry.fps > 0 ? static_cast<double>(k) / entry.fps : 0.0);
  }
  for (int64_t k = 0; k < rows(); k += options_.features_stride) {
    item.sampled.push_back(k);
    item.seconds.push_back(row_seconds[k]);
  }
  std::vector<int64_t> annotation_frames(static_cast<size_t>(count));
  std::iota(annotation_frames.begin(), annotation_frames.end(), 0);
  if (labels_fps > 0)
    annotation_frames = labels_at_times(annotation_frames, labels_fps, row_seconds);
  for (const int64_t a : annotation_frames) item.labels.push_back(labels[a]);
  read_tools(item, annotation_frames, count);
  return item;
}

void VideoDataset::read_tools(Item& item, const std::vector<int64_t>& annotation_frames,
                              int64_t count) const {
  if (options_.tools.empty()) return;
  const auto& entry = item.entry;
  TORCH_CHECK(!entry.tools.empty(), "video ", entry.name,
              " has no tool annotation file: with data.tools set, the manifest's `tools` column "
              "names each video's (Cholec80's tool_annotations/",
              entry.name, "-tool.txt)");
  const auto annotations = read_tool_annotations(entry.tools, options_.tools);
  TORCH_CHECK(annotations.frames.back() < count, "tool annotation file ", entry.tools,
              " annotates frame ", annotations.frames.back(), " but the phase annotation ",
              entry.labels, " has ", count,
              " frames: both must count frames at the same rate (Cholec80's are 25 fps)");
  std::vector<int64_t> sampled;  // only the sampled frames' rows are kept
  for (const int64_t frame : item.sampled) sampled.push_back(annotation_frames[frame]);
  item.tools = tools_of_frames(annotations, sampled);
}

int64_t VideoDataset::frames(int64_t i) const {
  return static_cast<int64_t>(videos_.at(i).sampled.size());
}

std::pair<int64_t, int64_t> VideoDataset::frame_size(int64_t i) const {
  const auto& v = videos_.at(i);
  const int64_t crop = options_.transform.crop;
  return crop > 0 ? std::make_pair(crop, crop) : std::make_pair(v.height, v.width);
}

int64_t VideoDataset::frame_bytes(int64_t i) const {
  const auto& v = videos_.at(i);
  if (options_.features) return frames(i) * v.feature_dim * 4;  // float32
  // Decoding crops as it converts: the cropped frames are all it holds.
  const int64_t crop = options_.transform.crop;
  if (crop > 0) return frames(i) * 3 * std::min(crop, v.height) * std::min(crop, v.width);
  return frames(i) * 3 * v.height * v.width;
}

std::pair<int64_t, int64_t> VideoDataset::locate(int64_t global_frame) const {
  TORCH_CHECK(global_frame >= 0 && global_frame < total_frames(), "frame ", global_frame,
              " is outside the data set's ", total_frames(), " frames");
  const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), global_frame);
  const int64_t video = it - offsets_.begin();
  const int64_t start = video == 0 ? 0 : offsets_[video - 1];
  return {video, global_frame - start};
}

torch::Tensor VideoDataset::labels(int64_t i) const {
  const auto& v = videos_.at(i);
  auto out = torch::empty({static_cast<int64_t>(v.sampled.size())}, torch::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (size_t k = 0; k < v.sampled.size(); ++k) p[k] = v.labels[v.sampled[k]];
  return out;
}

torch::Tensor VideoDataset::tools(int64_t i) const {
  const auto& v = videos_.at(i);
  if (options_.tools.empty()) return {};
  const auto k = static_cast<int64_t>(options_.tools.size());
  auto out = torch::empty({static_cast<int64_t>(v.sampled.size()), k}, torch::kFloat32);
  std::copy(v.tools.begin(), v.tools.end(), out.data_ptr<float>());
  return out;
}

Augmentation VideoDataset::augmentation(int64_t i, uint64_t seed, int64_t epoch) const {
  const auto& v = videos_.at(i);
  return draw_augmentation(options_.transform, v.height, v.width, seed, epoch, i);
}

Video VideoDataset::load(int64_t i, const Augmentation& augmentation) const {
  const auto& v = videos_.at(i);
  if (options_.features) {
    Video video;
    video.features =
        every_kth_row(read_features(v.entry.features, v.time_first), options_.features_stride);
    video.labels = labels(i);
    video.tools = tools(i);
    video.name = v.entry.name;
    TORCH_CHECK(
        video.features.size(0) == video.labels.size(0) && video.features.size(1) == v.feature_dim,
        "features file ", v.entry.features, " changed since it was checked: now ",
        video.features.sizes(), " where ", video.labels.size(0), " frames of ", v.feature_dim,
        " features were found");
    return video;
  }
  Source source;
  source.path = v.entry.video;
  source.frame_files = v.frame_files;
  Video video;
  video.frames = decode_source(source, v.sampled, v.height, v.width, options_, augmentation);
  video.labels = labels(i);
  video.name = v.entry.name;
  video.tools = tools(i);
  return video;
}

Video VideoDataset::load_pieces(int64_t i, int64_t piece, const FramesCallback& on_frames) const {
  if (options_.features) return load(i);
  const auto& v = videos_.at(i);
  Source source;
  source.path = v.entry.video;
  source.frame_files = v.frame_files;
  decode_source_pieces(source, v.sampled, v.height, v.width, options_, piece, on_frames);
  Video video;
  video.labels = labels(i);
  video.name = v.entry.name;
  video.tools = tools(i);
  return video;
}

// ---------------------------------------------------------------------------------------------

Prefetcher::Prefetcher(std::vector<Job> jobs, int workers, int64_t max_bytes)
    : jobs_(std::move(jobs)), max_bytes_(max_bytes) {
  TORCH_CHECK(workers >= 1, "prefetch needs at least one worker thread (data.workers), got ",
              workers);
  for (int w = 0; w < workers; ++w) workers_.emplace_back([this] { work(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (auto& t : workers_) t.join();
}

bool Prefetcher::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return consumed_ == jobs_.size();
}

void Prefetcher::work() {
  // What the jobs decode is counted as the data pipeline's, not as what training keeps.
  memory::PipelineThreadScope pipeline_thread;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] {
      return stopping_ || (started_ < jobs_.size() &&
                           (held_bytes_ == 0 || held_bytes_ + jobs_[started_].bytes <= max_bytes_));
    });
    if (stopping_) return;
    const size_t job = started_++;
    held_bytes_ += jobs_[job].bytes;
    slots_.emplace_back();
    lock.unlock();
    Slot result;
    try {
      result.video = jobs_[job].load();
    } catch (...) {
      result.error = std::current_exception();
    }
    lock.lock();
    auto& slot = slots_[job - consumed_];
    slot.video = std::move(result.video);
    slot.error = result.error;
    slot.ready = true;
    changed_.notify_all();
  }
}

bool skips_error(bool skip_bad, const std::exception& error) {
  return skip_bad && !memory::is_out_of_memory(error);
}

Video Prefetcher::next() {
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(consumed_ < jobs_.size(), "prefetch: no videos left");
  changed_.wait(lock, [&] { return !slots_.empty() && slots_.front().ready; });
  Slot slot = std::move(slots_.front());
  slots_.pop_front();
  const size_t job = consumed_++;
  held_bytes_ -= jobs_[job].bytes;
  lock.unlock();
  changed_.notify_all();
  if (slot.error) {
    try {
      std::rethrow_exception(slot.error);
    } catch (const std::exception& e) {
      if (!memory::is_out_of_memory(e)) throw;
    }
    // A worker ran out of memory (its video decoded beside the consumer's at their peak): not
    // bad data. Decoded again here, when the consumer asks, having let its last video go; an
    // error now, out of memory included, is the caller's.
    return jobs_[job].load();
  }
  return std::move(slot.video);
}

}  // namespace framefit::data
