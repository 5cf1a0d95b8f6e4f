#include "framefit/data/demo.h"

#include <sys/stat.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "framefit/data/media.h"

namespace framefit::data {

namespace {

// Phase -> look. Preparation and Irrigation share look 0 (stripes), Dissection and Inspection
// look 1 (a moving disk); Suturing alone has look 2 (a checkerboard). Only the order tells the
// pairs apart: Irrigation comes after Dissection, Inspection after Suturing.
constexpr int kLookOfPhase[] = {0, 1, 0, 2, 1};

struct Style {       // per video, so appearance varies between videos but not between paired phases
  float tint[3][3];  // colour of each look
  float background[3];  // background colour
  float frequency;      // stripes and checkerboard
  float speed;          // drift per frame
  float radius;         // disk
  float noise;          // pixel noise standard deviation
};

Style draw_style(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0, 1);
  Style s{};
  const float base[3][3] = {{220, 90, 70}, {230, 210, 80}, {70, 120, 220}};
  for (int look = 0; look < 3; ++look) {
    for (int c = 0; c < 3; ++c) s.tint[look][c] = base[look][c] + 40 * (u(rng) - 0.5f);
  }
  for (int c = 0; c < 3; ++c) s.background[c] = 30 + 40 * u(rng);
  s.frequency = 3 + 2 * u(rng);
  s.speed = 0.01f + 0.03f * u(rng);
  s.radius = 0.15f + 0.1f * u(rng);
  s.noise = 6 + 8 * u(rng);
  return s;
}

torch::Tensor render(int look, const Style& s, int64_t t, const torch::Tensor& yy,
                     const torch::Tensor& xx, torch::Generator& gen) {
  const double phase = s.speed * static_cast<double>(t);
  torch::Tensor mask;
  if (look == 0) {
    mask = 0.5 + 0.5 * torch::sin(2 * M_PI * (yy * s.frequency + phase));
  } else if (look == 1) {
    const double cy = 0.5 + 0.25 * std::sin(phase * 3), cx = 0.5 + 0.3 * std::cos(phase * 2);
    const auto d2 = (yy - cy).pow(2) + (xx - cx).pow(2);
    mask = torch::sigmoid((s.radius * s.radius - d2) * 400);
  } else {
    mask = 0.5 + 0.5 * torch::sign(torch::sin(2 * M_PI * (xx * s.frequency + phase)) *
                                   torch::sin(2 * M_PI * yy * s.frequency));
  }
  auto tint = torch::tensor({s.tint[look][0], s.tint[look][1], s.tint[look][2]}).view({3, 1, 1});
  auto background =
      torch::tensor({s.background[0], s.background[1], s.background[2]}).view({3, 1, 1});
  auto image = background + (tint - background) * mask.unsqueeze(0);
  image = image + torch::randn(image.sizes(), gen) * s.noise;
  return image.clamp(0, 255).round().to(torch::kUInt8);
}

// Per tool, whether it is in view in each of `frames` frames: two random intervals of 10-30% of
// the video each.
std::vector<std::vector<bool>> draw_tool_presence(std::mt19937_64& rng, int64_t tools,
                                                  int64_t frames) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::vector<bool>> present(static_cast<size_t>(tools),
                                         std::vector<bool>(static_cast<size_t>(frames), false));
  for (auto& row : present) {
    for (int interval = 0; interval < 2; ++interval) {
      const auto length = static_cast<int64_t>(frames * (0.1 + 0.2 * u(rng)));
      const auto start = static_cast<int64_t>((frames - length) * u(rng));
      for (int64_t t = start; t < start + length; ++t) row[static_cast<size_t>(t)] = true;
    }
  }
  return present;
}

// Draws the tools in view over a rendered frame [3,H,W]: tool 0 a white square, tool 1 a
// magenta bar, both within the central 60% of the width (any crop of a 64-pixel square from the
// 80-pixel-wide frame keeps them).
void draw_tools(torch::Tensor& image, const std::vector<std::vector<bool>>& present, int64_t t) {
  const int64_t h = image.size(1), w = image.size(2);
  if (present[0][static_cast<size_t>(t)]) {
    image.slice(1, h / 8, h / 8 + h / 6).slice(2, w * 2 / 5, w * 2 / 5 + h / 6).fill_(255);
  }
  if (present[1][static_cast<size_t>(t)]) {
    auto bar = image.slice(1, h / 2, h * 9 / 10).slice(2, w * 3 / 5, w * 3 / 5 + w / 20 + 1);
    bar[0].fill_(255);
    bar[1].fill_(0);
    bar[2].fill_(255);
  }
}

