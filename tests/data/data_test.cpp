// Labels, manifests, data sets (video files and frame folders), sampling, transforms, epoch
// orders, prefetching, and every bad-input case of the data pipeline.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <array>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>

#include "test_util.h"

#include "framefit/data/clips.h"
#include "framefit/data/dataset.h"
#include "framefit/data/features.h"
#include "framefit/data/labels.h"
#include "framefit/data/media.h"
#include "framefit/data/segmentation.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/weights.h"

using namespace framefit;

namespace {

const std::string kMedia = std::string(FRAMEFIT_SOURCE_DIR) + "/tests/media";

// A scratch folder per test, removed afterwards.
// decode_video_pieces's frames put together (cloned: each piece's buffer is reused), and the
// sizes of its pieces.
torch::Tensor joined_pieces(const std::string& path, double folder_fps,
                            const data::DataOptions& options, int64_t piece,
                            std::vector<int64_t>* sizes = nullptr,
                            data::DecodedVideo* decoded = nullptr) {
  std::vector<torch::Tensor> pieces;
  auto result =
      data::decode_video_pieces(path, folder_fps, options, piece, [&](const torch::Tensor& frames) {
        pieces.push_back(frames.clone());
        if (sizes) sizes->push_back(frames.size(0));
      });
  EXPECT_FALSE(result.frames.defined());
  if (decoded) *decoded = std::move(result);
  return torch::cat(pieces);
}

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/framefit_data_test_" +
           std::string(::testing::UnitTest::GetInstance()->current_test_info()->name());
    test_util::remove_tree(dir_);
    ::mkdir(dir_.c_str(), 0755);
  }
  void TearDown() override { test_util::remove_tree(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const auto path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  // Annotations for `frames` frames: the first half phase a, the rest b.
  std::string labels(const std::string& name, int64_t frames, const std::string& a = "a",
                     const std::string& b = "b") {
    std::string text = "Frame\tPhase\n";
    for (int64_t i = 0; i < frames; ++i)
      text += std::to_string(i) + "\t" + (i < frames / 2 ? a : b) + "\n";
    return write(name, text);
  }
  std::string dir_;
  const data::ClassList classes_{{"a", "b"}};
};

bool skip_without_ffmpeg() {
#ifdef FRAMEFIT_WITH_FFMPEG
  return false;
#else
  return true;
#endif
}

}  // namespace

TEST_F(DataTest, AnnotationsParseAndExplainEveryProblem) {
  const auto good = write("good.txt", "Frame\tPhase\n0\ta\n1 b\n2\tb\n");
  const auto ids = data::read_phase_annotations(good, classes_);
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 1, 1}));
  // Tab-separated names may hold spaces; a phase may be given by its index in the class list.
  const data::ClassList spaced({"Preparation", "Calot triangle dissection"});
  const auto names =
      write("names.txt", "Frame\tPhase\n0\tPreparation\n1\tCalot triangle dissection\n2\t1\n3 0\n");
  EXPECT_EQ(data::read_phase_annotations(names, spaced), (std::vector<int64_t>{0, 1, 1, 0}));
  // MS-TCN's ground truth (GTEA, 50Salads, Breakfast): one label per line, nothing else.
  const auto per_line = write("per_line.txt", "b\r\nb\r\na\r\n\r\nb\r\n1\r\n");
  EXPECT_EQ(data::read_phase_annotations(per_line, classes_),
            (std::vector<int64_t>{1, 1, 0, 1, 1}));

  auto error = [&](const std::string& text) {
    const auto path = write("bad.txt", text);
    return test_util::error_message([&] { data::read_phase_annotations(path, classes_); });
  };
  EXPECT_NE(error("Frame\tPhase\n0\ta\n1\tc\n").find("bad.txt:3: unknown phase \"c\""),
            std::string::npos)
      << error("Frame\tPhase\n0\ta\n1\tc\n");
  EXPECT_NE(error("Frame\tPhase\n0\ta\n2\tb\n").find("bad.txt:3: frame 2 where frame 1"),
            std::string::npos);
  EXPECT_NE(error("Frame\tPhase\n0\ta\n0\tb\n").find("bad.txt:3"), std::string::npos);
  EXPECT_NE(error("Frame\tPhase\n0\ta b\n").find("bad.txt:2"), std::string::npos);
  EXPECT_NE(error("Frame\tPhase\n0 a b\n").find("bad.txt:2: expected"), std::string::npos);
  EXPECT_NE(error("Frame\tPhase\n0\ta\tb\n").find("bad.txt:2: expected"), std::string::npos);
  EXPECT_NE(error("Frame\tPhase\n0\t2\n").find("unknown phase \"2\""), std::string::npos);
  EXPECT_NE(error("Frame\tPhase\nx\ta\n").find("not a non-negative integer"), std::string::npos);
  EXPECT_NE(error("Frame\tPhase\n").find("no frames"), std::string::npos);
  EXPECT_NE(error("a\nb\n2\tb\n").find("bad.txt:3: expected one label per line"),
            std::string::npos);
  EXPECT_NE(error("0\ta\nb\n").find("bad.txt:2: expected `<frame><TAB><phase>`"),
            std::string::npos);
  EXPECT_NE(error("a\nc\n").find("bad.txt:2: unknown phase \"c\""), std::string::npos);
  EXPECT_NE(test_util::error_message([&] {
              data::read_phase_annotations(dir_ + "/none.txt", classes_);
            }).find("none.txt: cannot open"),
            std::string::npos);
  EXPECT_NE(test_util::error_message([] {
              data::ClassList({"a", "a"});
            }).find("twice"),
            std::string::npos);

  // Written annotations read back.
  data::write_phase_annotations(dir_ + "/out.txt", {1, 0, 1}, classes_);
  EXPECT_EQ(data::read_phase_annotations(dir_ + "/out.txt", classes_),
            (std::vector<int64_t>{1, 0, 1}));
}

TEST_F(DataTest, ManifestResolvesPathsAndNamesBadLines) {
  const auto path = write("m.csv",
                          "video,labels,split,fps\n"
                          "v1.mp4,l1.txt,train,\n"
                          "\"with, comma.mp4\",/abs/l2.txt,val,25\n");
  const auto entries = data::read_manifest(path);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].video, dir_ + "/v1.mp4");
  EXPECT_EQ(entries[0].name, "v1");
  EXPECT_EQ(entries[0].split, "train");
  EXPECT_EQ(entries[1].video, dir_ + "/with, comma.mp4");
  EXPECT_EQ(entries[1].labels, "/abs/l2.txt");
  EXPECT_DOUBLE_EQ(entries[1].fps, 25);
  EXPECT_EQ(data::select_split(entries, "val").size(), 1u);

  // A split no setting names is reported with its videos (a typo would drop them silently).
  EXPECT_EQ(data::unused_splits(entries, {"train", "val", "test"}), "");
  std::vector<data::VideoEntry> typo = entries;
  typo.push_back({"v3", "v3.mp4", "l3.txt", "trian", 0});
  typo.push_back({"v4", "v4.mp4", "l4.txt", "trian", 0});
  EXPECT_EQ(data::unused_splits(typo, {"train", "val", "test"}),
            "2 videos in split \"trian\" (v3, v4) used by none of the splits train, val, test: "
            "check the manifest's split column");

  // Round trip.
  data::write_manifest(dir_ + "/w.csv", entries);
  const auto again = data::read_manifest(dir_ + "/w.csv");
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(again[1].video, entries[1].video);
  // The annotation's own rate (labels_fps), for the rows that give one.
  auto rated = entries;
  rated[1].labels_fps = 25;
  data::write_manifest(dir_ + "/r.csv", rated);
  const auto rated_again = data::read_manifest(dir_ + "/r.csv");
  EXPECT_DOUBLE_EQ(rated_again[0].labels_fps, 0);
  EXPECT_DOUBLE_EQ(rated_again[1].labels_fps, 25);

  auto error = [&](const std::string& text) {
    const auto p = write("bad.csv", text);
    return test_util::error_message([&] { data::read_manifest(p); });
  };
  EXPECT_NE(error("video,split\nx,train\n").find("bad.csv:1"), std::string::npos);
  EXPECT_NE(error("video,labels,colour\n").find("unknown column \"colour\""), std::string::npos);
  EXPECT_NE(error("video,labels\na.mp4\n").find("bad.csv:2: 1 fields where the header has 2"),
            std::string::npos);
  EXPECT_NE(error("video,labels,fps\na,b,-3\n").find("bad.csv:2: fps"), std::string::npos);
  EXPECT_NE(error("video,labels,fps\na,b,inf\n").find("bad.csv:2: fps \"inf\""), std::string::npos);
  EXPECT_NE(error("video,labels,labels_fps\na,b,x\n").find("bad.csv:2: labels_fps \"x\""),
            std::string::npos);
  EXPECT_NE(error("").find("empty"), std::string::npos);
  // Found by fuzzing: a repeated line trained its video twice as often without a word, and a NUL
  // byte cut the path (and every message quoting it) short.
  EXPECT_EQ(error("video,labels\na/v.mp4,l1\nb.mp4,l2\nb/v.mp4,l3\n"),
            dir_ +
                "/bad.csv:4: a second video named \"v\" (the first is on line 2); give each "
                "video its own `name`");
  EXPECT_EQ(error(std::string("video,labels\nv.mp\0"
                              "4,l1\n",
                              23)),
            dir_ + "/bad.csv:2: holds a NUL byte: not a text file, or a damaged one");
  const auto nul = write("nul.txt", std::string("0\ta\n1\t\0\n", 8));
  EXPECT_EQ(test_util::error_message([&] {
              data::read_phase_annotations(nul, data::ClassList({"a", "b"}));
            }),
            nul + ":2: holds a NUL byte: not a text file, or a damaged one");

  // A UTF-8 byte-order mark (spreadsheet exports, Windows editors) and CRLF line ends are read
  // as plain text, in manifests and annotation files alike.
  const auto bom = write("bom.csv", "\xEF\xBB\xBFname,video,labels\r\nv,v.mp4,l.txt\r\n");
  const auto with_bom = data::read_manifest(bom);
  ASSERT_EQ(with_bom.size(), 1u);
  EXPECT_EQ(with_bom[0].name, "v");
  EXPECT_EQ(with_bom[0].labels, dir_ + "/l.txt");
  const auto annotations = write("bom.txt",
                                 "\xEF\xBB\xBF"
                                 "Frame\tPhase\r\n0\tb\r\n1\ta\r\n");
  EXPECT_EQ(data::read_phase_annotations(annotations, data::ClassList({"a", "b"})),
            (std::vector<int64_t>{1, 0}));
}

