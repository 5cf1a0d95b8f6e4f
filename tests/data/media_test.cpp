#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>

#include "test_util.h"

#include "framefit/data/media.h"

using namespace framefit;
using data::VideoReader;
using data::VideoWriter;

namespace {

#ifdef FRAMEFIT_WITH_FFMPEG
#define REQUIRE_FFMPEG()
#else
#define REQUIRE_FFMPEG() GTEST_SKIP() << "built without FFmpeg"
#endif

std::string media(const std::string& name) {
  return std::string(FRAMEFIT_SOURCE_DIR) + "/tests/media/" + name;
}

// A fresh temporary directory, removed when the test ends.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name)
      : path((std::filesystem::temp_directory_path() /
              ("framefit_" + name + "_" + std::to_string(getpid())))
                 .string()) {
    test_util::remove_tree(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { test_util::remove_tree(path); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

using test_util::read_bytes;
using test_util::write_bytes;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<int64_t> range(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

torch::Tensor decode_all(const std::string& path, int64_t n, int64_t height, int64_t width) {
  auto out = torch::empty({n, 3, height, width}, torch::kUInt8);
  VideoReader(path).read(range(n), out);
  return out;
}

double mean_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat) - b.to(torch::kFloat)).abs().mean().item<double>();
}

// Which frame of the test pattern a decoded 64x48 frame [3,48,64] is: tests/media/README.md puts
// a white 4x8 bar at rows 20-27 with its left edge at column k + 1 in frame k, over a darker
// picture, so the largest rise in whiteness along the bar's rows is at column k + 1.
int64_t pattern_frame(const torch::Tensor& frame) {
  const auto whiteness = std::get<0>(frame.slice(1, 20, 28).min(0)).to(torch::kFloat).sum(0);
  const auto rise = whiteness.slice(0, 1) - whiteness.slice(0, 0, -1);
  return rise.argmax().item<int64_t>();
}

}  // namespace

TEST(Media, SampleIndicesKeepTheNearestFrame) {
  EXPECT_EQ(data::sample_indices(50, 25, 5),
            (std::vector<int64_t>{0, 5, 10, 15, 20, 25, 30, 35, 40, 45}));
  // 30 -> 25 fps: round(i * 1.2).
  EXPECT_EQ(data::sample_indices(30, 30, 25),
            (std::vector<int64_t>{0,  1,  2,  4,  5,  6,  7,  8,  10, 11, 12, 13, 14,
                                  16, 17, 18, 19, 20, 22, 23, 24, 25, 26, 28, 29}));
  // Halves round up: round(i * 1.5).
  EXPECT_EQ(data::sample_indices(9, 30, 20), (std::vector<int64_t>{0, 2, 3, 5, 6, 8}));
  // NTSC rates: 29.97 -> 10 fps keeps about every third frame.
  EXPECT_EQ(data::sample_indices(10, 30000.0 / 1001, 10), (std::vector<int64_t>{0, 3, 6, 9}));
}

TEST(Media, SampleIndicesCountCoversTheVideo) {
  // ceil(frames * target / source): every output time before the end of the video.
  EXPECT_EQ(data::sample_indices(51, 25, 5).size(), 11u);
  EXPECT_EQ(data::sample_indices(51, 25, 5).back(), 50);
  EXPECT_EQ(data::sample_indices(49, 25, 5).size(), 10u);
  EXPECT_EQ(data::sample_indices(49, 25, 5).back(), 45);
  EXPECT_EQ(data::sample_indices(1, 25, 5), (std::vector<int64_t>{0}));
  EXPECT_TRUE(data::sample_indices(0, 25, 5).empty());
  // Target 0 (keep the source rate) or at least the source rate: every frame.
  EXPECT_EQ(data::sample_indices(7, 25, 0), range(7));
  EXPECT_EQ(data::sample_indices(7, 25, 25), range(7));
  EXPECT_EQ(data::sample_indices(7, 25, 60), range(7));
  EXPECT_EQ(data::sample_indices(7, 0, 5), range(7));  // unknown source rate
  EXPECT_TRUE(contains(test_util::error_message([] { data::sample_indices(7, std::nan(""), 5); }),
                       "source_fps"));
  EXPECT_TRUE(
      contains(test_util::error_message([] { data::sample_indices(-1, 25, 5); }), "source_frames"));
}

TEST(Media, SampleTimesAtAConstantRateAreSampleIndices) {
  for (const int64_t frames : {1, 7, 49, 50, 51, 100}) {
    for (const double fps : {25.0, 30.0, 30000.0 / 1001}) {
      std::vector<double> times;
      for (int64_t i = 0; i < frames; ++i) times.push_back(static_cast<double>(i) / fps);
      for (const double target : {1.0, 5.0, 10.0, 20.0, 24.9}) {
        EXPECT_EQ(data::sample_times(times, static_cast<double>(frames) / fps, target),
                  data::sample_indices(frames, fps, target))
            << frames << " frames at " << fps << " fps sampled at " << target;
      }
    }
  }
}

TEST(Media, SampleTimesTakeTheNearestFrameInTime) {
  // Three frames 0.1 s apart, a gap, two more: at 5 fps the times 0, 0.2, ..., 1.0 take the
  // nearest frame (the later one on a tie, 0.6 between 0.2 and 1.0), so frames close together
  // are skipped and the frame before the gap repeats.
  const std::vector<double> times = {0, 0.1, 0.2, 1.0, 1.1};
  EXPECT_EQ(data::sample_times(times, 1.2, 5), (std::vector<int64_t>{0, 2, 2, 3, 3, 3}));
  EXPECT_EQ(data::sample_times(times, 1.2, 0), range(5));    // every frame
  EXPECT_EQ(data::sample_times(times, 1.21, 5).size(), 7u);  // a time at 1.2 is before the end
  EXPECT_TRUE(data::sample_times({}, 0, 5).empty());
  EXPECT_TRUE(contains(test_util::error_message([] {
                         data::sample_times({0, 0.2, 0.1}, 1, 5);
                       }),
                       "ascending"));
  EXPECT_TRUE(contains(test_util::error_message([] {
                         data::sample_times({0, 0.1}, std::nan(""), 5);
                       }),
                       "finite"));
}

TEST(Media, ResizedSizeRoundsTheLongerSide) {
  using HW = std::pair<int64_t, int64_t>;
  EXPECT_EQ(data::resized_hw(48, 64, 112), (HW{112, 149}));  // 149.33
  EXPECT_EQ(data::resized_hw(64, 48, 112), (HW{149, 112}));
  EXPECT_EQ(data::resized_hw(1080, 1920, 112), (HW{112, 199}));  // 199.11
  EXPECT_EQ(data::resized_hw(240, 320, 112), (HW{112, 149}));
  EXPECT_EQ(data::resized_hw(2, 3, 3), (HW{3, 5}));  // 4.5 rounds up
  EXPECT_EQ(data::resized_hw(3, 5, 2), (HW{2, 3}));  // 3.33
  EXPECT_EQ(data::resized_hw(100, 100, 50), (HW{50, 50}));
  EXPECT_EQ(data::resized_hw(48, 64, 0), (HW{48, 64}));
  EXPECT_EQ(data::resized_hw(48, 64, -1), (HW{48, 64}));
  EXPECT_EQ(data::resized_hw(1, 1000, 1), (HW{1, 1000}));
  EXPECT_TRUE(contains(test_util::error_message([] { data::resized_hw(0, 64, 112); }), "positive"));
}

#ifndef FRAMEFIT_WITH_FFMPEG
TEST(Media, WithoutFfmpegEveryCallSaysHowToEnableIt) {
  for (const auto& message : {
           test_util::error_message([] { VideoReader reader(media("clip_25fps.mp4")); }),
           test_util::error_message([] { VideoWriter writer("/tmp/x.mp4", 64, 48, 25); }),
           test_util::error_message([] { data::image_size(media("frame.png")); }),
           test_util::error_message([] {
             data::read_image(media("frame.png"), torch::empty({3, 24, 32}, torch::kUInt8));
           }),
           test_util::error_message([] {
             data::write_image("/tmp/x.png", torch::zeros({3, 2, 2}, torch::kUInt8));
           }),
       }) {
    EXPECT_TRUE(contains(message, "-DFRAMEFIT_WITH_FFMPEG=ON")) << message;
  }
}
#endif

TEST(VideoReader, ProbesTheContainer) {
  REQUIRE_FFMPEG();
  VideoReader reader(media("clip_25fps.mp4"));
  EXPECT_EQ(reader.path(), media("clip_25fps.mp4"));
  const auto& info = reader.info();
  EXPECT_EQ(info.frames, 50);
  EXPECT_DOUBLE_EQ(info.fps, 25.0);
  EXPECT_EQ(info.width, 64);
  EXPECT_EQ(info.height, 48);
  EXPECT_EQ(info.codec, "h264");
}

TEST(VideoReader, SampledFramesAreTheFullDecodesFrames) {
  REQUIRE_FFMPEG();
  const auto path = media("clip_25fps.mp4");
  const auto all = decode_all(path, 50, 48, 64);
  for (int64_t k = 0; k < 50; ++k) EXPECT_EQ(pattern_frame(all[k]), k) << "frame " << k;
  // Channels in RGB order and video levels expanded: frame 0 scaled down is close to the same
  // test pattern frame stored losslessly as a 32x24 PNG (and far from it with R and B swapped).
  auto small = torch::empty({1, 3, 24, 32}, torch::kUInt8);
  VideoReader(path).read({0}, small);
  auto png = torch::empty({3, 24, 32}, torch::kUInt8);
  data::read_image(media("frame.png"), png);
  EXPECT_LT(mean_abs_diff(small[0], png), 12);
  EXPECT_GT(mean_abs_diff(small[0].flip(0), png), 30);

  const auto indices = data::sample_indices(50, 25, 5);
  auto sampled = torch::empty({static_cast<int64_t>(indices.size()), 3, 48, 64}, torch::kUInt8);
  VideoReader reader(path);
  reader.read(indices, sampled);
  for (size_t k = 0; k < indices.size(); ++k) {
    EXPECT_TRUE(sampled[k].equal(all[indices[k]])) << "sampled frame " << k;
  }
  // Later reads continue, an earlier index restarts; repeated indices repeat the frame.
  const std::vector<std::vector<int64_t>> reads = {{46, 47}, {49}, {0, 0, 3}, {3, 48}};
  for (const auto& read : reads) {
    auto out = torch::empty({static_cast<int64_t>(read.size()), 3, 48, 64}, torch::kUInt8);
    reader.read(read, out);
    for (size_t k = 0; k < read.size(); ++k) {
      EXPECT_TRUE(out[k].equal(all[read[k]])) << "frame " << read[k];
    }
  }
  auto none = torch::empty({0, 3, 48, 64}, torch::kUInt8);
  reader.read({}, none);
}

TEST(VideoReader, SampledReadSkipsFramesNothingRefersToWithTheSamePixels) {
  REQUIRE_FFMPEG();
  // Each file (20 frames or more) read at the indices with and without skipping, with one
  // decoder thread and with frame threads. Files that do not qualify for skipping (an edit list's
  // discarded frames, a segment starting inside a group of pictures) decode every frame and still
  // agree.
  const std::vector<std::vector<int64_t>> samplings = {
      {0, 5, 10, 15}, {0}, {19}, {1, 3, 3, 8, 9, 12}, {10, 11, 12}, {2, 4, 6, 8, 10, 12, 14}};
  for (const char* name : {"clip_25fps.mp4", "rotated_90.mp4", "variable_rate.mp4",
                           "variable_rate.mkv", "trimmed.mp4", "segment.ts"}) {
    const auto path = media(name);
    for (const auto& indices : samplings) {
      for (const int threads : {1, 2}) {
        auto full = torch::empty({static_cast<int64_t>(indices.size()), 3, 24, 24}, torch::kUInt8);
        auto skipped = torch::empty_like(full);
        VideoReader every(path, threads, /*skip_unsampled=*/false);
        every.read(indices, full);
        EXPECT_EQ(every.frames_decoded(), indices.back() + 1) << name;
        VideoReader skipping(path, threads, /*skip_unsampled=*/true);
        skipping.read(indices, skipped);
        EXPECT_TRUE(skipped.equal(full))
            << name << ", " << threads << " threads, frames " << indices.front() << "...";
        EXPECT_LE(skipping.frames_decoded(), indices.back() + 1) << name;
      }
    }
  }
  // The clip (H.264 with B-frames, tests/media/README.md) at 5 fps: of the 46 frames up to the
  // last one sampled, the non-reference B-frames between them are not decoded.
  const auto path = media("clip_25fps.mp4");
  const auto indices = data::sample_indices(50, 25, 5);
  auto out = torch::empty({static_cast<int64_t>(indices.size()), 3, 48, 64}, torch::kUInt8);
  VideoReader reader(path);
  reader.read(indices, out);
  EXPECT_LT(reader.frames_decoded(), 40);
  EXPECT_GE(reader.frames_decoded(), static_cast<int64_t>(indices.size()));
  // A later read starts afresh (the skipped frames are not in the decoder) and is right.
  const auto all = decode_all(path, 50, 48, 64);
  auto later = torch::empty({2, 3, 48, 64}, torch::kUInt8);
  reader.read({46, 49}, later);
  EXPECT_TRUE(later[0].equal(all[46]) && later[1].equal(all[49]));
  // Every frame wanted: nothing to skip.
  VideoReader dense(path);
  auto first = torch::empty({10, 3, 48, 64}, torch::kUInt8);
  dense.read(range(10), first);
  EXPECT_EQ(dense.frames_decoded(), 10);
}

TEST(VideoReader, PiecesHandOnTheFramesOfOneReadOnceEach) {
  REQUIRE_FFMPEG();
  // Every frame, a sampling (the skipping decoder) and repeats, in pieces of 1, 3, 4 and more
  // than there are: the pieces put together are read()'s frames.
  const auto path = media("clip_25fps.mp4");
  const std::vector<std::vector<int64_t>> samplings = {
      range(50), data::sample_indices(50, 25, 5), {1, 3, 3, 3, 8, 9, 12}};
  for (const auto& indices : samplings) {
    const auto n = static_cast<int64_t>(indices.size());
    auto whole = torch::empty({n, 3, 24, 32}, torch::kUInt8);
    VideoReader(path).read(indices, whole);
    for (const int64_t piece : {int64_t{1}, int64_t{3}, int64_t{4}, n + 5}) {
      VideoReader reader(path);
      auto buffer = torch::empty({piece, 3, 24, 32}, torch::kUInt8);
      std::vector<torch::Tensor> pieces;
      std::vector<int64_t> counts;
      reader.read_pieces(indices, buffer, [&](int64_t count) {
        counts.push_back(count);
        pieces.push_back(buffer.narrow(0, 0, count).clone());
      });
      const auto expected_pieces = (n + piece - 1) / piece;
      ASSERT_EQ(static_cast<int64_t>(counts.size()), expected_pieces) << "pieces of " << piece;
      for (int64_t k = 0; k + 1 < expected_pieces; ++k) EXPECT_EQ(counts[k], piece);
      EXPECT_TRUE(torch::cat(pieces).equal(whole)) << n << " frames in pieces of " << piece;
    }
  }
  // The callback's error is passed on as it is: not taken for damage and decoded again.
  VideoReader reader(path);
  auto buffer = torch::empty({2, 3, 24, 32}, torch::kUInt8);
  int calls = 0;
  const auto message = test_util::error_message([&] {
    reader.read_pieces(data::sample_indices(50, 25, 5), buffer, [&](int64_t) {
      ++calls;
      TORCH_CHECK(calls < 3, "the consumer gave up");
    });
  });
  EXPECT_TRUE(contains(message, "the consumer gave up")) << message;
  EXPECT_EQ(calls, 3);
  // A truncated file: the pieces before the cut, then the read()'s error.
  VideoReader truncated(media("truncated.mp4"));
  int64_t handed_on = 0;
  const auto cut = test_util::error_message([&] {
    truncated.read_pieces(range(50), buffer, [&](int64_t count) { handed_on += count; });
  });
  EXPECT_TRUE(contains(cut, ": stream ended after 18 of 50 frames (truncated file)")) << cut;
  EXPECT_EQ(handed_on, 18);
}

// Encodings the committed media lack, made by the ffmpeg CLI when it is installed: skipping must
// give the frames of decoding every frame, or fall back to decoding them (interlaced, VP9).
TEST(VideoReader, SkippingAgreesWithDecodingEveryFrameAcrossEncodings) {
  REQUIRE_FFMPEG();
  if (std::system("ffmpeg -version > /dev/null 2>&1") != 0) GTEST_SKIP() << "no ffmpeg CLI";
  TempDir dir("framefit_skip_encodings");
  const std::string source =
      "ffmpeg -loglevel error -y -f lavfi -i testsrc2=size=96x64:rate=25:duration=4 ";
  struct Encoding {
    std::string name, codec;
    bool skips;  // has frames to skip and qualifies
  };
  const std::vector<Encoding> encodings = {
      {"open_gop.mkv", "-c:v libx264 -x264-params bframes=8:b-pyramid=strict:keyint=30:open-gop=1",
       true},
      {"four_slices.mov", "-c:v libx264 -x264-params slices=4:bframes=3", true},
      {"transport.ts", "-c:v libx264 -bf 3", true},
      {"hevc.mkv", "-c:v libx265 -x265-params log-level=error:bframes=4", true},
      {"mpeg4.mp4", "-c:v mpeg4 -bf 2 -q:v 5", true},
      {"interlaced.mp4", "-c:v libx264 -flags +ildct+ilme -x264-params tff=1", false},
      {"vp9.webm", "-c:v libvpx-vp9 -deadline realtime", false}};
  for (const auto& e : encodings) {
    const auto path = dir.file(e.name);
    const auto command = source + e.codec + " -pix_fmt yuv420p " + path;
    if (std::system(command.c_str()) != 0) {
      ADD_FAILURE() << "could not encode " << e.name << ": " << command;
      continue;
    }
    for (const double fps : {1.0, 7.0}) {
      const auto indices = data::sample_indices(100, 25, fps);
      auto every = torch::empty({static_cast<int64_t>(indices.size()), 3, 64, 96}, torch::kUInt8);
      auto skipped = torch::empty_like(every);
      VideoReader(path, 1, /*skip_unsampled=*/false).read(indices, every);
      VideoReader reader(path, 2, /*skip_unsampled=*/true);
      reader.read(indices, skipped);
      EXPECT_TRUE(skipped.equal(every)) << e.name << " at " << fps << " fps";
      // Skipped: fewer frames than those up to the last index; fallen back: all of them (and
      // what the attempt decoded before it gave up).
      if (e.skips) {
        EXPECT_LT(reader.frames_decoded(), indices.back() + 1) << e.name << " at " << fps;
      } else {
        EXPECT_GE(reader.frames_decoded(), indices.back() + 1) << e.name << " at " << fps;
      }
    }
  }
}

TEST(VideoReader, VariableRateVideoHasItsFramesTimes) {
  REQUIRE_FFMPEG();
  // tests/media/README.md: frames 0-9 at 25 fps, then 10 frames 0.12 s apart.
  VideoReader reader(media("variable_rate.mp4"));
  EXPECT_TRUE(reader.info().variable_rate);
  EXPECT_EQ(reader.info().frames, 20);
  const auto times = reader.frame_times();
  ASSERT_EQ(times.seconds.size(), 20u);
  for (int64_t k = 0; k < 20; ++k) {
    const double expected = k < 10 ? k / 25.0 : (10 + 3 * (k - 10)) / 25.0;
    EXPECT_NEAR(times.seconds[static_cast<size_t>(k)], expected, 1e-9) << "frame " << k;
  }
  EXPECT_NEAR(times.end_seconds, 1.52, 1e-9);  // the last frame lasts 0.04 s
  // By time at 5 fps: 0.6 s is nearer frame 12 (0.64 s) than 11 (0.52 s), and so on.
  const auto sampled = data::sample_times(times.seconds, times.end_seconds, 5);
  EXPECT_EQ(sampled, (std::vector<int64_t>{0, 5, 10, 12, 13, 15, 17, 18}));
  auto out = torch::empty({static_cast<int64_t>(sampled.size()), 3, 48, 64}, torch::kUInt8);
  reader.read(sampled, out);
  for (size_t k = 0; k < sampled.size(); ++k) EXPECT_EQ(pattern_frame(out[k]), sampled[k]);
  // The times again after decoding (the reader reopens its input), and decoding after that.
  EXPECT_EQ(reader.frame_times().seconds, times.seconds);
  auto again = torch::empty_like(out);
  reader.read(sampled, again);
  EXPECT_TRUE(again.equal(out));

  // A constant-rate video's times are i / fps.
  VideoReader constant(media("clip_25fps.mp4"));
  EXPECT_FALSE(constant.info().variable_rate);
  const auto constant_times = constant.frame_times();
  ASSERT_EQ(constant_times.seconds.size(), 50u);
  for (size_t k = 0; k < 50; ++k) EXPECT_NEAR(constant_times.seconds[k], k / 25.0, 1e-9);
  EXPECT_NEAR(constant_times.end_seconds, 2.0, 1e-9);
}

TEST(VideoReader, TrimmedVideoCountsOnlyTheFramesItShows) {
  REQUIRE_FFMPEG();
  // The clip cut at 0.5 s with `ffmpeg -ss 0.5 -c copy`: all 50 packets stay (from the keyframe
  // before the cut) and an edit list drops the first 13. The container says 50 frames; the
  // decoder (and the ffmpeg CLI) gives 37, so reading them failed as a truncated file.
  VideoReader reader(media("trimmed.mp4"));
  EXPECT_EQ(reader.info().frames, 37);
  const auto frames = decode_all(media("trimmed.mp4"), 37, 48, 64);
  for (int64_t k = 0; k < 37; ++k) EXPECT_EQ(pattern_frame(frames[k]), 13 + k) << "frame " << k;
  const auto times = reader.frame_times();
  ASSERT_EQ(times.seconds.size(), 37u);
  for (size_t k = 0; k < 37; ++k) EXPECT_NEAR(times.seconds[k], k / 25.0, 1e-9);
}

TEST(VideoReader, SegmentCutInAGroupOfPicturesCountsTheFramesItShows) {
  REQUIRE_FFMPEG();
  // The last 60% of an MPEG-2 transport stream (open groups of 12 pictures), as a recorder's
  // segment starts: no frame count in the container, 29 frame packets, but the 3 before the
  // first keyframe and the 2 shown before it refer to pictures before the cut. The decoder and
  // the ffmpeg CLI show 26 (frames 24-49); counting packets failed it as truncated.
  VideoReader reader(media("segment.ts"));
  EXPECT_TRUE(reader.info().frames_estimated);
  const auto times = reader.frame_times();
  ASSERT_EQ(times.seconds.size(), 26u);
  for (size_t k = 0; k < 26; ++k) EXPECT_NEAR(times.seconds[k], k / 25.0, 1e-9);
  const auto frames = decode_all(media("segment.ts"), 26, 48, 64);
  for (int64_t k = 0; k < 26; ++k) EXPECT_EQ(pattern_frame(frames[k]), 24 + k) << "frame " << k;
}

TEST(VideoReader, RotatedVideoIsReadUpright) {
  REQUIRE_FFMPEG();
  // clip_25fps.mp4 with a display matrix of a quarter turn counterclockwise, as a phone writes
  // for portrait video: stored 64x48, shown 48 wide and 64 high.
  VideoReader reader(media("rotated_90.mp4"));
  EXPECT_EQ(reader.info().rotation, 90);
  EXPECT_EQ(reader.info().width, 48);
  EXPECT_EQ(reader.info().height, 64);
  auto upright = torch::empty({2, 3, 64, 48}, torch::kUInt8);
  reader.read({0, 7}, upright);
  const auto stored = decode_all(media("clip_25fps.mp4"), 8, 48, 64);
  EXPECT_TRUE(upright[0].equal(torch::rot90(stored[0], 1, {1, 2})));
  EXPECT_TRUE(upright[1].equal(torch::rot90(stored[7], 1, {1, 2})));
  // The turn's direction is the ffmpeg CLI's: its frame 0, written as a lossless PNG, is close
  // to ours and far from the turn the other way.
  auto cli = torch::empty({3, 64, 48}, torch::kUInt8);
  data::read_image(media("rotated_90_frame0.png"), cli);
  EXPECT_LT(mean_abs_diff(upright[0], cli), 12);
  EXPECT_GT(mean_abs_diff(torch::rot90(stored[0], 3, {1, 2}), cli), 30);
  // Resized, the stored frame is scaled to the turned size first.
  auto small = torch::empty({1, 3, 32, 24}, torch::kUInt8);
  reader.read({0}, small);
  auto small_stored = torch::empty({1, 3, 24, 32}, torch::kUInt8);
  VideoReader(media("clip_25fps.mp4")).read({0}, small_stored);
  EXPECT_TRUE(small[0].equal(torch::rot90(small_stored[0], 1, {1, 2})));
}

TEST(VideoReader, ResizesIntoTheOutputSize) {
  REQUIRE_FFMPEG();
  const auto path = media("clip_25fps.mp4");
  const auto full = decode_all(path, 50, 48, 64);
  const auto [height, width] = data::resized_hw(48, 64, 112);
  for (const auto& size : {std::vector<int64_t>{height, width}, std::vector<int64_t>{24, 32},
                           std::vector<int64_t>{112, 112}}) {
    auto out = torch::empty({2, 3, size[0], size[1]}, torch::kUInt8);
    VideoReader(path, /*decoder_threads=*/2).read({10, 40}, out);
    // Resizing keeps each channel's mean and the picture.
    const auto expected =
        torch::nn::functional::interpolate(
            full.index_select(0, torch::tensor({10, 40})).to(torch::kFloat),
            torch::nn::functional::InterpolateFuncOptions().size(size).mode(torch::kArea))
            .round();
    EXPECT_LT(mean_abs_diff(out, expected), 10) << size;
    const auto channel_means = [](const torch::Tensor& t) {
      return t.to(torch::kFloat).mean({2, 3});
    };
    EXPECT_LT((channel_means(out) - channel_means(full.index_select(0, torch::tensor({10, 40}))))
                  .abs()
                  .max()
                  .item<double>(),
              3)
        << size;
  }
}

TEST(VideoReader, WindowIsTheCropOfTheResizedFrames) {
  REQUIRE_FFMPEG();
  // A crop taken while converting: the same pixels as resizing the whole frame and cropping it,
  // for a plain video, one read skipping frames, a rotated one and a JPEG turned by its EXIF tag.
  const auto check = [](const std::function<void(torch::Tensor, const data::FrameWindow&)>& read,
                        int64_t frames, int64_t height, int64_t width, const std::string& what) {
    auto whole = torch::empty({frames, 3, height, width}, torch::kUInt8);
    read(whole, {});
    data::FrameWindow window;
    window.height = height;
    window.width = width;
    window.top = height / 4;
    window.left = width / 3;
    auto cropped = torch::empty({frames, 3, height / 2, width / 2}, torch::kUInt8);
    read(cropped, window);
    EXPECT_TRUE(
        cropped.equal(whole.narrow(2, window.top, height / 2).narrow(3, window.left, width / 2)))
        << what;
  };
  for (const auto* name : {"clip_25fps.mp4", "rotated_90.mp4"}) {
    for (const auto& indices : {std::vector<int64_t>{0, 3, 3, 20}, std::vector<int64_t>{1, 2}}) {
      check([&](torch::Tensor out,
                const data::FrameWindow& w) { VideoReader(media(name)).read(indices, out, w); },
            static_cast<int64_t>(indices.size()), 40, 30, name);
    }
  }
  check(
      [](torch::Tensor out, const data::FrameWindow& w) {
        data::read_image(media("exif/orientation_6.jpg"), out[0], w);
      },
      1, 24, 32, "exif/orientation_6.jpg");
  // A window outside the resized frame is an error naming the file.
  data::FrameWindow outside;
  outside.height = 40;
  outside.width = 30;
  outside.top = 30;
  auto out = torch::empty({1, 3, 20, 15}, torch::kUInt8);
  const auto message = test_util::error_message(
      [&] { VideoReader(media("clip_25fps.mp4")).read({0}, out, outside); });
  EXPECT_TRUE(contains(message,
                       "clip_25fps.mp4: a 20x15 window at (30, 0) does not fit in "
                       "frames resized to 40x30"))
      << message;
}

TEST(VideoReader, TruncatedFileDecodesUpToTheCut) {
  REQUIRE_FFMPEG();
  // tests/media/README.md: the clip with its index first, cut to 75% of its bytes. It opens with
  // the header's 50 frames; decoding stops where the data ends.
  const auto path = media("truncated.mp4");
  VideoReader reader(path);
  EXPECT_EQ(reader.info().frames, 50);
  auto all = torch::empty({50, 3, 48, 64}, torch::kUInt8);
  const auto message = test_util::error_message([&] { reader.read(range(50), all); });
  EXPECT_TRUE(contains(message, "video " + path + ": stream ended after ")) << message;
  // 18: the data ends inside frame 18's packet; frame 19, decoded before it, is not counted as 18.
  EXPECT_TRUE(contains(message, ": stream ended after 18 of 50 frames (truncated file)"))
      << message;
  auto sampled = torch::empty({10, 3, 48, 64}, torch::kUInt8);
  const auto sampled_message =
      test_util::error_message([&] { reader.read(data::sample_indices(50, 25, 5), sampled); });
  EXPECT_TRUE(contains(sampled_message, ": stream ended after 18 of 50 frames (truncated file)"))
      << sampled_message;
  // The frames before the cut are the complete clip's.
  const auto complete = decode_all(media("clip_25fps.mp4"), 50, 48, 64);
  auto first = torch::empty({18, 3, 48, 64}, torch::kUInt8);
  reader.read(range(18), first);
  EXPECT_TRUE(first.equal(complete.slice(0, 0, 18)));
}

TEST(VideoReader, DamagedPacketIsAnErrorNamingTheFrame) {
  REQUIRE_FFMPEG();
  const auto path = media("damaged.mp4");
  VideoReader reader(path);
  auto all = torch::empty({50, 3, 48, 64}, torch::kUInt8);
  // tests/media/README.md: 16 bytes zeroed in frame 25's packet, which the decoder reads while it
  // returns frame 22 (it holds two frames back to reorder B-frames).
  const auto message = test_util::error_message([&] { reader.read(range(50), all); });
  EXPECT_TRUE(contains(message, "video " + path + ": cannot decode frame 25 (damaged data): "))
      << message;
  // Sampled: the same error, though the frames between the samples are skipped at first.
  auto sampled = torch::empty({10, 3, 48, 64}, torch::kUInt8);
  const auto sampled_message =
      test_util::error_message([&] { reader.read(data::sample_indices(50, 25, 5), sampled); });
  EXPECT_TRUE(contains(sampled_message, "video " + path + ": cannot decode frame 25 (damaged"))
      << sampled_message;
  // The frames before it decode and match the undamaged clip.
  auto first = torch::empty({20, 3, 48, 64}, torch::kUInt8);
  reader.read(range(20), first);
  EXPECT_TRUE(first.equal(decode_all(media("clip_25fps.mp4"), 20, 48, 64)));
}

TEST(VideoReader, BadFilesAndArgumentsAreErrorsNamingTheFile) {
  REQUIRE_FFMPEG();
  const auto missing = media("no_such_video.mp4");
  EXPECT_EQ(test_util::error_message([&] { VideoReader reader(missing); }),
            "video " + missing + ": cannot open: No such file or directory");
  const auto no_video =
      test_util::error_message([&] { VideoReader reader(media("ordered_dict_state.pt")); });
  EXPECT_TRUE(contains(no_video, "video " + media("ordered_dict_state.pt") + ": ")) << no_video;
  // An MP4 cut before its index, which is at the end of the file, does not open.
  TempDir dir("video_reader_errors");
  const auto cut = dir.file("cut.mp4");
  const auto clip = read_bytes(media("clip_25fps.mp4"));
  write_bytes(cut, clip.substr(0, clip.size() * 6 / 10));
  EXPECT_EQ(test_util::error_message([&] { VideoReader reader(cut); }),
            "video " + cut +
                ": cannot open: Invalid data found when processing input (not a video, or a "
                "damaged or truncated file)");
  // Cut inside the index (90%): FFmpeg reaches the end of the file while reading it.
  write_bytes(cut, clip.substr(0, clip.size() * 9 / 10));
  EXPECT_EQ(
      test_util::error_message([&] { VideoReader reader(cut); }),
      "video " + cut + ": cannot open: End of file (the file ends before its index: truncated?)");
  // Damaged headers, found by fuzzing: the byte offsets are the clip's (tests/media/README.md).
  const auto patched = [&](size_t offset, const std::string& bytes) {
    const auto file = dir.file("patched.mp4");
    auto damaged = clip;
    ASSERT_LE(offset + bytes.size(), damaged.size());
    damaged.replace(offset, bytes.size(), bytes);
    write_bytes(file, damaged);
  };
  // The sample description's codec tag "avc1" at 4564 made unknown: the reader crashed (it read
  // the stream list at the negative index FFmpeg returns when it has no decoder).
  ASSERT_EQ(clip.substr(4564, 4), "avc1");
  patched(4564, "zzzz");
  EXPECT_EQ(test_util::error_message([&] { VideoReader reader(dir.file("patched.mp4")); }),
            "video " + dir.file("patched.mp4") +
                ": this FFmpeg has no decoder for its unknown (damaged file?) video");
  // The first packet's size in the sample size table (at 5227) made 1 GiB: FFmpeg says out of
  // memory, which the message explains.
  ASSERT_EQ(clip.substr(5211, 4), "stsz");
  patched(5227, std::string("\x3f\xff\xff\xff", 4));
  {
    VideoReader huge(dir.file("patched.mp4"));
    auto frames = torch::empty({1, 3, 48, 64}, torch::kUInt8);
    const auto message = test_util::error_message([&] { huge.read({0}, frames); });
    EXPECT_TRUE(contains(message,
                         ": Cannot allocate memory (a damaged packet header can ask for "
                         "more memory than there is)"))
        << message;
  }

  const auto path = media("clip_25fps.mp4");
  VideoReader reader(path);
  const auto read_error = [&](std::vector<int64_t> indices, torch::Tensor out) {
    return test_util::error_message([&] { reader.read(indices, out); });
  };
  auto message = read_error({0, 1}, torch::empty({2, 3, 48, 64}, torch::kFloat));
  EXPECT_TRUE(contains(message, "video " + path +
                                    ": expected a contiguous CPU uint8 tensor of "
                                    "shape [2,3,H,W]"))
      << message;
  EXPECT_TRUE(contains(message, "Float")) << message;
  message = read_error({0, 1}, torch::empty({3, 3, 48, 64}, torch::kUInt8));
  EXPECT_TRUE(contains(message, "[2,3,H,W]")) << message;
  message = read_error({0, 1}, torch::empty({2, 48, 64, 3}, torch::kUInt8));
  EXPECT_TRUE(contains(message, "[2,3,H,W]")) << message;
  message = read_error({0, 1}, torch::empty({2, 48, 64, 3}, torch::kUInt8).permute({0, 3, 1, 2}));
  EXPECT_TRUE(contains(message, "not contiguous")) << message;
  message = read_error({5, 1}, torch::empty({2, 3, 48, 64}, torch::kUInt8));
  EXPECT_TRUE(contains(message, "ascending")) << message;
  message = read_error({-1}, torch::empty({1, 3, 48, 64}, torch::kUInt8));
  EXPECT_TRUE(contains(message, "ascending")) << message;
  message = read_error({49, 50}, torch::empty({2, 3, 48, 64}, torch::kUInt8));
  EXPECT_EQ(message, "video " + path + ": frame 50 was requested but the video has 50 frames");
  // The reader is still usable after errors.
  auto out = torch::empty({1, 3, 48, 64}, torch::kUInt8);
  reader.read({7}, out);
  EXPECT_TRUE(out[0].equal(decode_all(path, 8, 48, 64)[7]));
}

TEST(VideoWriter, SolidColorsSurviveTheRoundTrip) {
  REQUIRE_FFMPEG();
  TempDir dir("video_writer");
  const std::vector<std::array<int, 3>> colors = {
      {255, 0, 0},     {0, 255, 0},   {0, 0, 255},   {255, 255, 255}, {0, 0, 0},
      {128, 128, 128}, {255, 255, 0}, {0, 255, 255}, {255, 0, 255},   {255, 128, 0}};
  const auto n = static_cast<int64_t>(colors.size());
  auto frames = torch::empty({n, 3, 48, 64}, torch::kUInt8);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < 3; ++c) frames[i][c].fill_(colors[i][c]);
  }
  for (const std::string name : {"solid.mp4", "solid.mkv", "solid.avi"}) {
    const auto path = dir.file(name);
    {
      VideoWriter writer(path, 64, 48, 25);
      for (int64_t i = 0; i < n; ++i) writer.write(frames[i]);
      if (name != "solid.avi") writer.finish();  // the destructor finishes the avi
    }
    VideoReader reader(path);
    EXPECT_EQ(reader.info().width, 64) << name;
    EXPECT_EQ(reader.info().height, 48) << name;
    EXPECT_NEAR(reader.info().fps, 25.0, 1e-6) << name;
    EXPECT_EQ(reader.info().frames, n) << name;
    auto back = torch::empty({n, 3, 48, 64}, torch::kUInt8);
    reader.read(range(n), back);
    const auto error = (back.to(torch::kInt) - frames.to(torch::kInt)).abs();
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_LE(error[i].max().item<int>(), 10)
          << name << " frame " << i << " color " << colors[i][0] << "," << colors[i][1] << ","
          << colors[i][2];
    }
  }
}

