#pragma once
// Which stages of a checkpointed chain (engine/checkpoint.h) to recompute, for a memory budget:
// dynamic programming over the measured per-stage costs, a pure function of those numbers.
#include <cstdint>
#include <vector>

#include "framefit/engine/checkpoint.h"

namespace framefit::plan {

struct ChainPlan {
  std::vector<engine::ChainSegment> segments;
  bool fits = false;
  // Activation memory of the step (evaluate_chain): the largest of the forward pass (what the
  // stored stages keep plus the recomputed segments' outputs) and of each stage's backward
  // (what the stages before it keep, plus its own recompute and gradients).
  int64_t predicted_bytes = 0;
  double recompute_seconds = 0;  // time added by recomputing
  int64_t minimum_bytes = 0;     // the least activation memory any plan reaches
  int64_t recomputed_stages() const;
};

// The plan with the least recompute time whose activation memory fits `budget_bytes` (0: no
// budget, nothing recomputed), among segments stored, recomputed and nested. When none fits,
// fits is false and the plan is the one with the least memory. `max_segment_stages` > 0 limits
// how many stages one recomputed segment spans (1 for networks that are not a chain, such as a
// UNet: each stage recomputed on its own).
ChainPlan plan_chain(const std::vector<engine::StageCost>& costs, int64_t budget_bytes,
                     int64_t max_segment_stages = 0);
// The activation memory and recompute time of a given plan under the same model.
ChainPlan evaluate_chain(const std::vector<engine::StageCost>& costs,
                         std::vector<engine::ChainSegment> segments);

}  // namespace framefit::plan