TEST_F(DataTest, VideoFileSampledResizedCroppedAndLocated) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  const auto l = labels("clip.txt", 50);
  data::DataOptions options;
  options.fps = 5;                // 25 fps source: every 5th frame
  options.transform.resize = 24;  // 64x48 -> 32x24
  options.transform.crop = 20;
  std::vector<data::VideoEntry> entries = {{"clip", kMedia + "/clip_25fps.mp4", l, "train", 0},
                                           {"clip2", kMedia + "/clip_25fps.mp4", l, "train", 0}};
  data::VideoDataset set(entries, classes_, options);
  ASSERT_EQ(set.size(), 2);
  EXPECT_EQ(set.frames(0), 10);
  EXPECT_EQ(set.total_frames(), 20);
  EXPECT_EQ(set.frame_size(0), std::make_pair(int64_t{20}, int64_t{20}));
  const auto video = set.load(0);
  EXPECT_EQ(video.frames.sizes(), (std::vector<int64_t>{10, 3, 20, 20}));
  EXPECT_EQ(video.frames.scalar_type(), torch::kUInt8);
  // Source frames 0, 5, ..., 45: the first half (frames < 25) are phase a.
  EXPECT_TRUE(
      torch::equal(video.labels, torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, 1}, torch::kLong)));
  EXPECT_EQ(set.locate(0), std::make_pair(int64_t{0}, int64_t{0}));
  EXPECT_EQ(set.locate(9), std::make_pair(int64_t{0}, int64_t{9}));
  EXPECT_EQ(set.locate(10), std::make_pair(int64_t{1}, int64_t{0}));
  EXPECT_EQ(set.locate(19), std::make_pair(int64_t{1}, int64_t{9}));
  EXPECT_NE(test_util::error_message([&] { set.locate(20); }).find("outside"), std::string::npos);

  // A crop and flip apply to every frame of the video alike.
  data::Augmentation flip_and_corner{0, 0, true};
  const auto augmented = set.load(0, flip_and_corner);
  data::DataOptions uncropped = options;
  uncropped.transform.crop = 0;
  const auto full = data::VideoDataset(entries, classes_, uncropped).load(0);
  EXPECT_TRUE(
      torch::equal(augmented.frames, full.frames.narrow(2, 0, 20).narrow(3, 0, 20).flip({3})));

  // Inference decoding (no labels) gives the same frames, center-cropped.
  const auto decoded = data::decode_video(kMedia + "/clip_25fps.mp4", 0, options);
  EXPECT_TRUE(torch::equal(decoded.frames, video.frames));
  EXPECT_EQ(decoded.source_frames.back(), 45);
  EXPECT_DOUBLE_EQ(decoded.source_fps, 25);
  ASSERT_EQ(decoded.source_seconds.size(), decoded.source_frames.size());
  for (size_t k = 0; k < decoded.source_frames.size(); ++k) {
    EXPECT_DOUBLE_EQ(decoded.source_seconds[k], decoded.source_frames[k] / 25.0);
  }
  // ... and so does it a piece at a time (pieces of 4: 4, 4, 2), as does the data set's video.
  std::vector<int64_t> sizes;
  data::DecodedVideo pieces;
  EXPECT_TRUE(torch::equal(
      joined_pieces(kMedia + "/clip_25fps.mp4", 0, options, 4, &sizes, &pieces), video.frames));
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(pieces.source_frames, decoded.source_frames);
  EXPECT_EQ(pieces.source_seconds, decoded.source_seconds);
  std::vector<torch::Tensor> loaded;
  const auto labelled =
      set.load_pieces(0, 3, [&](const torch::Tensor& f) { loaded.push_back(f.clone()); });
  EXPECT_FALSE(labelled.frames.defined());
  EXPECT_TRUE(torch::equal(torch::cat(loaded), video.frames));
  EXPECT_TRUE(torch::equal(labelled.labels, video.labels));
  EXPECT_EQ(labelled.name, "clip");
  EXPECT_NE(test_util::error_message([&] {
              data::decode_video_pieces(kMedia + "/clip_25fps.mp4", 0, options, 0,
                                        [](const torch::Tensor&) {});
            }).find("at least one at a time"),
            std::string::npos);
}

TEST_F(DataTest, VariableRateVideoIsSampledByItsTimestamps) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  // tests/media/README.md: frames 0-9 at 25 fps, then 10 frames 0.12 s apart (average rate
  // 14.7 fps). Sampled at 5 fps by index at the average rate, frames 0, 3, 7, ... would stand for
  // 0, 0.2, 0.4 s, ...: frame 7 is at 0.28 s and frame 17 at 1.24 s, not 1.2 s.
  const std::string path = kMedia + "/variable_rate.mp4";
  data::DataOptions options;
  options.fps = 5;
  const auto decoded = data::decode_video(path, 0, options);
  EXPECT_EQ(decoded.source_frames, (std::vector<int64_t>{0, 5, 10, 12, 13, 15, 17, 18}));
  const std::vector<double> seconds = {0, 0.2, 0.4, 0.64, 0.76, 1.0, 1.24, 1.36};
  ASSERT_EQ(decoded.source_seconds.size(), seconds.size());
  for (size_t k = 0; k < seconds.size(); ++k) {
    EXPECT_NEAR(decoded.source_seconds[k], seconds[k], 1e-9) << "sampled frame " << k;
  }
  // Training samples the same frames, and their labels with them.
  const auto l = labels("variable_rate.txt", 20);
  data::VideoDataset set({{"v", path, l, "train", 0}}, classes_, options);
  EXPECT_EQ(set.frames(0), 8);
  const auto expected = data::read_phase_annotations(l, classes_);
  const auto sampled_labels = set.labels(0);
  for (size_t k = 0; k < decoded.source_frames.size(); ++k) {
    EXPECT_EQ(sampled_labels[static_cast<int64_t>(k)].item<int64_t>(),
              expected[static_cast<size_t>(decoded.source_frames[k])]);
  }
  EXPECT_TRUE(torch::equal(set.load(0).frames, decoded.frames));
  EXPECT_TRUE(torch::equal(joined_pieces(path, 0, options, 3), decoded.frames));

  // The same stream in Matroska, which stores no frame count (its duration x rate estimate is 22
  // frames, and decoding stopped at 20 as a truncated file) and whose rates agree: the frames are
  // counted and sampled by their timestamps all the same.
  const std::string matroska = kMedia + "/variable_rate.mkv";
  EXPECT_TRUE(data::VideoReader(matroska).info().frames_estimated);
  EXPECT_EQ(data::decode_video(matroska, 0, options).source_frames, decoded.source_frames);
  data::DataOptions every = options;
  every.fps = 0;
  EXPECT_EQ(data::decode_video(matroska, 0, every).frames.size(0), 20);
  EXPECT_EQ(data::VideoDataset({{"v", matroska, l, "train", 0}}, classes_, options).frames(0), 8);
}