// The same frames must give the same file whatever the heap held before: x264's macroblock tree
// read memory it never wrote, so demo videos differed from run to run. With it on, the video
// written after the 0x5A leftovers differed here.
TEST(VideoWriter, SameFramesGiveTheSameFileWhateverTheHeapHeld) {
  REQUIRE_FFMPEG();
  TempDir dir("video_writer_deterministic");
  torch::manual_seed(7);
  // Textured, moving frames, so that the encoder has decisions to make; 80 wide as the demo's.
  const auto frames = torch::randint(0, 256, {40, 3, 64, 80}, torch::kUInt8);
  std::vector<std::string> bytes;
  for (const int leftover : {0x00, 0xFF, 0x5A}) {
    // Leave freed blocks of about a frame buffer's size filled with `leftover`.
    std::vector<void*> blocks;
    for (size_t size = 1024; size <= (size_t{1} << 17); size += 1024) {
      void* block = nullptr;
      ASSERT_EQ(posix_memalign(&block, 64, size), 0);
      std::memset(block, leftover, size);
      blocks.push_back(block);
    }
    for (void* block : blocks) std::free(block);
    const auto path = dir.file("same" + std::to_string(leftover) + ".mp4");
    {
      VideoWriter writer(path, 80, 64, 25);
      for (int64_t i = 0; i < frames.size(0); ++i) writer.write(frames[i]);
    }
    bytes.push_back(read_bytes(path));
    ASSERT_FALSE(bytes.back().empty());
  }
  for (size_t i = 1; i < bytes.size(); ++i) {
    EXPECT_TRUE(bytes[i] == bytes[0]) << "the video written after leaving other leftovers differs ("
                                      << bytes[i].size() << " vs " << bytes[0].size() << " bytes)";
  }
}

