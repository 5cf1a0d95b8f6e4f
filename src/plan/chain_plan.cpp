#include "framefit/plan/chain_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace framefit::plan {

using engine::ChainSegment;
using engine::recomputed;
using engine::StageCost;
using engine::store_all;

int64_t ChainPlan::recomputed_stages() const {
  const auto flags = recomputed(segments);
  return std::count(flags.begin(), flags.end(), true);
}

namespace {

// A recomputed segment's cost, built up one stage at a time from its first (`add` the next):
// what its backward holds above the memory kept before it, and the time its recompute adds.
// Backward runs its stages last first; at each, the gradients of the later stages' parameters
// are still held (StageCost::parameter_grad_bytes).
struct SegmentCost {
  int64_t kept_bytes = 0;  // what its stages keep, recomputed at once
  // Above kept_bytes, the largest backward transient of a stage (gradients of its input, output
  // and intermediates; the incoming gradient is freed as a stored stage frees it:
  // take_incoming) plus those parameter gradients.
  int64_t extra_bytes = 0;
  // Nested, the whole: at each stage, the outputs of the stages before it (recomputed), its own
  // peak and the later stages' parameter gradients.
  int64_t nested_bytes = 0;
  int64_t outputs_bytes = 0;  // of the stages added so far
  // The recompute's forward, beside the segment's incoming gradient (the last stage's output
  // size): the highest of what the stages before keep plus a stage's forward peak.
  int64_t forward_bytes = 0;
  int64_t last_output_bytes = 0;
  double seconds = 0;              // one forward of every stage
  double seconds_before_last = 0;  // ... but the last
  void add(const StageCost& c) {
    forward_bytes = std::max(forward_bytes, kept_bytes + c.forward_peak_bytes);
    kept_bytes += c.kept_bytes;
    extra_bytes = std::max(extra_bytes + c.parameter_grad_bytes, c.peak_bytes - c.kept_bytes);
    nested_bytes = std::max(nested_bytes + c.parameter_grad_bytes,
                            outputs_bytes + std::max({c.peak_bytes, c.kept_bytes,
                                                      c.forward_peak_bytes + c.output_bytes}));
    outputs_bytes += c.output_bytes;
    last_output_bytes = c.output_bytes;
    seconds_before_last = seconds;
    seconds += c.seconds;
  }
  int64_t held_bytes(bool nested) const {
    return nested ? nested_bytes
                  : std::max(kept_bytes + extra_bytes, forward_bytes + last_output_bytes);
  }
  // Not above held_bytes(nested) for either, and never falling as stages are added.
  int64_t held_lower_bound() const { return std::min(kept_bytes + extra_bytes, nested_bytes); }
  // Its stages run once more; nested, all but the last once again to get their inputs back.
  double recompute_seconds(bool nested) const {
    return seconds + (nested ? seconds_before_last : 0.0);
  }
};

SegmentCost segment_cost(const std::vector<StageCost>& costs, int64_t b, int64_t e) {
  SegmentCost segment;
  for (int64_t i = b; i < e; ++i) segment.add(costs[static_cast<size_t>(i)]);
  return segment;
}

}  // namespace

// Backward runs the segments last to first; when it reaches a segment, the later ones have been
// freed and the earlier ones still hold what they keep (`kept` below). A stored stage then adds
// its backward peak; a recomputed segment what its backward holds (SegmentCost). The forward
// pass's peak is everything kept.
ChainPlan evaluate_chain(const std::vector<StageCost>& costs, std::vector<ChainSegment> segments) {
  ChainPlan plan;
  int64_t kept = 0, peak = 0;
  for (const auto& s : segments) {
    if (s.recompute) {
      const auto segment = segment_cost(costs, s.begin, s.end);
      peak = std::max(peak, kept + segment.held_bytes(s.nested));
      kept += costs[static_cast<size_t>(s.end - 1)].output_bytes;
      plan.recompute_seconds += segment.recompute_seconds(s.nested);
    } else {
      for (int64_t i = s.begin; i < s.end; ++i) {
        const auto& c = costs[static_cast<size_t>(i)];
        peak = std::max(peak, kept + std::max(c.peak_bytes, c.kept_bytes));
        kept += c.kept_bytes;
      }
    }
  }
  plan.segments = std::move(segments);
  plan.predicted_bytes = std::max(peak, kept);
  return plan;
}