TEST_F(DataTest, FrameFolderNeedsItsRateAndReadsInFrameNumberOrder) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  const auto l = labels("frames.txt", 5);
  data::DataOptions options;
  options.fps = 0;  // every frame
  data::VideoDataset set({{"f", kMedia + "/frames", l, "train", 0}}, classes_, options);
  const auto video = set.load(0);
  EXPECT_EQ(video.frames.sizes(), (std::vector<int64_t>{5, 3, 24, 32}));
  // Frame 3 of the folder is 000003.jpg, decoded alone into the same size.
  data::DataOptions one = options;
  const auto alone = data::decode_video(kMedia + "/frames", 0, one).frames[2];
  EXPECT_TRUE(torch::equal(alone, video.frames[2]));
  std::vector<int64_t> sizes;
  EXPECT_TRUE(torch::equal(joined_pieces(kMedia + "/frames", 0, one, 2, &sizes), video.frames));
  EXPECT_EQ(sizes, (std::vector<int64_t>{2, 2, 1}));

  options.fps = 2;
  EXPECT_NE(test_util::error_message([&] {
              data::VideoDataset({{"f", kMedia + "/frames", l, "train", 0}}, classes_, options);
            }).find("fps column"),
            std::string::npos);
  data::VideoDataset sampled({{"f", kMedia + "/frames", l, "train", 4}}, classes_, options);
  EXPECT_EQ(sampled.frames(0), 3);  // 4 fps -> 2 fps: frames 0, 2, 4

  // Unpadded numbers, as ffmpeg's frame_%d.jpg writes them, are read in number order (frame_10
  // after frame_9, not after frame_1): 12 copies of the folder's frames, frame k of frame_k.jpg
  // being the folder's frame k % 5.
  const auto unpadded = dir_ + "/unpadded";
  ::mkdir(unpadded.c_str(), 0755);
  const auto sources = data::list_images(kMedia + "/frames");
  ASSERT_EQ(sources.size(), 5u);
  for (int k = 0; k < 12; ++k) {
    std::ifstream in(sources[static_cast<size_t>(k % 5)], std::ios::binary);
    std::ofstream(unpadded + "/frame_" + std::to_string(k) + ".jpg", std::ios::binary)
        << in.rdbuf();
  }
  options.fps = 0;
  data::VideoDataset twelve({{"u", unpadded, labels("u.txt", 12), "train", 0}}, classes_, options);
  const auto read = twelve.load(0).frames;
  for (int64_t k = 0; k < 12; ++k) EXPECT_TRUE(torch::equal(read[k], video.frames[k % 5])) << k;
}

TEST_F(DataTest, AnnotationsAtTheirOwnRateFollowTheFramesByTime) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  const auto annotation = [&](const std::string& name, int64_t lines, int64_t first_b) {
    std::string text;
    for (int64_t j = 0; j < lines; ++j) text += j < first_b ? "a\n" : "b\n";
    return write(name, text);
  };
  data::DataOptions every;  // every source frame, so labels show the mapping frame by frame
  // Cholec80 as usually prepared: frames extracted at 1 fps, phases annotated at 25 fps. The
  // folder's 5 frames stand for 5 s; 123 lines (4.92 s) describe the same time, and folder frame k
  // takes line 25 k: lines 0-49 a, the rest b give a a b b b.
  const auto cholec = annotation("cholec.txt", 123, 50);
  data::VideoEntry folder{"f", kMedia + "/frames", cholec, "train", 1};
  folder.labels_fps = 25;
  EXPECT_TRUE(torch::equal(data::VideoDataset({folder}, classes_, every).labels(0),
                           torch::tensor({0, 0, 1, 1, 1}, torch::kLong)));
  // The same from data.labels_fps (DataOptions) for rows without their own.
  data::VideoEntry plain = folder;
  plain.labels_fps = 0;
  data::DataOptions rated = every;
  rated.labels_fps = 25;
  EXPECT_TRUE(torch::equal(data::VideoDataset({plain}, classes_, rated).labels(0),
                           torch::tensor({0, 0, 1, 1, 1}, torch::kLong)));
  // Without it, the count mismatch suggests labels_fps.
  EXPECT_NE(test_util::error_message([&] {
              data::VideoDataset({plain}, classes_, every);
            }).find("give it as labels_fps"),
            std::string::npos);
  // An annotation lasting 8 s for 5 s of frames, and a folder of unknown rate, are refused.
  folder.labels = annotation("long.txt", 200, 50);
  EXPECT_NE(test_util::error_message([&] {
              data::VideoDataset({folder}, classes_, every);
            }).find("has 200 frames at labels_fps 25 (8 s) but " + kMedia + "/frames lasts 5 s"),
            std::string::npos);
  folder.labels = cholec;
  folder.fps = 0;
  EXPECT_NE(test_util::error_message([&] {
              data::VideoDataset({folder}, classes_, every);
            }).find("needs the folder's frame rate"),
            std::string::npos);

  // A variable-rate video (frames 0.04 s apart, then 0.12 s; 1.6 s) annotated on a 25 fps
  // timeline, 40 lines, b from line 20 (0.8 s): by time, the first 14 frames (up to 0.76 s) are
  // a. By index (20 frames at the average rate) frame 10 would already be b.
  data::VideoEntry vfr{"v", kMedia + "/variable_rate.mp4", annotation("vfr.txt", 40, 20), "train",
                       0};
  vfr.labels_fps = 25;
  std::vector<int64_t> expected(20, 1);
  std::fill(expected.begin(), expected.begin() + 14, 0);
  EXPECT_TRUE(torch::equal(data::VideoDataset({vfr}, classes_, every).labels(0),
                           torch::tensor(expected, torch::kLong)));
  // Sampled at 5 fps, the sampled frames keep their labels.
  data::DataOptions five = every;
  five.fps = 5;
  const data::VideoDataset sampled({vfr}, classes_, five);
  const auto frames = data::decode_video(vfr.video, 0, five).source_frames;
  for (size_t k = 0; k < frames.size(); ++k) {
    EXPECT_EQ(sampled.labels(0)[static_cast<int64_t>(k)].item<int64_t>(),
              expected[static_cast<size_t>(frames[k])]);
  }
  EXPECT_EQ(data::labels_at_times({4, 5, 6}, 2, {0, 0.49, 0.5, 1.0, 7}),
            (std::vector<int64_t>{4, 4, 5, 6, 6}));
}