TEST(VideoWriter, BadArgumentsAreErrorsNamingTheFile) {
  REQUIRE_FFMPEG();
  TempDir dir("video_writer_errors");
  const auto path = dir.file("x.mp4");
  auto message = test_util::error_message([&] { VideoWriter writer(path, 63, 48, 25); });
  EXPECT_TRUE(contains(message, "video " + path + ": width and height must be even")) << message;
  message = test_util::error_message([&] { VideoWriter writer(path, 64, 48, 0); });
  EXPECT_TRUE(contains(message, "fps")) << message;
  message =
      test_util::error_message([&] { VideoWriter writer(dir.file("x.unknown"), 64, 48, 25); });
  EXPECT_TRUE(contains(message, "x.unknown: no container format")) << message;
  message =
      test_util::error_message([&] { VideoWriter writer(dir.file("missing/x.mp4"), 64, 48, 25); });
  EXPECT_TRUE(contains(message, "missing/x.mp4: cannot create: No such file or directory"))
      << message;

  VideoWriter writer(path, 64, 48, 25);
  message = test_util::error_message([&] {
    writer.write(torch::zeros({3, 48, 62}, torch::kUInt8));
  });
  EXPECT_TRUE(contains(message, "video " + path + ": expected a uint8 frame of shape [3,48,64]"))
      << message;
  message = test_util::error_message([&] { writer.write(torch::zeros({3, 48, 64})); });
  EXPECT_TRUE(contains(message, "[3,48,64], got Float")) << message;
  writer.write(torch::zeros({3, 48, 64}, torch::kUInt8));
  writer.finish();
  writer.finish();  // a second finish does nothing
  message = test_util::error_message([&] {
    writer.write(torch::zeros({3, 48, 64}, torch::kUInt8));
  });
  EXPECT_TRUE(contains(message, "write() after finish()")) << message;
}