namespace {

// Least recompute time with a predicted peak within `budget`: a DP over (stage, kept memory in
// units of budget/256, rounded up so every plan found fits). Infinity when none fits.
double least_recompute(const std::vector<StageCost>& costs, int64_t budget, int64_t longest,
                       std::vector<ChainSegment>* out) {
  constexpr int64_t kUnits = 256;
  const auto n = static_cast<int64_t>(costs.size());
  const double unit = std::max(1.0, static_cast<double>(budget) / kUnits);
  const auto units = [&](int64_t bytes) {
    return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) / unit));
  };
  const double inf = std::numeric_limits<double>::infinity();
  struct Step {
    int64_t begin = -1, units = -1;
    bool recompute = false, nested = false;
  };
  std::vector<std::vector<double>> time(n + 1, std::vector<double>(kUnits + 1, inf));
  std::vector<std::vector<Step>> from(n + 1, std::vector<Step>(kUnits + 1));
  time[0][0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t m = 0; m <= kUnits; ++m) {
      if (time[i][m] == inf) continue;
      const auto kept = static_cast<int64_t>(std::ceil(static_cast<double>(m) * unit));
      const auto& c = costs[static_cast<size_t>(i)];
      const int64_t stored = m + units(c.kept_bytes);
      if (kept + std::max(c.peak_bytes, c.kept_bytes) <= budget && stored <= kUnits &&
          time[i][m] < time[i + 1][stored]) {
        time[i + 1][stored] = time[i][m];
        from[i + 1][stored] = {i, m, false};
      }
      // Segments [i, e) recomputed (their stages at once) or nested (one at a time).
      SegmentCost segment;
      for (int64_t e = i + 1; e <= std::min(n, i + longest); ++e) {
        const auto& last = costs[static_cast<size_t>(e - 1)];
        segment.add(last);
        // No longer segment from i fits once this bound passes the budget.
        if (kept + segment.held_lower_bound() > budget) break;
        const int64_t next = m + units(last.output_bytes);
        if (next > kUnits) continue;
        for (const bool nested : {false, true}) {
          if (nested && e - i < 2) continue;  // one stage nested is one stage recomputed
          const double t = time[i][m] + segment.recompute_seconds(nested);
          if (kept + segment.held_bytes(nested) <= budget && t < time[e][next]) {
            time[e][next] = t;
            from[e][next] = {i, m, true, nested};
          }
        }
      }
    }
  }
  int64_t end_units = -1;
  for (int64_t m = 0; m <= kUnits; ++m) {
    if (time[n][m] < inf && (end_units < 0 || time[n][m] < time[n][end_units])) end_units = m;
  }
  if (end_units < 0) return inf;
  if (out) {
    out->clear();
    for (int64_t e = n, m = end_units; e > 0;) {
      const auto step = from[e][m];
      if (!step.recompute && !out->empty() && !out->back().recompute) {
        out->back().begin = step.begin;  // consecutive stored stages: one segment
      } else {
        out->push_back({step.begin, e, step.recompute, step.nested});
      }
      e = step.begin;
      m = step.units;
    }
    std::reverse(out->begin(), out->end());
  }
  return time[n][end_units];
}

}  // namespace

ChainPlan plan_chain(const std::vector<StageCost>& costs, int64_t budget_bytes,
                     int64_t max_segment_stages) {
  TORCH_CHECK(!costs.empty(), "plan_chain: no stages");
  TORCH_CHECK(budget_bytes >= 0, "plan_chain: the budget must not be negative");
  const auto n = static_cast<int64_t>(costs.size());
  const int64_t longest = max_segment_stages > 0 ? max_segment_stages : n;
  const auto no_recompute = evaluate_chain(costs, store_all(n));

  // The least memory any plan reaches: bisection on the budget the DP can meet.
  int64_t low = 0, high = no_recompute.predicted_bytes;
  std::vector<ChainSegment> least_segments = store_all(n);
  while (high - low > std::max<int64_t>(1, high / 1000)) {
    const int64_t mid = low + (high - low) / 2;
    std::vector<ChainSegment> segments;
    if (least_recompute(costs, mid, longest, &segments) < std::numeric_limits<double>::infinity()) {
      high = mid;
      least_segments = segments;
    } else {
      low = mid;
    }
  }
  const int64_t minimum = evaluate_chain(costs, least_segments).predicted_bytes;

  ChainPlan plan;
  if (budget_bytes == 0 || no_recompute.predicted_bytes <= budget_bytes) {
    plan = no_recompute;
  } else {
    std::vector<ChainSegment> segments;
    if (least_recompute(costs, budget_bytes, longest, &segments) <
        std::numeric_limits<double>::infinity()) {
      plan = evaluate_chain(costs, segments);
    } else {
      plan = evaluate_chain(costs, least_segments);
    }
  }
  plan.fits = budget_bytes == 0 || plan.predicted_bytes <= budget_bytes;
  plan.minimum_bytes = std::min(minimum, plan.predicted_bytes);
  return plan;
}

}  // namespace framefit::plan
