#include "framefit/train/metrics.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

namespace framefit::train {

ConfusionMatrix::ConfusionMatrix(int64_t classes)
    : counts_(torch::zeros({classes, classes}, torch::kLong)) {
  TORCH_CHECK(classes > 0, "a confusion matrix needs at least one class");
}

void ConfusionMatrix::add(const torch::Tensor& predictions, const torch::Tensor& targets) {
  TORCH_CHECK(predictions.dim() == 1 && predictions.sizes() == targets.sizes(),
              "predictions and targets must be [T] of the same length, got ", predictions.sizes(),
              " and ", targets.sizes());
  const int64_t c = counts_.size(0);
  const auto p = predictions.to(torch::kCPU, torch::kLong);
  const auto t = targets.to(torch::kCPU, torch::kLong);
  if (p.numel() == 0) return;
  TORCH_CHECK(p.min().item<int64_t>() >= 0 && p.max().item<int64_t>() < c &&
                  t.min().item<int64_t>() >= 0 && t.max().item<int64_t>() < c,
              "class ids must lie in [0, ", c, ")");
  counts_ += torch::bincount(t * c + p, {}, c * c).view({c, c});
}

PhaseMetrics ConfusionMatrix::metrics() const {
  const int64_t c = counts_.size(0);
  const auto m = counts_.to(torch::kDouble);
  const auto* a = m.data_ptr<double>();
  PhaseMetrics out;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  double correct = 0, total = 0;
  double sums[4] = {0, 0, 0, 0};
  int64_t present = 0;
  for (int64_t k = 0; k < c; ++k) {
    double truth = 0, predicted = 0;
    for (int64_t j = 0; j < c; ++j) {
      truth += a[k * c + j];
      predicted += a[j * c + k];
    }
    const double tp = a[k * c + k];
    correct += tp;
    total += truth;
    if (truth == 0 && predicted == 0) {  // the phase never occurs: left out of the averages
      for (auto* v : {&out.precision, &out.recall, &out.f1, &out.jaccard}) v->push_back(nan);
      continue;
    }
    const double precision = predicted > 0 ? tp / predicted : 0;
    const double recall = truth > 0 ? tp / truth : 0;
    const double f1 = precision + recall > 0 ? 2 * precision * recall / (precision + recall) : 0;
    const double jaccard = tp / (truth + predicted - tp);
    out.precision.push_back(precision);
    out.recall.push_back(recall);
    out.f1.push_back(f1);
    out.jaccard.push_back(jaccard);
    sums[0] += precision;
    sums[1] += recall;
    sums[2] += f1;
    sums[3] += jaccard;
    ++present;
  }
  out.frames = static_cast<int64_t>(total);
  out.accuracy = total > 0 ? correct / total : 0;
  if (present > 0) {
    out.macro_precision = sums[0] / present;
    out.macro_recall = sums[1] / present;
    out.macro_f1 = sums[2] / present;
    out.macro_jaccard = sums[3] / present;
  }
  return out;
}

VideoAverages average_over_videos(const std::vector<VideoMetrics>& videos) {
  VideoAverages out;
  out.videos = static_cast<int64_t>(videos.size());
  if (videos.empty()) return out;
  const auto mean_std = [&](auto field, double& mean, double& std_dev) {
    double sum = 0;
    for (const auto& v : videos) sum += field(v.metrics);
    mean = sum / static_cast<double>(videos.size());
    double squares = 0;
    for (const auto& v : videos) squares += (field(v.metrics) - mean) * (field(v.metrics) - mean);
    std_dev = videos.size() > 1 ? std::sqrt(squares / static_cast<double>(videos.size() - 1)) : 0;
  };
  mean_std([](const PhaseMetrics& m) { return m.accuracy; }, out.accuracy_mean, out.accuracy_std);
  mean_std([](const PhaseMetrics& m) { return m.macro_f1; }, out.macro_f1_mean, out.macro_f1_std);
  mean_std([](const PhaseMetrics& m) { return m.macro_jaccard; }, out.macro_jaccard_mean,
           out.macro_jaccard_std);
  return out;
}

std::string to_json(const PhaseMetrics& m, const std::vector<std::string>& phase_names) {
  TORCH_CHECK(phase_names.size() == m.f1.size(), "to_json: ", phase_names.size(), " names for ",
              m.f1.size(), " phases");
  auto number = [](double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); };
  nlohmann::json phases = nlohmann::json::object();
  for (size_t k = 0; k < phase_names.size(); ++k) {
    phases[phase_names[k]] = {{"precision", number(m.precision[k])},
                              {"recall", number(m.recall[k])},
                              {"f1", number(m.f1[k])},
                              {"jaccard", number(m.jaccard[k])}};
  }
  return nlohmann::json{{"frames", m.frames},
                        {"accuracy", m.accuracy},
                        {"macro_precision", m.macro_precision},
                        {"macro_recall", m.macro_recall},
                        {"macro_f1", m.macro_f1},
                        {"macro_jaccard", m.macro_jaccard},
                        {"phases", phases}}
      .dump();
}

double learning_rate(const Schedule& s, int64_t step, int64_t total) {
  if (s.warmup > 0 && step < s.warmup) return s.lr * static_cast<double>(step + 1) / s.warmup;
  const int64_t after = step - s.warmup;
  const int64_t span = std::max<int64_t>(1, total - s.warmup);
  if (s.kind == "step") {
    return s.lr * std::pow(s.gamma, static_cast<double>(after / std::max<int64_t>(1, s.step_size)));
  }
  if (s.kind == "cosine") {
    const double progress = std::min(1.0, static_cast<double>(after) / span);
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1 + std::cos(M_PI * progress));
  }
  TORCH_CHECK(s.kind == "constant", "unknown learning-rate schedule \"", s.kind,
              "\" (constant | step | cosine)");
  return s.lr;
}

}  // namespace framefit::train