TEST(Images, ReadsJpegFramesAndSizes) {
  REQUIRE_FFMPEG();
  std::vector<torch::Tensor> frames;
  for (int i = 1; i <= 5; ++i) {
    const auto path = media("frames/00000" + std::to_string(i) + ".jpg");
    EXPECT_EQ(data::image_size(path), (std::pair<int64_t, int64_t>{24, 32}));
    frames.push_back(torch::empty({3, 24, 32}, torch::kUInt8));
    data::read_image(path, frames.back());
    if (i > 1) {
      EXPECT_FALSE(frames[i - 1].equal(frames[i - 2])) << path;
    }
  }
  // frames/000001.jpg and frame.png are the same frame, lossy and lossless. JPEG's half-size
  // chroma costs this tiny saturated picture about 16 levels (FFmpeg's CLI decodes it the same);
  // swapped channels would cost 60.
  EXPECT_EQ(data::image_size(media("frame.png")), (std::pair<int64_t, int64_t>{24, 32}));
  auto png = torch::empty({3, 24, 32}, torch::kUInt8);
  data::read_image(media("frame.png"), png);
  EXPECT_LT(mean_abs_diff(frames[0], png), 18);
  EXPECT_GT(mean_abs_diff(frames[0], png.flip(0)), 40);
  // TIFF (CVC-ClinicDB's format): frame.png saved as an uncompressed TIFF by PIL, read exactly.
  EXPECT_EQ(data::image_size(media("frame.tiff")), (std::pair<int64_t, int64_t>{24, 32}));
  auto tiff = torch::empty({3, 24, 32}, torch::kUInt8);
  data::read_image(media("frame.tiff"), tiff);
  EXPECT_TRUE(tiff.equal(png));
  // GIF (Carvana's masks): the same frame quantised to a palette by PIL.
  EXPECT_EQ(data::image_size(media("frame.gif")), (std::pair<int64_t, int64_t>{24, 32}));
  auto gif = torch::empty({3, 24, 32}, torch::kUInt8);
  data::read_image(media("frame.gif"), gif);
  EXPECT_LT(mean_abs_diff(gif, png), 8);
  // Resized on read.
  auto small = torch::empty({3, 12, 16}, torch::kUInt8);
  data::read_image(media("frame.png"), small);
  EXPECT_LT((small.to(torch::kFloat).mean({1, 2}) - png.to(torch::kFloat).mean({1, 2}))
                .abs()
                .max()
                .item<double>(),
            2);
}