TEST_F(DataTest, ToolAnnotationsParseByNameAndFollowTheFramesByTime) {
  // Cholec80's layout: a header naming the tools, one line per 25th frame (1 fps).
  const auto cholec = write("tools.txt",
                            "Frame\tGrasper\tBipolar\tHook\n"
                            "0\t1\t0\t0\n25\t1\t0\t1\n50\t0\t1\t0\n75\t0\t0\t0\n");
  // Columns by name, in the order asked for; others left out.
  const auto t = data::read_tool_annotations(cholec, {"Hook", "Grasper"});
  EXPECT_EQ(t.frames, (std::vector<int64_t>{0, 25, 50, 75}));
  EXPECT_EQ(t.presence, (std::vector<float>{0, 1, 1, 1, 0, 0, 0, 0}));
  ASSERT_NE(t.at(25), nullptr);
  EXPECT_EQ(t.at(25)[0], 1);
  EXPECT_EQ(t.at(24), nullptr);
  EXPECT_EQ(data::tools_of_frames(t, {50, 51, 0}), (std::vector<float>{0, 0, -1, -1, 0, 1}));
  // Written back one row per frame, unknown rows left out.
  const auto written = dir_ + "/written.txt";
  data::write_tool_annotations(written, {"Hook", "Grasper"}, {1, 0, -1, -1, 0, 1});
  const auto back = data::read_tool_annotations(written, {"Grasper", "Hook"});
  EXPECT_EQ(back.frames, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(back.presence, (std::vector<float>{0, 1, 1, 0}));

  const auto error = [&](const std::string& text, const std::vector<std::string>& tools) {
    const auto path = write("bad.txt", text);
    return test_util::error_message([&] { data::read_tool_annotations(path, tools); });
  };
  EXPECT_NE(error("Frame\tGrasper\n0\t1\n", {"Hook"})
                .find("bad.txt:1: no column \"Hook\" (data.tools); the file has Grasper"),
            std::string::npos);
  EXPECT_NE(error("Frame\tGrasper\n0\t2\n", {"Grasper"})
                .find("bad.txt:2: tool Grasper is \"2\"; expected 0 (absent) or 1 (present)"),
            std::string::npos);
  EXPECT_NE(error("Frame\tGrasper\n25\t1\n0\t1\n", {"Grasper"}).find("frames must increase"),
            std::string::npos);
  EXPECT_NE(error("Frame\tGrasper\n0\t1\t0\n", {"Grasper"})
                .find("bad.txt:2: 3 fields where the header has 2"),
            std::string::npos);
  EXPECT_NE(error("0\t1\n", {"Grasper"}).find("expected a header"), std::string::npos);
  EXPECT_NE(error("Frame\tGrasper\n", {"Grasper"}).find("no annotated frames"), std::string::npos);

  // In a data set: a folder of 5 frames at 1 fps with 25 fps annotations. Folder frame k shows
  // annotation frame 25 k: tools of frames 0-3 annotated, frame 4 (frame 100) not.
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg: the files alone were tested";
  std::string phases;
  for (int j = 0; j < 123; ++j) phases += "a\n";
  data::VideoEntry folder{"f", kMedia + "/frames", write("phases.txt", phases), "train", 1};
  folder.labels_fps = 25;
  folder.tools = cholec;
  data::DataOptions options;
  options.tools = {"Grasper", "Hook"};
  const data::VideoDataset set({folder}, classes_, options);
  EXPECT_TRUE(torch::equal(
      set.tools(0), torch::tensor({{1, 0}, {1, 1}, {0, 0}, {0, 0}, {-1, -1}}, torch::kFloat32)));
  const auto video = set.load(0);
  EXPECT_TRUE(torch::equal(video.tools, set.tools(0)));
  // Without data.tools nothing is read; with them every video needs its file.
  EXPECT_FALSE(data::VideoDataset({folder}, classes_, data::DataOptions{}).tools(0).defined());
  auto untooled = folder;
  untooled.tools.clear();
  EXPECT_NE(test_util::error_message([&] {
              data::VideoDataset({untooled}, classes_, options);
            }).find("video f has no tool annotation file"),
            std::string::npos);
  // A tool file counting frames past the phase annotation's is at another rate.
  auto late = folder;
  late.tools = write("late.txt", "Frame\tGrasper\tHook\n0\t1\t0\n500\t1\t1\n");
  EXPECT_NE(test_util::error_message([&] {
              data::VideoDataset({late}, classes_, options);
            }).find("annotates frame 500 but the phase annotation"),
            std::string::npos);
  // The manifest's tools column, resolved against its folder and written back.
  const auto manifest = write("m.csv", "video,labels,tools\nv.mp4,v.txt,v-tool.txt\n");
  const auto entries = data::read_manifest(manifest);
  EXPECT_EQ(entries[0].tools, dir_ + "/v-tool.txt");
  data::write_manifest(dir_ + "/m2.csv", entries);
  EXPECT_EQ(data::read_manifest(dir_ + "/m2.csv")[0].tools, dir_ + "/v-tool.txt");
}

TEST_F(DataTest, DemoWithToolsDrawsWhatItsToolFilesSay) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  data::DemoOptions options;
  options.train_videos = 2;
  options.val_videos = options.test_videos = 0;
  options.min_frames = options.max_frames = 300;
  options.frame_folders = false;
  options.tools = true;
  const auto summary = data::make_demo(dir_, options);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/frames"));  // no frame folders asked for
  const auto entries = data::read_manifest(summary.manifest);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[1].tools, dir_ + "/tools/video02-tool.txt");
  data::DataOptions read;
  read.tools = data::demo_tools();
  const data::VideoDataset set(entries, data::demo_classes(), read);
  int64_t shown[2] = {0, 0}, annotated = 0;
  for (int64_t v = 0; v < set.size(); ++v) {
    const auto tools = set.tools(v);
    const auto frames = set.load(v).frames.to(torch::kFloat32);
    for (int64_t t = 0; t < tools.size(0); ++t) {
      if (tools[t][0].item<float>() < 0) {
        EXPECT_NE(t % 25, 0) << t;  // every 25th frame is annotated, no other
        continue;
      }
      ++annotated;
      // Clip: a white square; Probe: a magenta bar (red and blue high, green low).
      const auto square = frames[t].slice(1, 8, 18).slice(2, 32, 42).mean().item<float>();
      const auto bar = frames[t].slice(1, 33, 56).slice(2, 48, 52).mean({1, 2});
      const bool clip = tools[t][0].item<float>() > 0, probe = tools[t][1].item<float>() > 0;
      EXPECT_EQ(square > 200, clip) << "video " << v << " frame " << t << ": " << square;
      EXPECT_EQ(bar[1].item<float>() < 60 && bar[0].item<float>() > 200, probe)
          << "video " << v << " frame " << t;
      shown[0] += clip;
      shown[1] += probe;
    }
  }
  EXPECT_EQ(annotated, 24);
  EXPECT_GT(shown[0], 0);
  EXPECT_GT(shown[1], 0);
  // The phases are those of the demo without tools.
  options.tools = false;
  const auto plain = data::make_demo(dir_ + "/plain", options);
  const auto plain_entries = data::read_manifest(plain.manifest);
  EXPECT_TRUE(plain_entries[0].tools.empty());
  EXPECT_EQ(data::read_phase_annotations(plain_entries[1].labels, data::demo_classes()),
            data::read_phase_annotations(entries[1].labels, data::demo_classes()));
}

TEST_F(DataTest, BadVideosAreNamedOrSkipped) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  const auto l50 = labels("l50.txt", 50);
  const auto l49 = labels("l49.txt", 49);
  const auto unknown = labels("unknown.txt", 50, "a", "zebra");
  data::DataOptions options;

  auto construct_error = [&](const data::VideoEntry& e) {
    return test_util::error_message([&] { data::VideoDataset({e}, classes_, options); });
  };
  // Annotation count differs from the video's frames.
  const auto count = construct_error({"v", kMedia + "/clip_25fps.mp4", l49, "train", 0});
  EXPECT_NE(count.find("l49.txt has 49 frames but"), std::string::npos) << count;
  EXPECT_NE(count.find("clip_25fps.mp4 has 50"), std::string::npos) << count;
  // Unknown phase name: file and line.
  EXPECT_NE(construct_error({"v", kMedia + "/clip_25fps.mp4", unknown, "train", 0})
                .find("unknown.txt:27"),
            std::string::npos);
  // Missing video.
  EXPECT_NE(construct_error({"v", dir_ + "/missing.mp4", l50, "train", 0}).find("missing.mp4"),
            std::string::npos);

  // Truncated video: the container promises 50 frames, decoding finds fewer.
  data::VideoDataset truncated({{"t", kMedia + "/truncated.mp4", l50, "train", 0}}, classes_,
                               options);
  const auto message = test_util::error_message([&] { truncated.load(0); });
  EXPECT_NE(message.find("truncated.mp4"), std::string::npos) << message;

  // A corrupt frame in a folder: found when decoding, named.
  const auto folder = dir_ + "/frames";
  ::mkdir(folder.c_str(), 0755);
  for (const char* name : {"000001.jpg", "000002.jpg"}) {
    std::ifstream in(kMedia + "/frames/" + name, std::ios::binary);
    std::ofstream(folder + "/" + name, std::ios::binary) << in.rdbuf();
  }
  {
    std::ifstream in(kMedia + "/corrupt.jpg", std::ios::binary);
    std::ofstream(folder + "/000003.jpg", std::ios::binary) << in.rdbuf();
  }
  const auto l3 = labels("l3.txt", 3);
  data::VideoDataset corrupt({{"c", folder, l3, "train", 0}}, classes_, options);
  EXPECT_NE(test_util::error_message([&] { corrupt.load(0); }).find("000003.jpg"),
            std::string::npos);

  // A missing frame: a gap in the numbering is named (it would shift every later label).
  std::rename((folder + "/000002.jpg").c_str(), (folder + "/000004.jpg").c_str());
  const auto gap = construct_error({"c", folder, l3, "train", 0});
  EXPECT_NE(gap.find("frame 2 is missing (000001.jpg is followed by 000003.jpg)"),
            std::string::npos)
      << gap;
  // One number twice, spelled two ways.
  std::rename((folder + "/000004.jpg").c_str(), (folder + "/000002.jpg").c_str());
  {
    std::ifstream in(folder + "/000002.jpg", std::ios::binary);
    std::ofstream(folder + "/2.jpg", std::ios::binary) << in.rdbuf();
  }
  const auto twice = construct_error({"c", folder, l3, "train", 0});
  EXPECT_NE(twice.find("000002.jpg and 2.jpg are both frame 2"), std::string::npos) << twice;

  // on_error: skip drops the videos that fail probing, with a warning each.
  options.skip_bad = true;
  std::vector<std::string> warnings;
  data::VideoDataset skipping({{"bad", kMedia + "/clip_25fps.mp4", l49, "train", 0},
                               {"good", kMedia + "/clip_25fps.mp4", l50, "train", 0}},
                              classes_, options,
                              [&](const std::string& w) { warnings.push_back(w); });
  EXPECT_EQ(skipping.size(), 1);
  EXPECT_EQ(skipping.skipped(), 1);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("bad"), std::string::npos);
}

