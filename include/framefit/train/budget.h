#pragma once
// train.budget as a run spends it: the total, the process's own share under a process budget,
// the tensors' budget the tracker holds the run to, and within it the data pipeline's prefetch
// reserve and what a training step may use. Worked out once when a run is planned (by train,
// plan and doctor alike: resolve_budget), and described the way plan lines say it.
#include <cstdint>
#include <string>

#include "framefit/memory/tracker.h"
#include "framefit/train/config.h"

namespace framefit::train {

// train.budget as a run can spend it, worked out when the run is planned.
struct TrainingBudget {
  int64_t total = 0;  // train.budget, else the device's available memory
  // Of total, the process's own (on the CPU with train.budget_covers process): what is resident
  // outside the tracking allocator now (code, the libraries' buffers) and what training starts
  // later (kRuntimeGrowthBytes: data workers, threads, kernels). 0 otherwise.
  int64_t runtime = 0;
  int64_t tensors = 0;  // total - runtime: the tracker's budget (and held limit) for the run
  // Of tensors, for the run's largest decoded unit: the decoded frames the data pipeline may
  // hold ahead (prefetch_reserve_bytes), and what a training step may use (step_budget_bytes:
  // on the CPU the rest beside the decoded data; on CUDA all of it, less the caching
  // allocator's margin for clips and segmentation).
  int64_t prefetch = 0;
  int64_t step = 0;
  bool covers_process() const { return runtime > 0; }
  // Under a process budget the allocator's cache is held within the tensors' budget too, so
  // that the resident memory stays within train.budget; 0 (the tracker's default) otherwise.
  int64_t held_limit() const { return covers_process() ? tensors : 0; }
};
// Measured on the demo (1 GiB, 64x64 frames): resident outside the allocator, 168 MiB when the
// run was planned, 204 MiB after two epochs' steps (with memory::release_free_heap after each;
// 250 MiB after one without), and at least 235 MiB within a step (malloc's arenas, which the
// step's small blocks fill and the release after it empties).
constexpr int64_t kRuntimeGrowthBytes = int64_t(96) << 20;
// `tracker`: config.device's, whose available memory is the budget where train.budget is 0;
// `largest_unit_bytes`: the largest unit (video, image and mask) the run decodes, 0 where unknown
// (the doctor reads no data).
TrainingBudget resolve_budget(const Config& config, const memory::Tracker& tracker,
                              int64_t largest_unit_bytes = 0);
// `budget` with its prefetch reserve and step budget for another largest decoded unit.
TrainingBudget for_largest_unit(const Config& config, TrainingBudget budget,
                                int64_t largest_unit_bytes);
// "train.budget 1.00 GiB less the runtime's 233.1 MiB" (or "train.budget 1.00 GiB"), for plans.
std::string describe_budget(const TrainingBudget& budget);
// The resident memory a plan of `predicted_peak` in budget.step should reach: the runtime's
// share, the decoded data beside the step, and the step's peak.
int64_t expected_rss_bytes(const TrainingBudget& budget, int64_t predicted_peak);
// What a plan line says after "predicted peak P of S": where the step budget S (budget.step)
// comes from, and
// under a process budget the resident memory to expect (runtime, decoded data, the step's peak):
// " (train.budget 1.00 GiB less the runtime's 233 MiB and 18 MiB of decoded data); expected RSS
// about 891 MiB (up to 1.00 GiB with the freed blocks the allocator keeps)": the allocator's
// cache may fill the tensors' budget. Empty where S is the whole budget.
std::string describe_step_budget(const TrainingBudget& budget, int64_t predicted_peak);

// The data pipeline's share of `budget` (the tensors' budget): the decoded frames it may hold
// ahead of training, data.prefetch_bytes but at most a quarter, and for phases no more than one
// unit per worker and one waiting (`largest_unit_bytes` each, the largest decoded unit; 0 where
// unknown), which keeps training fed as well as more would. Clips and segmentation keep the
// quarter: it is their batch plans' only slack on the CPU.
int64_t prefetch_reserve_bytes(const Config& config, int64_t budget, int64_t largest_unit_bytes);
// What a training step may use of `budget`. On the CPU: the rest beside the decoded data, which
// is the frames decoded ahead (the prefetch reserve, or one unit larger than that, which is
// decoded alone) and, for clips and segmentation, the unit whose samples are being batched (a
// phases step's plan counts its video itself). `largest_unit_bytes`: the largest decoded unit
// (video, or image and mask); 0 where unknown. On CUDA the decoded data is in host memory: all
// of it, less plan::allocator_margin_bytes for clips and segmentation.
int64_t step_budget_bytes(const Config& config, int64_t budget, int64_t largest_unit_bytes);

}  // namespace framefit::train