TEST(Images, ExifOrientationIsShownUpright) {
  REQUIRE_FFMPEG();
  // tests/media/README.md: one upright 32x24 picture (grey; top left white, top right red,
  // bottom left blue, 8x8 each) stored as each EXIF orientation says, as phone cameras store
  // photos; PIL's exif_transpose and the ffmpeg CLI show every file as the upright picture, and
  // annotation tools draw masks on what they show.
  auto upright = torch::full({3, 24, 32}, 128, torch::kUInt8);
  upright.slice(1, 0, 8).slice(2, 0, 8).fill_(255);
  auto red = upright.slice(1, 0, 8).slice(2, 24, 32);
  red[0].fill_(255), red[1].fill_(0), red[2].fill_(0);
  auto blue = upright.slice(1, 16, 24).slice(2, 0, 8);
  blue[0].fill_(0), blue[1].fill_(0), blue[2].fill_(255);
  auto small_upright = torch::empty({3, 12, 16}, torch::kUInt8);
  data::read_image(media("exif/orientation_1.jpg"), small_upright);
  for (int orientation = 1; orientation <= 8; ++orientation) {
    const auto path = media("exif/orientation_" + std::to_string(orientation) + ".jpg");
    EXPECT_EQ(data::image_size(path), (std::pair<int64_t, int64_t>{24, 32})) << path;
    auto shown = torch::empty({3, 24, 32}, torch::kUInt8);
    data::read_image(path, shown);
    EXPECT_LT(mean_abs_diff(shown, upright), 4) << path;
    // Resized on read: scaled as stored, then turned.
    auto small = torch::empty({3, 12, 16}, torch::kUInt8);
    data::read_image(path, small);
    EXPECT_LT(mean_abs_diff(small, small_upright), 4) << path;
  }
  // Mirrored or turned the wrong way, the markers land elsewhere.
  EXPECT_GT(mean_abs_diff(upright.flip({2}), upright), 20);
  EXPECT_GT(mean_abs_diff(upright.flip({1}), upright), 20);
}