TEST(Sampling, EpochOrdersAndAugmentationAreReproducible) {
  const auto a = data::epoch_order(20, 7, 0, true);
  EXPECT_EQ(a, data::epoch_order(20, 7, 0, true));
  EXPECT_NE(a, data::epoch_order(20, 7, 1, true));
  EXPECT_NE(a, data::epoch_order(20, 8, 0, true));
  EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()).size(), 20u);
  EXPECT_EQ(data::epoch_order(3, 7, 0, false), (std::vector<int64_t>{0, 1, 2}));

  data::TransformOptions t;
  t.crop = 20;
  t.random_crop = true;
  t.flip = true;
  const auto x = data::draw_augmentation(t, 24, 32, 1, 2, 3);
  const auto y = data::draw_augmentation(t, 24, 32, 1, 2, 3);
  EXPECT_EQ(x.top, y.top);
  EXPECT_EQ(x.left, y.left);
  EXPECT_EQ(x.flip, y.flip);
  std::set<int64_t> tops;
  int flips = 0;
  for (int64_t v = 0; v < 200; ++v) {
    const auto d = data::draw_augmentation(t, 24, 32, 1, 2, v);
    EXPECT_GE(d.top, 0);
    EXPECT_LE(d.top, 4);
    EXPECT_LE(d.left, 12);
    tops.insert(d.top);
    flips += d.flip;
  }
  EXPECT_EQ(tops.size(), 5u);
  EXPECT_GT(flips, 60);
  EXPECT_LT(flips, 140);
  EXPECT_FALSE(x.jitters());

  // Colour jitter: drawn after crop and flip (which stay as they were), within ColorJitter's
  // ranges, in every order, and nothing for a property left at 0.
  auto jittered = t;
  jittered.brightness = 0.2, jittered.saturation = 1.5, jittered.hue = 0.05;
  std::set<std::array<int, 4>> orders;
  double lowest = 2, highest = 0;
  for (int64_t v = 0; v < 200; ++v) {
    const auto plain = data::draw_augmentation(t, 24, 32, 1, 2, v);
    const auto d = data::draw_augmentation(jittered, 24, 32, 1, 2, v);
    EXPECT_TRUE(d.top == plain.top && d.left == plain.left && d.flip == plain.flip);
    EXPECT_TRUE(d.jitters());
    EXPECT_GE(d.brightness, 0.8);
    EXPECT_LE(d.brightness, 1.2);
    EXPECT_GE(d.saturation, 0.0);  // max(0, 1 - 1.5)
    EXPECT_LE(std::abs(d.hue), 0.05);
    EXPECT_EQ(d.contrast, 1.0);
    orders.insert(d.jitter_order);
    lowest = std::min(lowest, d.brightness), highest = std::max(highest, d.brightness);
  }
  EXPECT_EQ(orders.size(), 24u);
  EXPECT_LT(lowest, 0.82);
  EXPECT_GT(highest, 1.18);
  // Each frame's own contrast (its mean gray), and the frames a few at a time agree with all
  // at once.
  auto frames = (torch::rand({37, 3, 6, 5}) * 255).to(torch::kUInt8);
  data::Augmentation colors;
  colors.contrast = 0.5, colors.hue = 0.2, colors.jitter_order = {1, 3, 0, 2};
  const auto all = data::adjust_colors(frames, colors);
  EXPECT_TRUE(all.narrow(0, 20, 1).equal(data::adjust_colors(frames.narrow(0, 20, 1), colors)));
  EXPECT_FALSE(all.equal(frames));
  // Rotation: drawn within [-rotation, rotation]; 0 degrees is the frames, 90 a quarter turn
  // counterclockwise (torch's rot90 over H and W) on square frames.
  auto turning = t;
  turning.rotation = 10;
  double widest = 0;
  for (int64_t v = 0; v < 100; ++v) {
    const double degrees = data::draw_augmentation(turning, 24, 32, 1, 2, v).degrees;
    EXPECT_LE(std::abs(degrees), 10.0);
    widest = std::max(widest, std::abs(degrees));
  }
  EXPECT_GT(widest, 9.0);
  EXPECT_EQ(data::draw_augmentation(t, 24, 32, 1, 2, 0).degrees, 0.0);
  EXPECT_TRUE(data::rotate_frames(frames, 0).equal(frames));
  const auto square = (torch::rand({3, 3, 7, 7}) * 255).to(torch::kUInt8);
  EXPECT_TRUE(data::rotate_frames(square, 90).equal(square.rot90(1, {2, 3})));
  EXPECT_NE(test_util::error_message([&] {
              data::adjust_colors(frames.to(torch::kFloat), colors);
            }).find("uint8 RGB frames"),
            std::string::npos);
}

TEST(Prefetch, DeliversInOrderWithinTheMemoryBoundAndRethrows) {
  std::atomic<int64_t> held{0}, most{0};
  std::vector<data::Prefetcher::Job> jobs;
  for (int i = 0; i < 12; ++i) {
    jobs.push_back({[i, &held, &most] {
                      const int64_t now = held += 100;
                      int64_t seen = most;
                      while (now > seen && !most.compare_exchange_weak(seen, now)) {
                      }
                      if (i == 7)
                        throw c10::Error({__func__, __FILE__, __LINE__}, "video 7 is broken");
                      return framefit::Video{torch::full({1}, i), torch::zeros({1}, torch::kLong),
                                             std::to_string(i)};
                    },
                    100});
  }
  data::Prefetcher prefetcher(std::move(jobs), 3, 250);  // at most two 100-byte videos ahead
  for (int i = 0; i < 12; ++i) {
    if (i == 7) {
      EXPECT_NE(test_util::error_message([&] { prefetcher.next(); }).find("video 7 is broken"),
                std::string::npos);
    } else {
      const auto v = prefetcher.next();
      EXPECT_EQ(v.name, std::to_string(i));
    }
    held -= 100;
  }
  EXPECT_TRUE(prefetcher.done());
  EXPECT_LE(most.load(), 300) << "decoded ahead beyond the bound (+1 being consumed)";
}

TEST(Prefetch, VideoThatRanOutOfMemoryInAWorkerIsDecodedAgainNotCalledBad) {
  // A worker decoding beside the consumer's video can meet the budget where the consumer, having
  // let its video go, would not: the job runs again in next(). Out of memory there too is
  // rethrown as it is, for the caller to treat as memory, not as a damaged file.
  std::atomic<int> attempts{0};
  const auto out_of_memory = [] {
    throw memory::OutOfMemoryError(torch::kCPU, 100, 150, 120, "decode");
  };
  std::vector<data::Prefetcher::Job> jobs;
  jobs.push_back({[&] {
                    if (attempts++ == 0) out_of_memory();
                    return framefit::Video{torch::full({1}, 0), torch::zeros({1}, torch::kLong),
                                           "0"};
                  },
                  100});
  jobs.push_back({[&]() -> framefit::Video {
                    out_of_memory();
                    return {};
                  },
                  100});
  data::Prefetcher prefetcher(std::move(jobs), 1, 100);
  EXPECT_EQ(prefetcher.next().name, "0");
  EXPECT_EQ(attempts.load(), 2);
  try {
    prefetcher.next();
    ADD_FAILURE() << "the second job always runs out of memory";
  } catch (const memory::OutOfMemoryError& e) {
    EXPECT_EQ(e.phase(), "decode");
  }
}

