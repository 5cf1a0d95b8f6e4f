// Each task's plan as Task::plan gives it (train/task.h): one record whose keys say the same for
// every task where they mean the same (fits, planned, step_budget_bytes, predicted_peak_bytes),
// and the lines `framefit plan --config` prints.
#include <c10/util/StringUtil.h>

#include <algorithm>

#include "framefit/memory/tracker.h"
#include "framefit/plan/records.h"
#include "framefit/train/schedule.h"
#include "framefit/train/tasks.h"
#include "framefit/train/trainer.h"
#include "task_kinds.h"

namespace framefit::train::detail {

RunPlan phase_run_plan(const Config& config, const PhasePlan& plan) {
  RunPlan out;
  out.fits = plan.fits;
  auto& record = out.record;
  record = {{"fits", plan.fits},
            {"planned", plan.planned},
            {"settings", plan.settings},
            {"videos", plan.videos},
            {"longest_frames", plan.longest_frames},
            {"frame_size", plan.frame_size},
            {"budget_bytes", plan.budget.total},
            {"runtime_bytes", plan.budget.runtime},
            {"step_budget_bytes", plan.budget.step}};
  const auto& budget = plan.budget;
  const int64_t expected_rss = plan.planned && budget.covers_process()
                                   ? expected_rss_bytes(budget, plan.breakdown.peak_bytes)
                                   : 0;
  if (plan.planned) {
    record["predicted_peak_bytes"] = plan.breakdown.peak_bytes;
    if (expected_rss > 0) record["expected_rss_bytes"] = expected_rss;
    record["breakdown"] = plan.breakdown;
  }
  if (!plan.fits) record["advice"] = plan.advice;

  auto& lines = out.lines;
  if (config.model.encoder == "features") {
    lines.push_back(c10::str(
        "framefit plan: the ", config.model.head, " head on precomputed features, ", plan.videos,
        " training videos, the longest ", plan.longest_frames,
        " frames: nothing to plan (no encoder; the head runs on whole videos in float32)"));
    return out;
  }
  lines.push_back(c10::str(
      "framefit plan: ", config.model.encoder, " + ", config.model.head, " head, ", plan.videos,
      " training videos, the longest ", plan.longest_frames, " frames of ", plan.frame_size, "x",
      plan.frame_size, ", budget ", memory::format_bytes(budget.total),
      plan.budget.step < budget.total
          ? c10::str(" (step budget ", memory::format_bytes(plan.budget.step), ": less ",
                     budget.covers_process()
                         ? "the runtime's " + memory::format_bytes(budget.runtime) + " and "
                         : std::string(),
                     memory::format_bytes(budget.tensors - plan.budget.step), " of decoded data)")
          : std::string()));
  if (!plan.planned) {
    lines.push_back("  " + plan::describe(plan.settings) + " (fixed by the config; not planned)");
  } else if (plan.fits) {
    lines.push_back("  " + plan::describe(plan.settings));
    for (auto& line : plan::breakdown_lines(plan.breakdown)) lines.push_back(std::move(line));
    if (expected_rss > 0) {
      lines.push_back(c10::str("  expected RSS about ", memory::format_bytes(expected_rss),
                               " (the runtime's, the decoded data and the predicted peak; up to ",
                               memory::format_bytes(budget.total),
                               " with the freed blocks the allocator keeps for "
                               "reuse)"));
    }
  } else {
    lines.push_back("  does not fit: " + plan.advice);
  }
  return out;
}

RunPlan batch_run_plan(const Config& config, const BatchTaskPlan& plan) {
  RunPlan out;
  out.fits = plan.batch > 0;
  const auto flags = engine::recomputed(plan.segments);
  const int64_t samples_per_step = plan.batch * plan.accumulate;
  out.record = {
      {"fits", plan.batch > 0},
      {"planned", plan.planned},
      {"batch", plan.batch},
      {"largest_batch", plan.largest_batch},
      {"samples", plan.samples},
      {"accumulate", plan.accumulate},
      {"micro_batches", plan.micro_batches},
      {"input", plan.input},
      {"precision", engine::to_string(plan.precision)},
      {"lean_backward", plan.lean_backward},
      {"recompute_norm", plan.recompute_norm},
      {"time_slices", plan.time_slices},
      {"recomputed_stages", std::count(flags.begin(), flags.end(), true)},
      {"stages", flags.size()},
      {"budget_bytes", plan.budget.tensors},  // the phases plan's is train.budget (total)
      {"step_budget_bytes", plan.budget.step},
      {"static_bytes", plan.static_bytes},
      {"library_bytes", plan.library_bytes},
      {"input_bytes", plan.input_bytes},
      {"activation_bytes", plan.activation_bytes},
      {"predicted_peak_bytes", plan.predicted_peak_bytes},
      {"minimum_bytes_one_sample", plan.minimum_bytes_one_sample},
      {"eval_batch", plan.eval_batch},
      {"eval_predicted_peak_bytes", plan.eval_peak_bytes},
      // train.lr scaled by train.lr_batch for the planned batch
      {"learning_rate", config.train.lr * learning_rate_factor(config.train, samples_per_step)}};
  for (const auto& row : plan.table) out.record["table"].push_back(row);

  auto& lines = out.lines;
  lines.push_back(plan.describe());
  const auto rate = describe_learning_rate(config.train, samples_per_step);
  if (!rate.empty() && plan.batch > 0) lines.push_back("  " + rate);
  if (plan.largest_batch > plan.batch && plan.planned) {
    lines.push_back(c10::str("  the budget fits a batch of ", plan.largest_batch, "; the ",
                             plan.samples, " training samples cap it"));
  }
  if (plan.table.empty()) return out;
  // Columns as `{:>7} {:>18} {:>14} {:>12} {:>5}`.
  const auto row = [](const std::string& batch, const std::string& plain,
                      const std::string& planned, const std::string& recomputed,
                      const std::string& fits) {
    const auto right = [](const std::string& text, size_t width) {
      return std::string(width > text.size() ? width - text.size() : 0, ' ') + text;
    };
    return "  " + right(batch, 7) + " " + right(plain, 18) + " " + right(planned, 14) + " " +
           right(recomputed, 12) + " " + right(fits, 5);
  };
  out.table.push_back(c10::str("  predicted peak per batch, ", engine::to_string(plan.precision),
                               " (step budget ", memory::format_bytes(plan.budget.step),
                               ", train.checkpointing ", plan.checkpointing, "):"));
  out.table.push_back(row("batch", "no checkpointing", "planned", "recomputed", "fits"));
  for (const auto& r : plan.table) {
    out.table.push_back(row(std::to_string(r.batch), memory::format_bytes(r.plain_peak_bytes),
                            memory::format_bytes(r.planned_peak_bytes),
                            c10::str(r.recomputed_stages, " of ", flags.size()),
                            r.fits ? "yes" : "no"));
  }
  return out;
}

}  // namespace framefit::train::detail