void make_directory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0) {
    struct stat info {};
    TORCH_CHECK(::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode),
                "cannot create directory ", path);
  }
}

}  // namespace

std::vector<std::string> demo_tools() { return {"Clip", "Probe"}; }

ClassList demo_classes() {
  return ClassList({"Preparation", "Dissection", "Irrigation", "Suturing", "Inspection"});
}

DemoSummary make_demo(const std::string& out_dir, const DemoOptions& options,
                      const std::function<void(const std::string&, int64_t)>& on_video) {
  TORCH_CHECK(options.width % 2 == 0 && options.height % 2 == 0 && options.width >= 16 &&
                  options.height >= 16,
              "demo frames must have even sizes of at least 16 pixels");
  TORCH_CHECK(options.min_frames >= 25 && options.max_frames >= options.min_frames,
              "demo videos need min_frames >= 25 and max_frames >= min_frames");
  const auto classes = demo_classes();
  for (const char* sub : {"", "/videos", "/labels"}) make_directory(out_dir + sub);
  if (options.frame_folders) make_directory(out_dir + "/frames");
  if (options.tools) make_directory(out_dir + "/tools");

  std::mt19937_64 rng(options.seed);
  // Its own stream, so the phases and looks are those of the demo without tools.
  std::mt19937_64 tool_rng(options.seed ^ 0x70015ULL);
  auto gen = at::detail::createCPUGenerator(options.seed);
  const auto yy =
      torch::linspace(0, 1, options.height).view({-1, 1}).expand({options.height, options.width});
  const auto xx =
      torch::linspace(0, 1, options.width).view({1, -1}).expand({options.height, options.width});
  std::vector<VideoEntry> videos, folders;
  DemoSummary summary;
  const int64_t count = options.train_videos + options.val_videos + options.test_videos;
  for (int64_t v = 0; v < count; ++v) {
    const std::string split = v < options.train_videos                        ? "train"
                              : v < options.train_videos + options.val_videos ? "val"
                                                                              : "test";
    char name[32];
    std::snprintf(name, sizeof(name), "video%02lld", static_cast<long long>(v + 1));
    std::uniform_int_distribution<int64_t> length(options.min_frames, options.max_frames);
    const int64_t frames = length(rng);
    // Phase lengths: random shares of the video, each at least 5% of it.
    std::uniform_real_distribution<double> share(0.5, 1.5);
    std::vector<double> weights(classes.size());
    double total = 0;
    for (auto& w : weights) total += (w = share(rng));
    std::vector<int64_t> labels;
    for (int64_t p = 0; p < classes.size(); ++p) {
      const int64_t end =
          p + 1 == classes.size() ? frames : static_cast<int64_t>(std::llround(frames * [&] {
            double s = 0;
            for (int64_t q = 0; q <= p; ++q) s += weights[q];
            return s / total;
          }()));
      while (static_cast<int64_t>(labels.size()) < end) labels.push_back(p);
    }
    const Style style = draw_style(rng);
    const auto tools =
        options.tools ? draw_tool_presence(tool_rng, 2, frames) : std::vector<std::vector<bool>>{};

    const std::string video_path = out_dir + "/videos/" + name + ".mp4";
    const std::string label_path = out_dir + "/labels/" + name + ".txt";
    const std::string folder = out_dir + "/frames/" + name;
    if (options.frame_folders) make_directory(folder);
    VideoWriter writer(video_path, options.width, options.height, options.fps);
    for (int64_t t = 0; t < frames; ++t) {
      auto image = render(kLookOfPhase[labels[t]], style, t, yy, xx, gen);
      if (!tools.empty()) draw_tools(image, tools, t);
      writer.write(image);
      if (options.frame_folders) {
        char file[32];
        std::snprintf(file, sizeof(file), "/%06lld.jpg", static_cast<long long>(t));
        write_image(folder + file, image);
      }
    }
    writer.finish();
    write_phase_annotations(label_path, labels, classes);
    // Manifest paths are relative to the manifest, so the folder can be moved.
    VideoEntry video;
    video.name = name;
    video.video = std::string("videos/") + name + ".mp4";
    video.labels = std::string("labels/") + name + ".txt";
    video.split = split;
    videos.push_back(video);
    VideoEntry folder_entry = video;
    folder_entry.video = std::string("frames/") + name;
    folder_entry.fps = options.fps;
    folders.push_back(folder_entry);
    if (!tools.empty()) {
      // Every 25th frame, as Cholec80 annotates tools (1 fps of its 25).
      std::vector<float> rows;
      for (int64_t t = 0; t < frames; ++t) {
        for (const auto& tool : tools)
          rows.push_back(t % 25 == 0 ? tool[static_cast<size_t>(t)] : -1);
      }
      const std::string tool_file = std::string("tools/") + name + "-tool.txt";
      write_tool_annotations(out_dir + "/" + tool_file, demo_tools(), rows);
      videos.back().tools = folders.back().tools = tool_file;
    }
    summary.frames += frames;
    ++summary.videos;
    if (on_video) on_video(name, frames);
  }
  summary.manifest = out_dir + "/manifest.csv";
  write_manifest(summary.manifest, videos);
  if (options.frame_folders) {
    summary.frames_manifest = out_dir + "/manifest_frames.csv";
    write_manifest(summary.frames_manifest, folders);
  }
  return summary;
}