TEST(Clips, StartsLabelsAndLayout) {
  data::ClipOptions options;
  options.length = 4;
  options.stride = 2;
  EXPECT_EQ(data::clip_starts(10, options), (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_TRUE(data::clip_starts(3, options).empty());  // shorter than one clip
  options.stride = 5;
  EXPECT_EQ(data::clip_starts(10, options), (std::vector<int64_t>{0, 5}));  // 5..8 fits, 10.. not
  const auto labels = torch::tensor({0, 1, 1, 2}, torch::kLong);
  EXPECT_EQ(data::clip_label(labels, data::ClipLabel::Majority), 1);
  EXPECT_EQ(data::clip_label(labels, data::ClipLabel::Center), 1);
  EXPECT_EQ(data::clip_label(labels, data::ClipLabel::Last), 2);
  EXPECT_EQ(data::clip_label(torch::tensor({2, 2, 0, 0}, torch::kLong), data::ClipLabel::Majority),
            0);  // ties: the smallest id
  EXPECT_EQ(data::parse_clip_label("last"), data::ClipLabel::Last);
  EXPECT_THROW(data::parse_clip_label("mode"), c10::Error);
  options.stride = 0;
  EXPECT_THROW(data::clip_starts(10, options), c10::Error);

  framefit::Video video{torch::randint(0, 256, {9, 3, 4, 5}, torch::kUInt8),
                        torch::tensor({0, 0, 0, 1, 1, 1, 1, 0, 0}, torch::kLong), "v"};
  options.length = 3;
  options.stride = 3;
  const auto clips = data::cut_clips(video, options);
  EXPECT_EQ(clips.clips.sizes(), (std::vector<int64_t>{3, 3, 3, 4, 5}));  // [K,3,L,H,W]
  EXPECT_TRUE(torch::equal(clips.labels, torch::tensor({0, 1, 0}, torch::kLong)));
  EXPECT_TRUE(torch::equal(clips.clips[1], video.frames.narrow(0, 3, 3).permute({1, 0, 2, 3})));
  video.labels = video.labels.narrow(0, 0, 8);
  EXPECT_THROW(data::cut_clips(video, options), c10::Error);
}

TEST_F(DataTest, ClipIndexFromTheVideoPipeline) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  const auto l = labels("clip.txt", 50);
  data::DataOptions options;
  options.fps = 5;  // 10 sampled frames: 0, 5, ..., 45; the first five are phase a
  std::vector<data::VideoEntry> entries = {{"clip", kMedia + "/clip_25fps.mp4", l, "train", 0}};
  data::VideoDataset set(entries, classes_, options);
  data::ClipOptions clip;
  clip.length = 4;
  clip.stride = 2;
  clip.label = data::ClipLabel::Last;
  const data::ClipIndex index(set, clip);
  ASSERT_EQ(index.size(), 4);       // starts 0, 2, 4, 6
  EXPECT_EQ(index.at(0).label, 0);  // frames 0..3
  EXPECT_EQ(index.at(1).label, 1);  // frames 2..5
  EXPECT_EQ(index.label_counts(2), (std::vector<int64_t>{1, 3}));
  // The index agrees with cutting the decoded video.
  const auto cut = data::cut_clips(set.load(0), clip);
  for (int64_t i = 0; i < index.size(); ++i) {
    EXPECT_EQ(cut.labels[i].item<int64_t>(), index.at(i).label);
    EXPECT_EQ(cut.starts[static_cast<size_t>(i)], index.at(i).start);
  }
}

TEST_F(DataTest, SegmentationImagesAndMasks) {
  if (skip_without_ffmpeg()) GTEST_SKIP() << "built without FFmpeg";
  const auto images = dir_ + "/images", masks = dir_ + "/masks";
  ::mkdir(images.c_str(), 0755);
  ::mkdir(masks.c_str(), 0755);
  std::vector<torch::Tensor> truth;
  for (int i = 0; i < 2; ++i) {
    const auto image = torch::randint(0, 256, {3, 16, 24}, torch::kUInt8);
    data::write_image(images + "/s" + std::to_string(i) + ".png", image);
    auto ids = torch::randint(0, 3, {16, 24}, torch::kUInt8);
    data::write_image(masks + "/s" + std::to_string(i) + ".png",
                      ids.unsqueeze(0).repeat({3, 1, 1}));
    truth.push_back(ids.to(torch::kLong));
  }
  data::SegmentationOptions options;
  options.classes = 3;
  data::SegmentationDataset set(images, masks, options);
  ASSERT_EQ(set.size(), 2);
  const auto [image, mask] = set.load(1);
  EXPECT_EQ(image.sizes(), (std::vector<int64_t>{3, 16, 24}));
  EXPECT_TRUE(torch::equal(mask, truth[1]));
  // Resized: masks by nearest neighbour, so ids stay ids.
  options.size = 8;
  data::SegmentationDataset small(images, masks, options);
  const auto [batch_images, batch_masks] = small.batch({0, 1});
  EXPECT_EQ(batch_images.sizes(), (std::vector<int64_t>{2, 3, 8, 8}));
  EXPECT_EQ(batch_masks.sizes(), (std::vector<int64_t>{2, 8, 8}));
  EXPECT_LE(batch_masks.max().item<int64_t>(), 2);

  // Too few classes for the ids in a mask, a mask without an image, sizes that differ.
  options.size = 0;
  options.classes = 2;
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, masks, options).load(0);
            }).find("has class id 2 but there are 2 classes"),
            std::string::npos);
  options.classes = 3;
  // 255 on a border: an error that names data.ignore_id, unless it is the ignore id.
  auto bordered = truth[0].clone();
  bordered[0].fill_(255);
  data::write_image(masks + "/s0.png", bordered.to(torch::kUInt8).unsqueeze(0).repeat({3, 1, 1}));
  EXPECT_NE(
      test_util::error_message([&] { data::SegmentationDataset(images, masks, options).load(0); })
          .find("has class id 255 but there are 3 classes (ids 0..2); if 255 marks pixels to "
                "leave out (object borders, unlabelled), set data.ignore_id: 255"),
      std::string::npos);
  options.ignore_id = 255;
  EXPECT_TRUE(data::SegmentationDataset(images, masks, options).mask(0).equal(bordered));
  options.ignore_id = 254;
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, masks, options).load(0);
            }).find("has class id 255 but there are 3 classes (ids 0..2) and ignore id 254"),
            std::string::npos);
  options.ignore_id = -1;

  // Binary masks stored as 0 and 255, and colour-coded masks: data.mask_values maps them.
  data::write_image(masks + "/s0.png",
                    (truth[0] * 127).to(torch::kUInt8).unsqueeze(0).repeat({3, 1, 1}));
  options.values = {{0}, {127}, {254}};
  EXPECT_TRUE(data::SegmentationDataset(images, masks, options).mask(0).equal(truth[0]));
  const auto colour_of =
      torch::tensor({0, 0, 0, 200, 0, 0, 0, 90, 255}, torch::kUInt8).view({3, 3});
  data::write_image(
      masks + "/s0.png",
      colour_of.index_select(0, truth[0].flatten()).t().reshape({3, 16, 24}).contiguous());
  options.values = {{0, 0, 0}, {200, 0, 0}, {0, 90, 255}};
  EXPECT_TRUE(data::SegmentationDataset(images, masks, options).mask(0).equal(truth[0]));
  options.values = {{0, 0, 0}, {200, 0, 0}, {0, 90, 254}};
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, masks, options).mask(0);
            }).find("has value RGB 0,90,255 at x="),
            std::string::npos);
  // Numbers, with an ignore value among them.
  auto with_border = truth[0].clone();
  with_border[0].fill_(9);
  data::write_image(masks + "/s0.png",
                    with_border.to(torch::kUInt8).unsqueeze(0).repeat({3, 1, 1}));
  options.values = {{0}, {1}, {2}};
  EXPECT_NE(
      test_util::error_message([&] { data::SegmentationDataset(images, masks, options).mask(0); })
          .find("has value 9 at x=0 y=0, which data.mask_values does not list (nor is it "
                "data.ignore_id)"),
      std::string::npos);
  options.ignore_id = 9;
  EXPECT_TRUE(data::SegmentationDataset(images, masks, options).mask(0).equal(with_border));
  options.ignore_id = -1;

  // JPEG masks (Kvasir-SEG ships them): refused as ids, mapped to the nearest listed value.
  // Blocks of 4 x 6 pixels (edges inside JPEG's 8 x 8 blocks), as 0 and 255, compressed.
  torch::manual_seed(5);
  const auto blocks = torch::randint(0, 2, {4, 4}, torch::kLong)
                          .repeat_interleave(4, 0)
                          .repeat_interleave(6, 1);  // 16 x 24
  data::write_image(masks + "/s0.jpg",
                    (blocks * 255).to(torch::kUInt8).unsqueeze(0).repeat({3, 1, 1}), 12);
  std::remove((masks + "/s0.png").c_str());
  options.values.clear();
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, masks, options).mask(0);
            }).find("or list the class values in data.mask_values"),
            std::string::npos);
  auto noisy = torch::empty({3, 16, 24}, torch::kUInt8);
  data::read_image(masks + "/s0.jpg", noisy);
  EXPECT_FALSE(
      ((noisy[0].to(torch::kLong) == 0) | (noisy[0].to(torch::kLong) == 255)).all().item<bool>())
      << "the test needs compression noise";
  options.values = {{0}, {255}};
  EXPECT_TRUE(data::SegmentationDataset(images, masks, options).mask(0).equal(blocks));
  std::remove((masks + "/s0.jpg").c_str());
  options.values.clear();
  // A damaged mask is called a mask, not an image (the size check read it as one).
  test_util::write_bytes(masks + "/s0.png", "");
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, masks, options);
            }).find("mask " + masks + "/s0.png: the file is empty"),
            std::string::npos);
  data::write_image(masks + "/s0.png", truth[0].to(torch::kUInt8).unsqueeze(0).repeat({3, 1, 1}));
  // Masks named as their image plus a suffix (ISIC: ISIC_0000000_segmentation.png).
  const auto suffixed = dir_ + "/suffixed";
  ::mkdir(suffixed.c_str(), 0755);
  for (int i = 0; i < 2; ++i) {
    data::write_label_image(suffixed + "/s" + std::to_string(i) + "_segmentation.png", truth[i]);
  }
  EXPECT_NE(test_util::error_message([&] { data::SegmentationDataset(images, suffixed, options); })
                .find("has no image named s0_segmentation in " + images +
                      " (masks named as their image plus a suffix such as _mask: set "
                      "data.mask_suffix)"),
            std::string::npos);
  options.mask_suffix = "_segmentation";
  EXPECT_TRUE(data::SegmentationDataset(images, suffixed, options).mask(1).equal(truth[1]));
  data::write_label_image(suffixed + "/s1_mask.png", truth[1]);
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, suffixed, options);
            }).find("s1_mask.png does not end in data.mask_suffix \"_segmentation\""),
            std::string::npos);
  options.mask_suffix.clear();
  data::write_image(masks + "/orphan.png", torch::zeros({3, 16, 24}, torch::kUInt8));
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, masks, options);
            }).find("orphan.png has no image"),
            std::string::npos);
  std::remove((masks + "/orphan.png").c_str());
  data::write_image(masks + "/s0.png", torch::zeros({3, 8, 8}, torch::kUInt8));
  EXPECT_NE(test_util::error_message([&] {
              data::SegmentationDataset(images, masks, options);
            }).find("s0.png is 8x8"),
            std::string::npos);
}

