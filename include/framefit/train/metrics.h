#pragma once
// Phase-recognition metrics from a confusion matrix: frame accuracy, per-phase precision, recall,
// F1 and Jaccard, and their macro averages over the phases that occur (in the ground truth or
// the predictions), as in the Cholec80 evaluations.
#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

namespace framefit::train {

// Segmental scores of temporal action segmentation (MS-TCN, Farha and Gall 2019), which frame
// scores do not see: a segment is a run of frames with one label, so a prediction that flickers
// between phases can have a high frame accuracy and a poor edit score.
struct SegmentMetrics {
  int64_t videos = 0;
  // Mean over videos of 1 - Levenshtein(predicted, true segment labels) / the longer of the two
  // sequences: 1 when the phases come in the true order with no extra or missing segment.
  double edit = 0;
  std::vector<double> thresholds;  // IoU thresholds of f1
  // F1@threshold: a predicted segment is a true positive when its best-overlapping true segment
  // of its label has IoU >= threshold and was not matched before; TP, FP and FN are summed over
  // the videos, then F1 = 2 TP / (2 TP + FP + FN).
  std::vector<double> f1;
  int64_t true_segments = 0, predicted_segments = 0;
};

// A run of frames [start, end) with one label.
struct Segment {
  int64_t label = 0, start = 0, end = 0;
};
// The runs of `labels` ([T] class ids), in order, without those of `background` classes.
std::vector<Segment> segments_of(const torch::Tensor& labels,
                                 const std::vector<int64_t>& background = {});

// Accumulates SegmentMetrics video by video. Segments of `background` classes are left out of
// both sequences (as MS-TCN's evaluation leaves out "background"); same-label frames on either
// side of one are two segments.
class SegmentScorer {
 public:
  explicit SegmentScorer(std::vector<int64_t> background = {},
                         std::vector<double> thresholds = {0.1, 0.25, 0.5});
  // One video: [T] integer class ids.
  void add(const torch::Tensor& predictions, const torch::Tensor& targets);
  SegmentMetrics metrics() const;

 private:
  std::vector<int64_t> background_;
  std::vector<double> thresholds_;
  std::vector<int64_t> true_positives_, false_positives_, false_negatives_;
  double edit_sum_ = 0;
  int64_t videos_ = 0, true_segments_ = 0, predicted_segments_ = 0;
};

// Tool presence detection (multi-label), as EndoNet and later Cholec80 work report it: per
// tool, the average precision of the frames' presence probabilities over the annotated frames,
// and their mean (mAP) over the tools present in at least one of them.
struct ToolMetrics {
  int64_t frames = 0;                     // annotated frames scored
  std::vector<double> average_precision;  // per tool; NaN for a tool never present
  std::vector<int64_t> present;           // per tool: annotated frames showing it
  double mean_average_precision = 0;
  // Per tool, predicting present where the probability is at least 0.5: precision (NaN when
  // never predicted), recall (NaN when never present) and F1 = 2 TP / (2 TP + FP + FN) (NaN
  // when neither present nor predicted).
  std::vector<double> precision, recall, f1;
};
// scores [N] (higher: more likely present), targets [N] of 0 and 1: the sum over thresholds of
// precision times the recall gained (equal scores are one threshold), as scikit-learn's
// average_precision_score; NaN when no target is 1.
double average_precision(const torch::Tensor& scores, const torch::Tensor& targets);
// Accumulates ToolMetrics video by video.
class ToolScorer {
 public:
  explicit ToolScorer(int64_t tools) : scores_(tools), targets_(tools) {}
  // probabilities [T,K]; targets [T,K] of 1, 0 or -1 (not annotated: left out).
  void add(const torch::Tensor& probabilities, const torch::Tensor& targets);
  ToolMetrics metrics() const;

