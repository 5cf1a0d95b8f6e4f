#include "framefit/train/metrics.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

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
  const auto counts = counts_.contiguous();
  const auto* n = counts.data_ptr<int64_t>();
  for (int64_t k = 0; k < c; ++k) out.confusion.emplace_back(n + k * c, n + (k + 1) * c);
  out.accuracy = total > 0 ? correct / total : 0;
  if (present > 0) {
    out.macro_precision = sums[0] / present;
    out.macro_recall = sums[1] / present;
    out.macro_f1 = sums[2] / present;
    out.macro_jaccard = sums[3] / present;
  }
  return out;
}

std::vector<Segment> segments_of(const torch::Tensor& labels,
                                 const std::vector<int64_t>& background) {
  const auto l = labels.to(torch::kCPU, torch::kLong).contiguous();
  const auto* a = l.data_ptr<int64_t>();
  std::vector<Segment> out;
  const int64_t n = l.numel();
  for (int64_t start = 0; start < n;) {
    int64_t end = start + 1;
    while (end < n && a[end] == a[start]) ++end;
    if (std::find(background.begin(), background.end(), a[start]) == background.end()) {
      out.push_back({a[start], start, end});
    }
    start = end;
  }
  return out;
}

namespace {

// Levenshtein distance between the two segments' label sequences.
int64_t edit_distance(const std::vector<Segment>& a, const std::vector<Segment>& b) {
  std::vector<int64_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = static_cast<int64_t>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    int64_t diagonal = row[0];
    row[0] = static_cast<int64_t>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      const int64_t above = row[j];
      row[j] = std::min(
          {above + 1, row[j - 1] + 1, diagonal + (a[i - 1].label == b[j - 1].label ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

SegmentScorer::SegmentScorer(std::vector<int64_t> background, std::vector<double> thresholds)
    : background_(std::move(background)),
      thresholds_(std::move(thresholds)),
      true_positives_(thresholds_.size()),
      false_positives_(thresholds_.size()),
      false_negatives_(thresholds_.size()) {
  for (double t : thresholds_) {
    TORCH_CHECK(t > 0 && t <= 1, "segment IoU thresholds lie in (0, 1], got ", t);
  }
}

void SegmentScorer::add(const torch::Tensor& predictions, const torch::Tensor& targets) {
  TORCH_CHECK(predictions.dim() == 1 && predictions.sizes() == targets.sizes(),
              "predictions and targets must be [T] of the same length, got ", predictions.sizes(),
              " and ", targets.sizes());
  const auto predicted = segments_of(predictions, background_);
  const auto truth = segments_of(targets, background_);
  const size_t longer = std::max(predicted.size(), truth.size());
  edit_sum_ += longer == 0 ? 1.0
                           : 1.0 - static_cast<double>(edit_distance(predicted, truth)) /
                                       static_cast<double>(longer);
  ++videos_;
  true_segments_ += static_cast<int64_t>(truth.size());
  predicted_segments_ += static_cast<int64_t>(predicted.size());
  // Each predicted segment's best-overlapping true segment of its label (truth.size(): none),
  // and that IoU; the thresholds differ only in which of these count.
  std::vector<size_t> best_index(predicted.size(), truth.size());
  std::vector<double> best_iou(predicted.size(), 0);
  for (size_t i = 0; i < predicted.size(); ++i) {
    const auto& p = predicted[i];
    for (size_t j = 0; j < truth.size(); ++j) {
      if (truth[j].label != p.label) continue;
      const int64_t overlap = std::min(p.end, truth[j].end) - std::max(p.start, truth[j].start);
      if (overlap <= 0) continue;
      const double iou =
          static_cast<double>(overlap) /
          static_cast<double>(std::max(p.end, truth[j].end) - std::min(p.start, truth[j].start));
      if (iou > best_iou[i]) {
        best_iou[i] = iou;
        best_index[i] = j;
      }
    }
  }
  for (size_t k = 0; k < thresholds_.size(); ++k) {
    std::vector<bool> matched(truth.size(), false);
    for (size_t i = 0; i < predicted.size(); ++i) {
      // The best match only: a second prediction of an already matched segment is a false
      // positive even when another true segment of its label overlaps it less.
      const size_t j = best_index[i];
      if (j < truth.size() && best_iou[i] >= thresholds_[k] && !matched[j]) {
        matched[j] = true;
        ++true_positives_[k];
      } else {
        ++false_positives_[k];
      }
    }
    false_negatives_[k] += std::count(matched.begin(), matched.end(), false);
  }
}

SegmentMetrics SegmentScorer::metrics() const {
  SegmentMetrics out;
  out.videos = videos_;
  out.edit = videos_ > 0 ? edit_sum_ / static_cast<double>(videos_) : 0;
  out.thresholds = thresholds_;
  for (size_t k = 0; k < thresholds_.size(); ++k) {
    const double tp = static_cast<double>(true_positives_[k]);
    const double errors = static_cast<double>(false_positives_[k] + false_negatives_[k]);
    out.f1.push_back(tp + errors > 0 ? 2 * tp / (2 * tp + errors) : 1.0);
  }
  out.true_segments = true_segments_;
  out.predicted_segments = predicted_segments_;
  return out;
}

namespace {

// Mean and sample standard deviation (n - 1; 0 for one value; NaN for none).
std::pair<double, double> mean_and_sample_std(const std::vector<double>& values) {
  if (values.empty()) {
    return {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::quiet_NaN()};
  }
  double sum = 0;
  for (const double x : values) sum += x;
  const double mean = sum / static_cast<double>(values.size());
  double squares = 0;
  for (const double x : values) squares += (x - mean) * (x - mean);
  const double std_dev =
      values.size() > 1 ? std::sqrt(squares / static_cast<double>(values.size() - 1)) : 0;
  return {mean, std_dev};
}

}  // namespace

VideoAverages average_over_videos(const std::vector<VideoMetrics>& videos) {
  VideoAverages out;
  out.videos = static_cast<int64_t>(videos.size());
  if (videos.empty()) return out;
  const auto mean_std = [&](auto field, double& mean, double& std_dev) {
    std::vector<double> values;
    for (const auto& v : videos) values.push_back(field(v.metrics));
    std::tie(mean, std_dev) = mean_and_sample_std(values);
  };
  mean_std([](const PhaseMetrics& m) { return m.accuracy; }, out.accuracy_mean, out.accuracy_std);
  mean_std([](const PhaseMetrics& m) { return m.macro_f1; }, out.macro_f1_mean, out.macro_f1_std);
  mean_std([](const PhaseMetrics& m) { return m.macro_jaccard; }, out.macro_jaccard_mean,
           out.macro_jaccard_std);
  const bool segmental = std::all_of(videos.begin(), videos.end(),
                                     [](const VideoMetrics& v) { return v.metrics.segments; });
  if (segmental) {
    mean_std([](const PhaseMetrics& m) { return m.segments->edit; }, out.edit_mean, out.edit_std);
  }
  std::vector<double> tool_maps;
  for (const auto& v : videos) {
    const auto& tools = v.metrics.tools;
    const bool shows_a_tool = tools && std::any_of(tools->present.begin(), tools->present.end(),
                                                   [](int64_t frames) { return frames > 0; });
    if (shows_a_tool) tool_maps.push_back(tools->mean_average_precision);
  }
  out.tool_videos = static_cast<int64_t>(tool_maps.size());
  if (!tool_maps.empty()) {
    std::tie(out.tool_map_mean, out.tool_map_std) = mean_and_sample_std(tool_maps);
  }
  return out;
}

RelaxedRules parse_relaxed_rules(const std::string& name) {
  if (name == "general") return RelaxedRules::General;
  if (name == "cholec80") return RelaxedRules::Cholec80;
  if (name == "m2cai16") return RelaxedRules::M2cai16;
  TORCH_CHECK(false, "unknown relaxed-boundary rules \"", name,
              "\": general (the +-1 rule for every phase), cholec80 or m2cai16");
}

void check_relaxed_rules(RelaxedRules rules, int64_t classes) {
  TORCH_CHECK(
      rules != RelaxedRules::Cholec80 || classes == 7,
      "the cholec80 relaxed rules are for Cholec80's 7 phases in its order (Preparation ... "
      "GallbladderRetraction), got ",
      classes, " classes: use the general rules");
  TORCH_CHECK(rules != RelaxedRules::M2cai16 || classes == 8,
              "the m2cai16 relaxed rules are for M2CAI16's 8 phases in its order, got ", classes,
              " classes: use the general rules");
}

RelaxedVideoMetrics relaxed_video_metrics(const torch::Tensor& predictions,
                                          const torch::Tensor& targets, int64_t classes,
                                          int64_t boundary_frames, RelaxedRules rules) {
  TORCH_CHECK(predictions.dim() == 1 && predictions.sizes() == targets.sizes(),
              "relaxed metrics need predictions and targets of one shape [T], got ",
              predictions.sizes(), " and ", targets.sizes());
  TORCH_CHECK(boundary_frames >= 0, "the relaxed boundary must be >= 0 frames, got ",
              boundary_frames);
  check_relaxed_rules(rules, classes);
  // The two pairs of phases whose neighbours the script also forgives two ids away.
  const int64_t pair_a = rules == RelaxedRules::Cholec80  ? 3
                         : rules == RelaxedRules::M2cai16 ? 4
                                                          : -1;
  const int64_t pair_b = rules == RelaxedRules::Cholec80  ? 5
                         : rules == RelaxedRules::M2cai16 ? 6
                                                          : -1;
  const auto pred = predictions.to(torch::kLong).contiguous();
  const auto truth = targets.to(torch::kLong).contiguous();
  const int64_t frames = truth.size(0);
  const auto* p = pred.data_ptr<int64_t>();
  const auto* g = truth.data_ptr<int64_t>();
  std::vector<int64_t> diff(static_cast<size_t>(frames));
  for (int64_t k = 0; k < frames; ++k) diff[k] = p[k] - g[k];
  for (const auto& segment : segments_of(truth)) {
    const int64_t phase = segment.label, length = segment.end - segment.start;
    const int64_t t = std::min(boundary_frames, length);
    const bool in_a = pair_a >= 0 && (phase == pair_a || phase == pair_a + 1);
    const bool in_b = pair_b >= 0 && (phase == pair_b || phase == pair_b + 1);
    const auto late = [&](int64_t d) { return d == -1 || (in_b && d == -2); };
    const auto early = [&](int64_t d) { return d == 1 || ((in_a || in_b) && d == 2); };
    int64_t* cur = diff.data() + segment.start;
    for (int64_t k = 0; k < t; ++k) {
      if (late(cur[k])) cur[k] = 0;
    }
    // Evaluate.m: curDiff(early(curDiff(end-t+1:end))) = 0, a logical index t long, which
    // MATLAB applies to the first t frames.
    std::vector<char> last_early(static_cast<size_t>(t));
    for (int64_t k = 0; k < t; ++k) last_early[k] = early(cur[length - t + k]);
    for (int64_t k = 0; k < t; ++k) {
      if (last_early[k]) cur[k] = 0;
    }
  }
  RelaxedVideoMetrics out;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  int64_t right = 0;
  for (int64_t k = 0; k < frames; ++k) right += diff[k] == 0;
  out.accuracy = frames > 0 ? static_cast<double>(right) / static_cast<double>(frames) : nan;
  for (int64_t phase = 0; phase < classes; ++phase) {
    int64_t in_union = 0, right_in_union = 0, predicted = 0, labelled = 0;
    for (int64_t k = 0; k < frames; ++k) {
      predicted += p[k] == phase;
      labelled += g[k] == phase;
      if (p[k] == phase || g[k] == phase) {
        ++in_union;
        right_in_union += diff[k] == 0;
      }
    }
    if (labelled == 0) {
      out.precision.push_back(nan), out.recall.push_back(nan), out.jaccard.push_back(nan);
      continue;
    }
    const auto tp = static_cast<double>(right_in_union);
    // No frame predicted the phase: 0/0 is NaN and x/0 infinite, as in MATLAB.
    out.precision.push_back(predicted > 0
                                ? tp / static_cast<double>(predicted)
                                : (tp > 0 ? std::numeric_limits<double>::infinity() : nan));
    out.recall.push_back(tp / static_cast<double>(labelled));
    out.jaccard.push_back(tp / static_cast<double>(in_union));
  }
  return out;
}

RelaxedSummary summarize_relaxed(const std::vector<RelaxedVideoMetrics>& videos) {
  RelaxedSummary out;
  out.videos = static_cast<int64_t>(videos.size());
  if (videos.empty()) return out;
  std::vector<double> accuracies;
  for (const auto& v : videos) accuracies.push_back(v.accuracy);
  std::tie(out.accuracy_mean, out.accuracy_std) = mean_and_sample_std(accuracies);
  const size_t classes = videos.front().jaccard.size();
  const auto per_phase = [&](auto field, std::vector<double>& means, double& mean,
                             double& std_dev) {
    for (size_t c = 0; c < classes; ++c) {
      std::vector<double> values;  // the videos that have the phase, clipped to 1 (Main.m)
      for (const auto& v : videos) {
        const double x = field(v).at(c);
        if (!std::isnan(x)) values.push_back(std::min(x, 1.0));
      }
      means.push_back(values.empty() ? std::numeric_limits<double>::quiet_NaN()
                                     : mean_and_sample_std(values).first);
    }
    std::vector<double> present;
    for (const double m : means) {
      if (!std::isnan(m)) present.push_back(m);
    }
    std::tie(mean, std_dev) = mean_and_sample_std(present);
  };
  per_phase([](const RelaxedVideoMetrics& v) -> const std::vector<double>& { return v.precision; },
            out.precision, out.precision_mean, out.precision_std);
  per_phase([](const RelaxedVideoMetrics& v) -> const std::vector<double>& { return v.recall; },
            out.recall, out.recall_mean, out.recall_std);
  per_phase([](const RelaxedVideoMetrics& v) -> const std::vector<double>& { return v.jaccard; },
            out.jaccard, out.jaccard_mean, out.jaccard_std);
  return out;
}

double metric_value(const PhaseMetrics& m, const std::string& name) {
  if (name == "accuracy") return m.accuracy;
  if (name == "macro_precision") return m.macro_precision;
  if (name == "macro_recall") return m.macro_recall;
  if (name == "macro_f1") return m.macro_f1;
  if (name == "macro_jaccard") return m.macro_jaccard;
  if (name == "tool_map" && m.tools) return m.tools->mean_average_precision;
  if (m.segments) {
    if (name == "edit") return m.segments->edit;
    for (size_t k = 0; k < m.segments->thresholds.size(); ++k) {
      if (name == segment_f1_name(m.segments->thresholds[k])) return m.segments->f1[k];
    }
  }
  TORCH_CHECK(
      false, "no metric \"", name, "\" in these metrics",
      m.segments ? "" : " (edit and f1@k score the segments of frame sequences: task phases)");
}

std::string segment_f1_name(double threshold) {
  return "f1@" + std::to_string(std::lround(100 * threshold));
}

std::string to_json(const PhaseMetrics& m, const std::vector<std::string>& phase_names,
                    const std::vector<std::string>& tool_names) {
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
  nlohmann::json out{{"frames", m.frames},
                     {"accuracy", m.accuracy},
                     {"macro_precision", m.macro_precision},
                     {"macro_recall", m.macro_recall},
                     {"macro_f1", m.macro_f1},
                     {"macro_jaccard", m.macro_jaccard},
                     {"phases", phases},
                     {"confusion", m.confusion}};
  if (m.segments) {
    const auto& s = *m.segments;
    nlohmann::json segments{{"videos", s.videos},
                            {"edit", s.edit},
                            {"true_segments", s.true_segments},
                            {"predicted_segments", s.predicted_segments}};
    for (size_t k = 0; k < s.thresholds.size(); ++k) {
      segments[segment_f1_name(s.thresholds[k])] = s.f1[k];
    }
    out["segments"] = segments;
  }
  if (m.tools) {
    const auto& t = *m.tools;
    TORCH_CHECK(tool_names.size() == t.average_precision.size(), "to_json: ", tool_names.size(),
                " names for ", t.average_precision.size(), " tools");
    nlohmann::json ap = nlohmann::json::object(), present = nlohmann::json::object(),
                   precision = nlohmann::json::object(), recall = nlohmann::json::object(),
                   f1 = nlohmann::json::object();
    for (size_t k = 0; k < tool_names.size(); ++k) {
      ap[tool_names[k]] = number(t.average_precision[k]);
      present[tool_names[k]] = t.present[k];
      precision[tool_names[k]] = number(t.precision[k]);
      recall[tool_names[k]] = number(t.recall[k]);
      f1[tool_names[k]] = number(t.f1[k]);
    }
    out["tools"] = {{"frames", t.frames},
                    {"mean_average_precision", number(t.mean_average_precision)},
                    {"average_precision", ap},
                    {"present_frames", present},
                    {"precision", precision},
                    {"recall", recall},
                    {"f1", f1}};
  }
  return out.dump();
}

PhaseMetrics metrics_from_json(const std::string& json, const std::vector<std::string>& phase_names,
                               const std::vector<std::string>& tool_names) {
  const auto in = nlohmann::json::parse(json);
  // Each key looked up by name, so that a missing one is named (json::at says only "key not
  // found"); null is to_json's NaN.
  auto at = [](const nlohmann::json& object, const std::string& key) -> const nlohmann::json& {
    TORCH_CHECK(object.is_object() && object.contains(key), "metrics_from_json: no \"", key,
                "\" in ", object.dump().substr(0, 200));
    return object[key];
  };
  auto number = [&](const nlohmann::json& object, const std::string& key) {
    const auto& v = at(object, key);
    return v.is_null() ? std::numeric_limits<double>::quiet_NaN() : v.get<double>();
  };
  PhaseMetrics m;
  m.frames = at(in, "frames").get<int64_t>();
  m.accuracy = number(in, "accuracy");
  m.macro_precision = number(in, "macro_precision");
  m.macro_recall = number(in, "macro_recall");
  m.macro_f1 = number(in, "macro_f1");
  m.macro_jaccard = number(in, "macro_jaccard");
  m.confusion = at(in, "confusion").get<std::vector<std::vector<int64_t>>>();
  for (const auto& name : phase_names) {
    const auto& phase = at(at(in, "phases"), name);
    m.precision.push_back(number(phase, "precision"));
    m.recall.push_back(number(phase, "recall"));
    m.f1.push_back(number(phase, "f1"));
    m.jaccard.push_back(number(phase, "jaccard"));
  }
  if (in.contains("segments")) {
    const auto& j = in["segments"];
    SegmentMetrics s;
    s.videos = at(j, "videos").get<int64_t>();
    s.edit = number(j, "edit");
    s.true_segments = at(j, "true_segments").get<int64_t>();
    s.predicted_segments = at(j, "predicted_segments").get<int64_t>();
    std::vector<std::pair<double, double>> f1;  // "f1@25": threshold 0.25; keys sort as text
    for (const auto& [key, value] : j.items()) {
      if (key.rfind("f1@", 0) == 0) f1.emplace_back(std::stod(key.substr(3)) / 100, value);
    }
    std::sort(f1.begin(), f1.end());
    for (const auto& [threshold, value] : f1) {
      s.thresholds.push_back(threshold);
      s.f1.push_back(value);
    }
    m.segments = s;
  }
  if (in.contains("tools")) {
    const auto& j = in["tools"];
    ToolMetrics t;
    t.frames = at(j, "frames").get<int64_t>();
    t.mean_average_precision = number(j, "mean_average_precision");
    for (const auto& name : tool_names) {
      t.average_precision.push_back(number(at(j, "average_precision"), name));
      t.present.push_back(at(at(j, "present_frames"), name).get<int64_t>());
      t.precision.push_back(number(at(j, "precision"), name));
      t.recall.push_back(number(at(j, "recall"), name));
      t.f1.push_back(number(at(j, "f1"), name));
    }
    m.tools = t;
  }
  return m;
}

double average_precision(const torch::Tensor& scores, const torch::Tensor& targets) {
  TORCH_CHECK(scores.dim() == 1 && targets.sizes() == scores.sizes(),
              "average_precision: scores and targets must both be [N]; got ", scores.sizes(),
              " and ", targets.sizes());
  const auto s = scores.to(torch::kDouble).contiguous();
  const auto y = targets.to(torch::kDouble).contiguous();
  const auto order = torch::argsort(s, 0, /*descending=*/true);
  const auto sorted_scores = s.index_select(0, order);
  const auto sorted_targets = y.index_select(0, order);
  const auto* score = sorted_scores.data_ptr<double>();
  const auto* target = sorted_targets.data_ptr<double>();
  const double positives = y.sum().item<double>();
  if (positives <= 0) return std::nan("");
  double ap = 0, true_positives = 0, recall_before = 0;
  const int64_t n = s.size(0);
  for (int64_t i = 0; i < n; ++i) {
    true_positives += target[i];
    // A threshold ends where the next score is lower: equal scores count together.
    if (i + 1 < n && score[i + 1] == score[i]) continue;
    const double recall = true_positives / positives;
    ap += (recall - recall_before) * true_positives / static_cast<double>(i + 1);
    recall_before = recall;
  }
  return ap;
}

void ToolScorer::add(const torch::Tensor& probabilities, const torch::Tensor& targets) {
  const auto k = static_cast<int64_t>(scores_.size());
  TORCH_CHECK(probabilities.dim() == 2 && probabilities.size(1) == k &&
                  targets.sizes() == probabilities.sizes(),
              "ToolScorer: probabilities and targets must both be [T,", k, "]; got ",
              probabilities.sizes(), " and ", targets.sizes());
  const auto p = probabilities.to(torch::kFloat32).cpu().contiguous();
  const auto y = targets.to(torch::kFloat32).cpu().contiguous();
  const auto* pp = p.data_ptr<float>();
  const auto* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < p.size(0); ++t) {
    bool annotated = false;
    for (int64_t j = 0; j < k; ++j) {
      if (yp[t * k + j] < 0) continue;
      annotated = true;
      scores_[j].push_back(pp[t * k + j]);
      targets_[j].push_back(yp[t * k + j]);
    }
    frames_ += annotated;
  }
}

ToolMetrics ToolScorer::metrics() const {
  ToolMetrics m;
  m.frames = frames_;
  double sum = 0;
  int64_t counted = 0;
  for (size_t j = 0; j < scores_.size(); ++j) {
    const auto n = static_cast<int64_t>(scores_[j].size());
    const auto s = torch::from_blob(const_cast<float*>(scores_[j].data()), {n}, torch::kFloat32);
    const auto y = torch::from_blob(const_cast<float*>(targets_[j].data()), {n}, torch::kFloat32);
    m.present.push_back(n == 0 ? 0 : static_cast<int64_t>(y.sum().item<float>()));
    m.average_precision.push_back(n == 0 ? std::nan("") : average_precision(s, y));
    const auto predicted = s.ge(0.5);
    const double hits = predicted.logical_and(y.gt(0.5)).sum().item<double>();
    const double said = predicted.sum().item<double>();
    const auto present = static_cast<double>(m.present.back());
    const double precision = said > 0 ? hits / said : std::nan("");
    const double recall = present > 0 ? hits / present : std::nan("");
    m.precision.push_back(precision);
    m.recall.push_back(recall);
    // 2 TP / (2 TP + FP + FN): 0 for a tool present but never predicted, or the reverse.
    const double errors = (said - hits) + (present - hits);
    m.f1.push_back(hits + errors > 0 ? 2 * hits / (2 * hits + errors) : std::nan(""));
    if (!std::isnan(m.average_precision.back())) {
      sum += m.average_precision.back();
      ++counted;
    }
  }
  m.mean_average_precision = counted > 0 ? sum / static_cast<double>(counted) : std::nan("");
  return m;
}

}  // namespace framefit::train
