#pragma once
// Per-frame phase labels and the lists of videos to train on: Cholec80-style annotation files
// (`Frame<TAB>Phase` lines), a class list mapping phase names to ids, and a CSV manifest.
// Every error names the file and line.
#include <cstdint>
#include <string>
#include <vector>

namespace framefit::data {

class ClassList {
 public:
  ClassList() = default;
  explicit ClassList(std::vector<std::string> names);  // unique, non-empty names
  const std::vector<std::string>& names() const& { return names_; }
  // By value on a temporary, so `for (auto& n : demo_classes().names())` does not dangle.
  std::vector<std::string> names() && { return std::move(names_); }
  int64_t size() const { return static_cast<int64_t>(names_.size()); }
  // -1 when unknown.
  int64_t find(const std::string& name) const;

 private:
  std::vector<std::string> names_;
};

// One label per source frame, in frame order, in one of two layouts the first line decides:
// Cholec80's (a header `Frame<TAB>Phase`, then one line per frame numbered 0, 1, 2, ... without
// gaps; tabs or spaces separate the columns) or MS-TCN's ground truth (one label per line and
// nothing else, as for GTEA, 50Salads and Breakfast). Unknown phase names, gaps, repeats and
// malformed lines are errors naming the line.
std::vector<int64_t> read_phase_annotations(const std::string& path, const ClassList& classes);
void write_phase_annotations(const std::string& path, const std::vector<int64_t>& labels,
                             const ClassList& classes);

// The labels of frames shown at `seconds`, from an annotation of `labels_fps` frames per second:
// the annotation frame whose interval [i, i + 1) / labels_fps holds the time (the last one for
// times past its end). Frames extracted at 1 fps from a 25 fps video get lines 0, 25, 50, ...
std::vector<int64_t> labels_at_times(const std::vector<int64_t>& labels, double labels_fps,
                                     const std::vector<double>& seconds);

// Tool presence per annotated frame, as Cholec80's tool_annotations/videoNN-tool.txt holds it:
// a header `Frame<TAB>Grasper<TAB>Bipolar...`, then one line per annotated frame (every 25th
// source frame there: 1 fps) with 0 or 1 per tool. The file's frame numbers count frames of the
// phase annotation (same rate).
struct ToolAnnotations {
  std::vector<std::string> tools;  // the columns read, in the order asked for
  std::vector<int64_t> frames;     // annotated frames, increasing
  std::vector<float> presence;     // frames.size() x tools.size(), 0 or 1
  // The presence row of annotation frame `frame`; nullptr where that frame is not annotated.
  const float* at(int64_t frame) const;
};
// Reads the columns named `tools` (each must be in the header; other columns are left out).
// Missing columns, values other than 0 and 1, frames out of order and malformed lines are
// errors naming the file and line.
ToolAnnotations read_tool_annotations(const std::string& path,
                                      const std::vector<std::string>& tools);
// presence [T,K] (0 or 1; a negative row, unknown, is left out): rows written as frames 0..T-1.
void write_tool_annotations(const std::string& path, const std::vector<std::string>& tools,
                            const std::vector<float>& presence);
// Per frame, the tool presence of the annotation frame it shows (`annotation_frames`, as the
// phase labels map them), -1 for every tool where that frame is not annotated: frames x tools.
std::vector<float> tools_of_frames(const ToolAnnotations& annotations,
                                   const std::vector<int64_t>& annotation_frames);

// A video: a file (mp4, avi, mkv, ...) or a folder of frame images, with its annotation file.
struct VideoEntry {
  std::string name;
  std::string video;   // path, resolved against the manifest's folder when relative
  std::string labels;  // annotation file, same
  std::string split;   // train | val | test (any name)
  double fps = 0;      // source frame rate of a frame folder (video files know theirs); 0: unset
  // The annotation's own frame rate when it is not the video's (Cholec80's 25 fps phase files
  // for frames extracted at 1 fps); 0: one label per source frame (or DataOptions::labels_fps).
  double labels_fps = 0;
  // Precomputed per-frame features (data/features.h) for a model that reads features
  // (model.encoder: features); same resolution.
  std::string features;
  // Tool presence annotation (ToolAnnotations), for a run with data.tools; same resolution.
  std::string tools;
};

// CSV with a header naming the columns: `labels` and `video` or `features` (or both) are
// required; `name`, `split`, `fps`, `labels_fps` and `tools` are optional (name defaults to the
// video's file name, else the features file's, split to "train"). Quoted fields ("a, b") are
// supported. Errors name the file and line.
std::vector<VideoEntry> read_manifest(const std::string& path);
void write_manifest(const std::string& path, const std::vector<VideoEntry>& entries);

// The entries of one split.
std::vector<VideoEntry> select_split(const std::vector<VideoEntry>& entries,
                                     const std::string& split);

// A note on the entries whose split is none of `used` (a typo such as "trian" would otherwise
// drop a video without a word), naming each such split and its videos; empty when there are none.
std::string unused_splits(const std::vector<VideoEntry>& entries,
                          const std::vector<std::string>& used);

}  // namespace framefit::data