 private:
  std::vector<std::vector<float>> scores_, targets_;  // per tool, annotated frames
  int64_t frames_ = 0;
};

struct PhaseMetrics {
  int64_t frames = 0;
  double accuracy = 0;
  std::vector<double> precision, recall, f1, jaccard;  // per phase; NaN where it never occurs
  double macro_precision = 0, macro_recall = 0, macro_f1 = 0, macro_jaccard = 0;
  // confusion[truth][prediction]: frames (clips, pixels) of each true class by predicted class.
  std::vector<std::vector<int64_t>> confusion;
  std::optional<SegmentMetrics> segments;  // phases: the videos' segmental scores
  std::optional<ToolMetrics> tools;        // phases with data.tools
};

// One video's metrics. Cholec80 papers report video-level figures: each video's accuracy (and
// macro scores) averaged over the videos, with the standard deviation across them.
struct VideoMetrics {
  std::string name;
  PhaseMetrics metrics;
};
struct VideoAverages {
  int64_t videos = 0;
  // Mean over videos and sample standard deviation (n - 1; 0 for one video). Macro scores of a
  // video average the phases that occur in it (in its labels or its predictions).
  double accuracy_mean = 0, accuracy_std = 0;
  double macro_f1_mean = 0, macro_f1_std = 0;
  double macro_jaccard_mean = 0, macro_jaccard_std = 0;
  double edit_mean = 0, edit_std = 0;  // over the videos with segmental scores
  // Tool presence: each video's mAP (over the tools it shows), averaged over the videos with
  // tool metrics that show any tool; tool_videos counts them.
  int64_t tool_videos = 0;
  double tool_map_mean = 0, tool_map_std = 0;
};
VideoAverages average_over_videos(const std::vector<VideoMetrics>& videos);

// Relaxed-boundary phase metrics as the evaluation script most Cholec80 papers report computes
// them (Evaluate.m and Main.m of the M2CAI 2016 workflow challenge, in its Cholec80 revision).
// Per video: within the first `boundary_frames` frames (10 s) of each true phase segment, a
// prediction of the phase before it (diff = predicted - true id = -1) counts as right (a late
// transition); for an early transition (+1 in the segment's last frames) the script's MATLAB
// indexing applies the same test's positions to the segment's first frames instead, and so does
// this code, so that its numbers are the script's. The data sets' own rules add: Cholec80
// (ids 3, 4: +2 early too; ids 5, 6: -2 late and +2 early too), M2CAI16 (the same for ids 4, 5
// and 6, 7); General: the ±1 rule alone. Per phase present in the truth: Jaccard = right frames
// (after relaxing) among those predicted or labelled the phase / their count, precision = the
// same right frames / frames predicted the phase, recall = / frames labelled it (so precision
// can exceed 1, which the summary clips, as the script does); accuracy = right frames / frames.
enum class RelaxedRules { General, Cholec80, M2cai16 };
RelaxedRules parse_relaxed_rules(const std::string& name);  // general | cholec80 | m2cai16
// An error unless the rules are for `classes` phases: 7 for Cholec80, 8 for M2CAI16, any for
// General. Checked again by relaxed_video_metrics; call it before scoring any video.
void check_relaxed_rules(RelaxedRules rules, int64_t classes);
struct RelaxedVideoMetrics {
  std::string name;
  double accuracy = 0;
  std::vector<double> precision, recall, jaccard;  // per phase; NaN where the truth lacks it
};
// predictions and targets: [T] class ids; `classes` must be 7 for Cholec80, 8 for M2CAI16.
RelaxedVideoMetrics relaxed_video_metrics(const torch::Tensor& predictions,
                                          const torch::Tensor& targets, int64_t classes,
                                          int64_t boundary_frames, RelaxedRules rules);
// The script's summary: accuracy's mean and sample standard deviation over the videos; per
// phase, the mean over the videos that have it of precision, recall and Jaccard (each clipped
// to 1), and the mean and sample standard deviation of those per-phase means over the phases
// (phases no video has left out).
struct RelaxedSummary {
  int64_t videos = 0;
  double accuracy_mean = 0, accuracy_std = 0;
  double precision_mean = 0, precision_std = 0, recall_mean = 0, recall_std = 0;
  double jaccard_mean = 0, jaccard_std = 0;
  std::vector<double> precision, recall, jaccard;  // per phase, over videos; NaN: in none
};
RelaxedSummary summarize_relaxed(const std::vector<RelaxedVideoMetrics>& videos);

// A metric by name: accuracy, macro_precision, macro_recall, macro_f1, macro_jaccard, edit or a
// segment_f1_name (the last two need segmental scores).
double metric_value(const PhaseMetrics& metrics, const std::string& name);

// "f1@10" for threshold 0.1: the name MS-TCN's tables give F1@{10,25,50}.
std::string segment_f1_name(double threshold);

// {"frames", "accuracy", "macro_precision", "macro_recall", "macro_f1", "macro_jaccard",
// "phases": {name: {"precision", "recall", "f1", "jaccard"}}, "confusion": [[count, ...], ...]
// (rows the true classes, columns the predicted ones, in phase order)} as JSON text, with
// "segments": {"edit", "f1@10", "f1@25", "f1@50", "videos", "true_segments",
// "predicted_segments"} when scored, and "tools": {"frames", "mean_average_precision",
// "average_precision": {tool: AP}, "present_frames": {tool: count}, "precision", "recall",
// "f1": {tool: value}} with tool metrics (named by `tool_names`); NaN becomes null.
std::string to_json(const PhaseMetrics& metrics, const std::vector<std::string>& phase_names,
                    const std::vector<std::string>& tool_names = {});
// The metrics to_json wrote (a log record's "val"), read back: what a resumed run reports as the
// best validation of the epochs before it. A name missing from the text is an error naming it.
PhaseMetrics metrics_from_json(const std::string& json, const std::vector<std::string>& phase_names,
                               const std::vector<std::string>& tool_names = {});

class ConfusionMatrix {
 public:
  explicit ConfusionMatrix(int64_t classes);
  // predictions and targets: [T] integer class ids.
  void add(const torch::Tensor& predictions, const torch::Tensor& targets);
  const torch::Tensor& counts() const { return counts_; }  // [truth, prediction], int64
  PhaseMetrics metrics() const;

 private:
  torch::Tensor counts_;
};

}  // namespace framefit::train