TEST(Images, MasksAreReadAsClassIdsInEveryLosslessFlavour) {
  REQUIRE_FFMPEG();
  // tests/media/README.md: one 8x6 mask, id(x, y) = (x + 2y) % 5, as PIL writes it.
  const auto y = torch::arange(6).view({6, 1}), x = torch::arange(8).view({1, 8});
  const auto ids = (x + 2 * y) % 5;
  for (const char* name :
       {"palette.png", "gray8.png", "gray16.png", "gray_alpha.png", "rgb_equal.png"}) {
    const auto read = data::read_label_image(media(std::string("masks/") + name));
    EXPECT_EQ(read.scalar_type(), torch::kLong) << name;
    EXPECT_TRUE(read.equal(ids)) << name << "\n" << read;
  }
  // A palette mask read as a picture gives its colours: VOC's id 2 is dark green, (0,128,0),
  // whose red channel said "class 0" before masks were read as ids.
  auto as_picture = torch::empty({3, 6, 8}, torch::kUInt8);
  data::read_image(media("masks/palette.png"), as_picture);
  EXPECT_FALSE(as_picture[0].to(torch::kLong).equal(ids));
  EXPECT_TRUE(data::read_label_image(media("masks/binary1.png")).equal(ids % 2));
  EXPECT_TRUE(
      contains(test_util::error_message([] { data::read_label_image(media("masks/colour.png")); }),
               "colour mask (pixel x=1 y=0 is RGB 50,20,10)"));
  EXPECT_TRUE(
      contains(test_util::error_message([] { data::read_label_image(media("masks/ids.jpg")); }),
               "save masks losslessly, as PNG"));
  EXPECT_TRUE(contains(test_util::error_message([] { data::read_label_image(media("none.png")); }),
                       "none.png"));
}

