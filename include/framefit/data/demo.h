#pragma once
// Demo data: synthetic "procedure" videos written as real files (MP4 and JPEG frame folders with
// Cholec80-style annotations and CSV manifests) whose phases can only be told apart with
// temporal context: two pairs of phases look the same and differ only in what came before.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "framefit/data/labels.h"

namespace framefit::data {

struct DemoOptions {
  int64_t train_videos = 12;
  int64_t val_videos = 3;
  int64_t test_videos = 4;
  int64_t min_frames = 300;  // per video, at `fps`
  int64_t max_frames = 1500;
  double fps = 25;
  int64_t width = 80;  // even: H.264 with 4:2:0 chroma
  int64_t height = 64;
  bool frame_folders = true;  // JPEG frames as well as MP4 files
  uint64_t seed = 0;
  // Two tools drawn over the frames at random times (demo_tools(): a white square and a magenta
  // bar near the centre, which crops keep), annotated every 25th frame as Cholec80's tools are
  // (tools/videoNN-tool.txt, the manifests' tools column). Off: the videos are those without.
  bool tools = false;
};

// The demo's phases, in the order they occur.
ClassList demo_classes();
// The demo's tools (DemoOptions::tools), in column order.
std::vector<std::string> demo_tools();

struct DemoSummary {
  std::string manifest;         // MP4 videos
  std::string frames_manifest;  // frame folders ("" when not written)
  int64_t videos = 0;
  int64_t frames = 0;
};

// Writes videos/, frames/, labels/, manifest.csv and manifest_frames.csv (and with tools,
// tools/) under `out_dir`.
// `on_video` is told (name, frames) after each video.
DemoSummary make_demo(const std::string& out_dir, const DemoOptions& options = {},
                      const std::function<void(const std::string&, int64_t)>& on_video = {});

// Demo images for segmentation: a textured background with a disc and a square of the same
// random colour, so the classes (background, disc, square) differ by shape, not colour.
struct SegmentationDemoOptions {
  int64_t train_images = 48;
  int64_t val_images = 12;
  int64_t test_images = 12;
  int64_t size = 64;  // square images; a multiple of 16 suits a UNet of depth 4
  uint64_t seed = 0;
};
ClassList segmentation_demo_classes();
// Writes <split>/images/NNNN.png and <split>/masks/NNNN.png (class ids as gray PNG) under
// `out_dir` for the splits train, val and test; returns the images written.
int64_t make_segmentation_demo(const std::string& out_dir,
                               const SegmentationDemoOptions& options = {});

}  // namespace framefit::data
