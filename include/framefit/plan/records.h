#pragma once
// The planner's results as JSON records, in the keys `framefit plan --json` and `doctor --json`
// print (and the plans of train/task.h hold): nlohmann::json's to_json, found by
// argument-dependent lookup, so that `nlohmann::json(breakdown)` and `json["settings"] =
// settings` work. And a predicted peak's parts as lines for a person.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "framefit/plan/doctor.h"
#include "framefit/plan/memory_model.h"
#include "framefit/plan/planner.h"

namespace framefit::plan {

// parameters, gradients, gradient_sums, optimizer_state, input_frames, features, activations,
// workspace (bytes), peak_phase and phase_peaks (bytes per phase).
void to_json(nlohmann::json& j, const Breakdown& breakdown);
// chunk (0: naive), keep, cache_frozen, precision, recompute_norm, videos_per_call.
void to_json(nlohmann::json& j, const StepSettings& settings);
// severity ("error" | "warning"), problem, fix.
void to_json(nlohmann::json& j, const Finding& finding);
// batch, plain_peak_bytes, planned_peak_bytes, recomputed_stages, fits.
void to_json(nlohmann::json& j, const BatchRow& row);

// The predicted peak in its parts, one indented line each ("    parameters and buffers   ...
// 44.7 MiB"), as `framefit plan` prints them; with `margin_bytes` > 0 the safety margin last.
std::vector<std::string> breakdown_lines(const Breakdown& breakdown, int64_t margin_bytes = 0);

}  // namespace framefit::plan
