#pragma once
// Phase-recognition metrics from a confusion matrix: frame accuracy, per-phase precision, recall,
// F1 and Jaccard, and their macro averages over the phases that occur (in the ground truth or
// the predictions), as in the Cholec80 evaluations.
#include <torch/types.h>

#include <string>
#include <vector>

namespace framefit::train {

struct PhaseMetrics {
  int64_t frames = 0;
  double accuracy = 0;
  std::vector<double> precision, recall, f1, jaccard;  // per phase; NaN where it never occurs
  double macro_precision = 0, macro_recall = 0, macro_f1 = 0, macro_jaccard = 0;
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
};
VideoAverages average_over_videos(const std::vector<VideoMetrics>& videos);

// {"frames", "accuracy", "macro_precision", "macro_recall", "macro_f1", "macro_jaccard",
// "phases": {name: {"precision", "recall", "f1", "jaccard"}}} as JSON text; NaN becomes null.
std::string to_json(const PhaseMetrics& metrics, const std::vector<std::string>& phase_names);

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

// Learning rate at optimizer step `step` (0-based) of `total`: linear warm-up from 0 over
// `warmup` steps, then constant, step decay (times gamma every step_size steps) or cosine
// decay to min_lr at `total`.
struct Schedule {
  std::string kind = "cosine";  // constant | step | cosine
  double lr = 1e-3;
  int64_t warmup = 0;
  int64_t step_size = 1;
  double gamma = 0.1;
  double min_lr = 0;
};
double learning_rate(const Schedule& schedule, int64_t step, int64_t total);

}  // namespace framefit::train