// The files tests/media/features/make_features.py wrote with NumPy, read back.
TEST(Features, NpyFilesReadAsNumPyWroteThem) {
  const std::string dir = kMedia + "/features/";
  const auto grid = torch::arange(12, torch::kFloat32).view({3, 4});  // [t][d] = 4 t + d
  const auto f4 = data::read_npy(dir + "f4_3x4.npy");
  EXPECT_EQ(f4.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(f4, grid));
  EXPECT_TRUE(torch::equal(data::read_npy(dir + "f4_version2_3x4.npy"), grid));
  const auto half = data::read_npy(dir + "f2_3x4.npy");
  EXPECT_EQ(half.scalar_type(), torch::kHalf);
  EXPECT_TRUE(torch::equal(half.to(torch::kFloat32), grid / 2));
  // Column-major storage, the same array: NumPy's a[i][j] = 3 i + j.
  const auto header = data::read_npy_header(dir + "f8_fortran_2x3.npy");
  EXPECT_TRUE(header.fortran_order);
  EXPECT_EQ(header.descr, "<f8");
  EXPECT_EQ(header.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(torch::equal(data::read_npy(dir + "f8_fortran_2x3.npy"),
                           torch::arange(6, torch::kFloat64).view({2, 3})));
  EXPECT_TRUE(torch::equal(data::read_npy(dir + "i8_4.npy"), torch::tensor({-2, -1, 0, 7})));

  const auto error = [](const std::string& path) {
    return test_util::error_message([&] { data::read_npy(path); });
  };
  auto e = error(dir + "f4_truncated_3x4.npy");
  EXPECT_NE(e.find("f4_truncated_3x4.npy: truncated: 40 bytes of data where its header's shape "
                   "[3, 4] of '<f4' needs 48"),
            std::string::npos)
      << e;
  e = error(dir + "f4_bigendian_3x4.npy");
  EXPECT_NE(e.find("big-endian data ('>f4')"), std::string::npos) << e;
  e = error(dir + "structured.npy");
  EXPECT_NE(e.find("a structured .npy type"), std::string::npos) << e;
  e = error(kMedia + "/frame.png");
  EXPECT_NE(e.find("frame.png: not a NumPy .npy file"), std::string::npos) << e;
  e = error(dir + "missing.npy");
  EXPECT_NE(e.find("missing.npy: cannot open"), std::string::npos) << e;
}

TEST(Features, DamagedNpyHeadersAreNamedBeforeAnythingIsAllocated) {
  // From a byte-changing run over .npy headers: a damaged shape asked for 37 GiB (or overflowed,
  // or ended in a bare `stoll`) before the data's size was compared with the file's.
  const std::string dir = "/tmp/framefit_npy_headers/";
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text, size_t data_bytes,
                         uint32_t said_length = 0) {
    std::string header = text + std::string(63 - (10 + text.size()) % 64, ' ') + "\n";
    const uint32_t length = said_length > 0 ? said_length : static_cast<uint32_t>(header.size());
    std::string bytes = "\x93NUMPY";
    bytes += '\x01';
    bytes += '\x00';
    bytes += static_cast<char>(length & 0xff);
    bytes += static_cast<char>(length >> 8 & 0xff);
    test_util::write_bytes(dir + name, bytes + header + std::string(data_bytes, '\0'));
    return test_util::error_message([&] { data::read_npy(dir + name); });
  };
  const auto with_shape = [](const std::string& shape) {
    return "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  };
  EXPECT_EQ(write("fine.npy", with_shape("(3, 4)"), 48), "");
  auto e = write("big.npy", with_shape("(100000000, 100)"), 48);
  EXPECT_NE(e.find("big.npy: truncated: 48 bytes of data where its header's shape [100000000, "
                   "100] of '<f4' needs 40000000000"),
            std::string::npos)
      << e;
  e = write("overflow.npy", with_shape("(4294967296, 4294967296)"), 48);
  EXPECT_NE(e.find("needs more than 2^64"), std::string::npos) << e;
  e = write("long.npy", with_shape("(99999999999999999999, 4)"), 48);
  EXPECT_NE(e.find("long.npy: a dimension out of range in its .npy header: {'descr'"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("   "), std::string::npos) << "the header's padding is shown: " << e;
  e = write("extra.npy", with_shape("(3, 4)"), 100);
  EXPECT_NE(e.find("extra.npy: damaged: 100 bytes of data where its header's shape [3, 4] of "
                   "'<f4' needs 48 (the file is longer than its header says)"),
            std::string::npos)
      << e;
  e = write("length.npy", with_shape("(3, 4)"), 48, 0xffff);
  EXPECT_NE(e.find("length.npy: truncated .npy header (65535 bytes said, 166 in the file)"),
            std::string::npos)
      << e;
  e = write("type.npy", "{'descr': '<f4x', 'fortran_order': False, 'shape': (3, 4), }", 48);
  EXPECT_NE(e.find("type.npy: unknown .npy type '<f4x'"), std::string::npos) << e;
  // The shape alone (as training plans) checks the size too.
  e = test_util::error_message([&] { data::feature_file_shape(dir + "big.npy"); });
  EXPECT_NE(e.find("big.npy: truncated"), std::string::npos) << e;
  test_util::remove_tree(dir);
}

TEST(Features, LayoutSaysWhichAxisIsTime) {
  using data::FeatureLayout;
  const auto first = [](std::vector<int64_t> shape, FeatureLayout layout, int64_t frames,
                        int64_t dim) { return data::time_first(shape, layout, frames, dim, "f"); };
  EXPECT_TRUE(first({100, 512}, FeatureLayout::Auto, 100, 0));   // by the label count
  EXPECT_FALSE(first({512, 100}, FeatureLayout::Auto, 100, 0));  // MS-TCN's [D,T]
  EXPECT_TRUE(first({100, 512}, FeatureLayout::Auto, 0, 512));   // by the model's size
  EXPECT_FALSE(first({512, 100}, FeatureLayout::Auto, 0, 512));
  EXPECT_FALSE(first({64, 64}, FeatureLayout::FeaturesFirst, 64, 0));
  EXPECT_TRUE(first({64, 64}, FeatureLayout::TimeFirst, 64, 0));
  const auto error = [&](std::vector<int64_t> shape, int64_t frames, int64_t dim) {
    return test_util::error_message([&] { first(shape, FeatureLayout::Auto, frames, dim); });
  };
  EXPECT_NE(error({64, 64}, 64, 0).find("set data.features_layout to T,D or D,T"),
            std::string::npos);
  EXPECT_NE(error({99, 512}, 100, 0).find("neither axis of its shape [99, 512] is 100 long"),
            std::string::npos);
  EXPECT_NE(error({99, 500}, 0, 512).find("the model's feature size"), std::string::npos);
  EXPECT_NE(error({2, 3, 4}, 2, 0).find("features are 2-D"), std::string::npos);
  EXPECT_EQ(data::parse_feature_layout("D,T"), FeatureLayout::FeaturesFirst);
  EXPECT_NE(test_util::error_message([] { data::parse_feature_layout("TD"); }).find("T,D"),
            std::string::npos);
}

TEST_F(DataTest, FeaturesFilesAreReadAsFloatTimeByFeature) {
  const auto stored = torch::randn({5, 9}, torch::kFloat64);  // [D,T]
  models::write_tensor(stored, dir_ + "/d_by_t.pt");
  EXPECT_EQ(data::feature_file_shape(dir_ + "/d_by_t.pt"), (std::vector<int64_t>{5, 9}));
  EXPECT_EQ(data::feature_file_shape(kMedia + "/features/f4_3x4.npy"),
            (std::vector<int64_t>{3, 4}));
  const auto features = data::read_features(dir_ + "/d_by_t.pt", false);
  EXPECT_EQ(features.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(features, stored.t().to(torch::kFloat32)));
  EXPECT_TRUE(features.is_contiguous());
  auto bad = torch::zeros({6, 4});
  bad[3][1] = std::nan("");
  models::write_tensor(bad, dir_ + "/nan.pt");
  auto e = test_util::error_message([&] { data::read_features(dir_ + "/nan.pt", true); });
  EXPECT_NE(e.find("nan.pt: frame 3's features are not finite"), std::string::npos) << e;
  e = test_util::error_message([&] { data::read_features(write("f.txt", "1 2"), true); });
  EXPECT_NE(e.find("f.txt: unknown format '.txt'"), std::string::npos) << e;
  e = test_util::error_message([&] { data::read_features(write("f", "1 2"), true); });
  EXPECT_NE(e.find("f: no extension to tell its format by"), std::string::npos) << e;
  // No rows (or no features) is refused with the file's name, not later as "no frames".
  models::write_tensor(torch::zeros({0, 4}), dir_ + "/empty.pt");
  e = test_util::error_message([&] {
    data::time_first(data::feature_file_shape(dir_ + "/empty.pt"), data::FeatureLayout::Auto, 0, 4,
                     dir_ + "/empty.pt");
  });
  EXPECT_NE(e.find("empty.pt: an empty array (shape [0, 4])"), std::string::npos) << e;
  e = test_util::error_message([&] { data::read_features(dir_ + "/empty.pt", true); });
  EXPECT_NE(e.find("empty.pt: an empty array (shape [0, 4])"), std::string::npos) << e;
}

TEST_F(DataTest, FeaturesDataSetPairsEachVideosFeaturesWithItsLabels) {
  const auto a = torch::randn({6, 3});                   // [T,D]
  const auto b = torch::randn({3, 8}, torch::kFloat64);  // [D,T]
  models::write_tensor(a, dir_ + "/a.pt");
  models::write_tensor(b, dir_ + "/b.pt");
  labels("a.txt", 6);
  labels("b.txt", 8);
  const auto manifest =
      write("m.csv", "name,labels,split,features\n,a.txt,train,a.pt\nb,b.txt,train,b.pt\n");
  const auto entries = data::read_manifest(manifest);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].name, "a");  // from the features file
  EXPECT_EQ(entries[0].features, dir_ + "/a.pt");
  EXPECT_TRUE(entries[0].video.empty());
  data::DataOptions options;
  options.features = true;
  data::VideoDataset set(entries, classes_, options);
  EXPECT_EQ(set.size(), 2);
  EXPECT_EQ(set.feature_dim(), 3);
  EXPECT_EQ(set.frames(1), 8);
  EXPECT_EQ(set.frame_bytes(1), 8 * 3 * 4);
  const auto video = set.load(1);
  EXPECT_FALSE(video.frames.defined());
  EXPECT_TRUE(torch::equal(video.features, b.t().to(torch::kFloat32)));
  EXPECT_TRUE(torch::equal(video.labels, set.labels(1)));
  EXPECT_EQ(video.labels[0].item<int64_t>(), 0);
  EXPECT_EQ(video.labels[7].item<int64_t>(), 1);

  // Each bad video named, or skipped.
  models::write_tensor(torch::randn({6, 5}), dir_ + "/wide.pt");
  labels("seven.txt", 7);
  const auto error = [&](const std::string& rows, bool skip = false) {
    auto options_here = options;
    options_here.skip_bad = skip;
    return test_util::error_message([&] {
      data::VideoDataset(data::read_manifest(write("bad.csv", "name,labels,features\n" + rows)),
                         classes_, options_here);
    });
  };
  auto e = error("a,seven.txt,a.pt\n");
  EXPECT_NE(e.find("seven.txt has 7 labels but features file " + dir_ +
                   "/a.pt has shape [6, 3]: neither axis is 7 long"),
            std::string::npos)
      << e;
  options.features_layout = data::FeatureLayout::TimeFirst;
  e = error("a,seven.txt,a.pt\n");
  EXPECT_NE(e.find("seven.txt has 7 labels but features file " + dir_ +
                   "/a.pt has 6 frames (shape [6, 3] read as [T,D])"),
            std::string::npos)
      << e;
  options.features_layout = data::FeatureLayout::Auto;
  e = error("a,a.txt,a.pt\nw,a.txt,wide.pt\n");
  EXPECT_NE(e.find("wide.pt has 5 features per frame where " + dir_ + "/a.pt has 3"),
            std::string::npos)
      << e;
  e = test_util::error_message([&] {
    data::VideoDataset(
        data::read_manifest(write("video.csv", "name,video,labels,features\na,a.mp4,a.txt,\n")),
        classes_, options);
  });
  EXPECT_NE(e.find("video a has no features file"), std::string::npos) << e;
  std::vector<std::string> warnings;
  auto skipping = options;
  skipping.skip_bad = true;
  data::VideoDataset skipped(
      data::read_manifest(
          write("skip.csv", "name,labels,features\na,a.txt,a.pt\nw,a.txt,wide.pt\n")),
      classes_, skipping, [&](const std::string& w) { warnings.push_back(w); });
  EXPECT_EQ(skipped.size(), 1);
  EXPECT_EQ(skipped.skipped(), 1);
  ASSERT_EQ(warnings.size(), 1u);
  // Rows and labels at their own rates: features at 2 rows per second (manifest fps), labels at
  // 10 per second; row k (k / 2 s) takes label 5k. Both 5 s long.
  models::write_tensor(torch::randn({3, 10}), dir_ + "/slow.pt");  // [D,T]
  models::write_tensor(torch::randn({14, 3}), dir_ + "/long.pt");
  labels("fast.txt", 50);
  auto timed = options;
  timed.labels_fps = 10;
  data::VideoDataset slow(
      data::read_manifest(write("timed.csv", "name,labels,features,fps\ns,fast.txt,slow.pt,2\n")),
      classes_, timed);
  EXPECT_EQ(slow.frames(0), 10);
  EXPECT_TRUE(torch::equal(slow.labels(0), torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, 1})));
  EXPECT_DOUBLE_EQ(slow.source_seconds(0)[3], 1.5);
  EXPECT_EQ(slow.load(0).features.sizes(), (std::vector<int64_t>{10, 3}));
  e = test_util::error_message([&] {
    data::VideoDataset(
        data::read_manifest(write("long.csv", "name,labels,features,fps\nl,fast.txt,long.pt,2\n")),
        classes_, timed);
  });
  EXPECT_NE(e.find("has 50 labels at labels_fps 10 (5 s) but features file " + dir_ +
                   "/long.pt has 14 rows at 2 per second (7 s"),
            std::string::npos)
      << e;
  e = test_util::error_message([&] { data::VideoDataset(entries, classes_, timed); });
  EXPECT_NE(e.find("which needs the rows' rate: give it in the manifest's fps column"),
            std::string::npos)
      << e;
  e = test_util::error_message([&] { data::read_manifest(write("none.csv", "name,labels\n")); });
  EXPECT_NE(e.find("`video` (or `features`) and `labels`"), std::string::npos) << e;

  // A stride (MS-TCN's sample_rate): rows 0, k, 2k, ... with their own labels and times.
  auto strided = options;
  strided.features_stride = 3;
  data::VideoDataset every_third(entries, classes_, strided);
  EXPECT_EQ(every_third.frames(1), 3);  // rows 0, 3, 6 of 8
  EXPECT_EQ(every_third.frame_bytes(1), 3 * 3 * 4);
  const auto third = every_third.load(1);
  EXPECT_TRUE(torch::equal(third.features,
                           b.t().to(torch::kFloat32).index({torch::indexing::Slice(0, 8, 3)})));
  EXPECT_TRUE(torch::equal(third.labels, torch::tensor({0, 0, 1})));
  auto timed_strided = timed;
  timed_strided.features_stride = 2;  // rows 0, 2, ..., 8 at 0, 1, ..., 4 s: labels 0, 10, ..., 40
  data::VideoDataset slow_strided(
      data::read_manifest(write("timed.csv", "name,labels,features,fps\ns,fast.txt,slow.pt,2\n")),
      classes_, timed_strided);
  EXPECT_TRUE(torch::equal(slow_strided.labels(0), torch::tensor({0, 0, 0, 1, 1})));
  EXPECT_DOUBLE_EQ(slow_strided.source_seconds(0)[3], 3.0);
  EXPECT_EQ(slow_strided.load(0).features.sizes(), (std::vector<int64_t>{5, 3}));
  strided.features_stride = 0;
  e = test_util::error_message([&] { data::VideoDataset(entries, classes_, strided); });
  EXPECT_NE(e.find("data.features_stride must be >= 1"), std::string::npos) << e;
}