ClassList segmentation_demo_classes() { return ClassList({"background", "disc", "square"}); }

int64_t make_segmentation_demo(const std::string& out_dir, const SegmentationDemoOptions& options) {
  TORCH_CHECK(options.size >= 16, "segmentation demo images must be at least 16 pixels, got ",
              options.size);
  std::mt19937_64 rng(options.seed);
  std::uniform_real_distribution<double> u(0, 1);
  torch::Generator gen = at::detail::createCPUGenerator(options.seed);
  const auto grid = torch::arange(options.size, torch::kFloat32);
  const auto yy = grid.view({-1, 1}).expand({options.size, options.size});
  const auto xx = grid.view({1, -1}).expand({options.size, options.size});
  make_directory(out_dir);
  int64_t written = 0;
  const std::pair<const char*, int64_t> splits[] = {
      {"train", options.train_images}, {"val", options.val_images}, {"test", options.test_images}};
  for (const auto& [split, count] : splits) {
    const std::string root = out_dir + "/" + split;
    make_directory(root);
    make_directory(root + "/images");
    make_directory(root + "/masks");
    for (int64_t i = 0; i < count; ++i) {
      const double n = static_cast<double>(options.size);
      // A disc and a square of random sizes and places (the later drawn wins where they meet).
      const double r = n * (0.1 + 0.12 * u(rng)), cy = n * (0.2 + 0.6 * u(rng)),
                   cx = n * (0.2 + 0.6 * u(rng));
      const double half = n * (0.08 + 0.12 * u(rng)), sy = n * (0.2 + 0.6 * u(rng)),
                   sx = n * (0.2 + 0.6 * u(rng));
      auto mask = torch::zeros({options.size, options.size}, torch::kLong);
      mask.masked_fill_((yy - cy).pow(2) + (xx - cx).pow(2) <= r * r, 1);
      mask.masked_fill_(((yy - sy).abs() <= half).logical_and((xx - sx).abs() <= half), 2);
      auto colour =
          torch::tensor({60 + 180 * u(rng), 60 + 180 * u(rng), 60 + 180 * u(rng)}, torch::kFloat32)
              .view({3, 1, 1});
      const double frequency = 2 + 4 * u(rng);
      auto background = (40 + 30 * torch::sin(2 * M_PI * frequency * (yy + xx) / n))
                            .unsqueeze(0)
                            .expand({3, options.size, options.size});
      auto image = torch::where(mask.gt(0).unsqueeze(0), colour, background);
      image =
          (image + torch::randn(image.sizes(), gen) * 8).clamp(0, 255).round().to(torch::kUInt8);
      char name[32];
      std::snprintf(name, sizeof(name), "/%04lld.png", static_cast<long long>(i));
      write_image(root + "/images" + name, image);
      write_label_image(root + "/masks" + name, mask);
      ++written;
    }
  }
  return written;
}

}  // namespace framefit::data