TEST(Images, ClassIdsRoundTripAsGrayPng) {
  REQUIRE_FFMPEG();
  TempDir dir("label_images");
  const auto small = torch::randint(0, 256, {5, 7}, torch::kLong);
  data::write_label_image(dir.file("small.png"), small);
  EXPECT_TRUE(data::read_label_image(dir.file("small.png")).equal(small));
  EXPECT_EQ(read_bytes(dir.file("small.png")).substr(24, 2), std::string("\x08\x00", 2))
      << "8-bit gray (IHDR bit depth 8, colour type 0)";
  const auto wide = torch::randint(0, 65536, {4, 3}, torch::kInt32);
  data::write_label_image(dir.file("wide.png"), wide);
  EXPECT_TRUE(data::read_label_image(dir.file("wide.png")).equal(wide.to(torch::kLong)));
  EXPECT_EQ(read_bytes(dir.file("wide.png")).substr(24, 2), std::string("\x10\x00", 2))
      << "16-bit gray";
  EXPECT_TRUE(
      contains(test_util::error_message([&] {
                 data::write_label_image(dir.file("x.png"), torch::full({2, 2}, -1, torch::kLong));
               }),
               "must be 0-65535"));
  EXPECT_TRUE(contains(test_util::error_message([&] {
                         data::write_label_image(dir.file("x.png"), torch::zeros({2, 2}));
                       }),
                       "integers"));
}