TEST(Sampling, SegmentationSamplesTurnImageAndMaskAlike) {
  // A mask whose ids are the image's red channel: after flip and rotation they still agree
  // pixel for pixel, and the corners the turn brings in are black in the image and ignore_id in
  // the mask.
  const auto ids = torch::randint(1, 200, {12, 16}, torch::kLong);
  auto image = torch::zeros({3, 12, 16}, torch::kUInt8);
  image[0].copy_(ids);
  data::Augmentation a;
  a.flip = true;
  a.degrees = 17;
  const auto [turned, mask] = data::augment_image(image, ids, a, 255);
  EXPECT_TRUE(turned.equal(data::rotate_frames(image.flip({2}).unsqueeze(0), 17)[0]));
  const auto outside = mask == 255;
  EXPECT_GT(outside.sum().item<int64_t>(), 0);
  EXPECT_TRUE(turned[0].masked_select(outside).eq(0).all().item<bool>());
  EXPECT_TRUE(
      turned[0].to(torch::kLong).masked_select(~outside).equal(mask.masked_select(~outside)));
  // Colour jitter changes the image only; turning without an ignore id is refused.
  data::Augmentation colors;
  colors.brightness = 0.5;
  const auto [darker, same] = data::augment_image(image, ids, colors, -1);
  EXPECT_TRUE(same.equal(ids));
  EXPECT_TRUE(darker.equal(data::adjust_colors(image.unsqueeze(0), colors)[0]));
  EXPECT_NE(test_util::error_message([&] {
              data::augment_image(image, ids, a, -1);
            }).find("set data.ignore_id"),
            std::string::npos);
}