TEST(Images, WriteReadRoundTrip) {
  REQUIRE_FFMPEG();
  TempDir dir("images");
  torch::manual_seed(0);
  // Odd sizes; PNG is lossless.
  const auto noise = torch::randint(0, 256, {3, 17, 23}, torch::kUInt8);
  data::write_image(dir.file("noise.png"), noise);
  EXPECT_EQ(data::image_size(dir.file("noise.png")), (std::pair<int64_t, int64_t>{17, 23}));
  auto back = torch::empty({3, 17, 23}, torch::kUInt8);
  data::read_image(dir.file("noise.png"), back);
  EXPECT_TRUE(back.equal(noise));

  // JPEG of smooth content is close; better quality is closer.
  const auto y = torch::arange(48).view({48, 1}).expand({48, 64});
  const auto x = torch::arange(64).view({1, 64}).expand({48, 64});
  const auto smooth = torch::stack({x * 3 + 20, y * 4 + 10, (x + y) * 2}).to(torch::kUInt8);
  double previous = 1e9;
  for (int quality : {20, 2}) {
    const auto path = dir.file("smooth_q" + std::to_string(quality) + ".JPEG");
    data::write_image(path, smooth, quality);
    EXPECT_EQ(data::image_size(path), (std::pair<int64_t, int64_t>{48, 64}));
    auto jpeg = torch::empty({3, 48, 64}, torch::kUInt8);
    data::read_image(path, jpeg);
    const double error = mean_abs_diff(jpeg, smooth);
    EXPECT_LT(error, quality == 2 ? 4 : 10) << path;
    EXPECT_LT(error, previous) << path;
    previous = error;
  }
}

TEST(Images, CorruptJpegIsAnErrorNotGarbage) {
  REQUIRE_FFMPEG();
  // tests/media/README.md: a frame with 64 bytes of its picture data zeroed. FFmpeg would conceal
  // the damage and return a picture unless told to fail.
  const auto path = media("corrupt.jpg");
  EXPECT_EQ(data::image_size(path), (std::pair<int64_t, int64_t>{24, 32})) << "header intact";
  auto out = torch::empty({3, 24, 32}, torch::kUInt8);
  auto message = test_util::error_message([&] { data::read_image(path, out); });
  EXPECT_TRUE(contains(message, "image " + path + ": cannot decode (corrupt or not an image): "))
      << message;

  TempDir dir("corrupt_images");
  const auto jpeg = read_bytes(media("frames/000003.jpg"));
  const auto png = read_bytes(media("frame.png"));
  const std::map<std::string, std::string> damaged = {
      {"cut.jpg", jpeg.substr(0, 450)},
      {"header_only.jpg", jpeg.substr(0, 200)},
      {"empty.jpg", ""},
      {"text.png", "not an image\n"},
      {"cut.png", png.substr(0, png.size() / 2)},
      {"flipped.png", png.substr(0, 100) + static_cast<char>(png[100] ^ 0x55) + png.substr(101)},
  };
  for (const auto& [name, bytes] : damaged) {
    const auto file = dir.file(name);
    write_bytes(file, bytes);
    message = test_util::error_message([&] { data::read_image(file, out); });
    EXPECT_TRUE(contains(message, "image " + file + ": ")) << name << ": " << message;
    EXPECT_TRUE(contains(message, name == "empty.jpg" ? "empty" : "cannot decode"))
        << name << ": " << message;
  }
}

TEST(Images, BadFilesAndArgumentsAreErrorsNamingTheFile) {
  REQUIRE_FFMPEG();
  const auto missing = media("no_such_image.jpg");
  auto out = torch::empty({3, 24, 32}, torch::kUInt8);
  EXPECT_EQ(test_util::error_message([&] { data::read_image(missing, out); }),
            "image " + missing + ": cannot open: No such file or directory");
  EXPECT_EQ(test_util::error_message([&] { data::image_size(missing); }),
            "image " + missing + ": cannot open: No such file or directory");
  const auto path = media("frame.png");
  auto message = test_util::error_message([&] {
    data::read_image(path, torch::empty({1, 3, 24, 32}, torch::kUInt8));
  });
  EXPECT_TRUE(contains(message, "image " + path +
                                    ": expected a contiguous CPU uint8 tensor of "
                                    "shape [3,H,W]"))
      << message;
  message = test_util::error_message([&] { data::read_image(path, torch::empty({3, 24, 32})); });
  EXPECT_TRUE(contains(message, "got Float")) << message;

  TempDir dir("image_errors");
  const auto frame = torch::zeros({3, 4, 4}, torch::kUInt8);
  message = test_util::error_message([&] { data::write_image(dir.file("x.gif"), frame); });
  EXPECT_TRUE(contains(message, "x.gif: unknown image extension '.gif'")) << message;
  message = test_util::error_message([&] { data::write_image(dir.file("x.jpg"), frame, 0); });
  EXPECT_TRUE(contains(message, "quality must be 1-31")) << message;
  message = test_util::error_message([&] {
    data::write_image(dir.file("x.png"), torch::zeros({4, 4, 3}, torch::kUInt8));
  });
  EXPECT_TRUE(contains(message, "shape [3,H,W]")) << message;
  message = test_util::error_message([&] { data::write_image(dir.file("no/x.png"), frame); });
  EXPECT_TRUE(contains(message, "no/x.png: cannot create: No such file or directory")) << message;
}
