#include "framefit/train/budget.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "framefit/memory/tracker.h"
#include "framefit/plan/planner.h"

namespace framefit::train {

TrainingBudget resolve_budget(const Config& config, const memory::Tracker& tracker,
                              int64_t largest_unit_bytes) {
  const torch::Device device(config.device);
  TrainingBudget b;
  if (config.train.budget <= 0) {
    b.total = b.tensors = tracker.available_bytes();
    return for_largest_unit(config, b, largest_unit_bytes);
  }
  b.total = config.train.budget;
  if (device.is_cpu() && config.train.budget_covers == "process") {
    b.runtime = memory::process_memory().untracked_bytes + kRuntimeGrowthBytes;
    TORCH_CHECK(b.total > b.runtime, "train.budget ", memory::format_bytes(b.total),
                " is below what this process holds without tensors, ",
                memory::format_bytes(b.runtime), " (the runtime's code and buffers, and ",
                memory::format_bytes(kRuntimeGrowthBytes),
                " for the data workers' and kernels' own): raise train.budget well above that, "
                "or set train.budget_covers: tensors to budget the tensors alone");
  }
  b.tensors = b.total - b.runtime;
  return for_largest_unit(config, b, largest_unit_bytes);
}

TrainingBudget for_largest_unit(const Config& config, TrainingBudget budget,
                                int64_t largest_unit_bytes) {
  budget.prefetch = prefetch_reserve_bytes(config, budget.tensors, largest_unit_bytes);
  budget.step = step_budget_bytes(config, budget.tensors, largest_unit_bytes);
  return budget;
}

std::string describe_budget(const TrainingBudget& budget) {
  const std::string total = "train.budget " + memory::format_bytes(budget.total);
  if (!budget.covers_process()) return total;
  return total + " less the runtime's " + memory::format_bytes(budget.runtime);
}

int64_t expected_rss_bytes(const TrainingBudget& budget, int64_t predicted_peak) {
  return budget.runtime + (budget.tensors - budget.step) + predicted_peak;
}

std::string describe_step_budget(const TrainingBudget& budget, int64_t predicted_peak) {
  const int64_t data = budget.tensors - budget.step;
  if (!budget.covers_process() && data <= 0) return "";
  std::string text = " (" + describe_budget(budget);
  if (data > 0) {
    text += (budget.covers_process() ? " and " : " less ") + memory::format_bytes(data) +
            " of decoded data";
  }
  text += ")";
  if (budget.covers_process()) {
    text += "; expected RSS about " +
            memory::format_bytes(expected_rss_bytes(budget, predicted_peak)) + " (up to " +
            memory::format_bytes(budget.total) + " with the freed blocks the allocator keeps)";
  }
  return text;
}

int64_t prefetch_reserve_bytes(const Config& config, int64_t budget, int64_t largest_unit_bytes) {
  const int64_t reserve = std::min(config.data.prefetch_bytes, budget / 4);
  // Clips and segmentation keep the whole reserve: it is their batch plans' only slack on the
  // CPU. Cut to a few images, a segmentation plan of 2.86 of 2.96 MiB ran out of memory in one
  // run and not in another (when the decoded data is held varies), and the retried micro-batches
  // changed BatchNorm's statistics, so a resumed run no longer matched the uninterrupted one.
  if (largest_unit_bytes <= 0 || is_batch_task(config)) return reserve;
  return std::min(reserve, (std::max<int64_t>(1, config.data.workers) + 1) * largest_unit_bytes);
}

int64_t step_budget_bytes(const Config& config, int64_t budget, int64_t largest_unit_bytes) {
  const torch::Device device(config.device);
  if (!device.is_cpu()) {
    // The decoded data waits in host memory, outside the device's budget. A phases plan keeps
    // the chunk planner's margin; batch plans leave the allocator's here.
    return is_batch_task(config) ? budget - plan::allocator_margin_bytes(budget, device) : budget;
  }
  const int64_t ahead =
      std::max(prefetch_reserve_bytes(config, budget, largest_unit_bytes), largest_unit_bytes);
  const int64_t batched = is_batch_task(config) ? largest_unit_bytes : 0;
  // Otherwise the planner's "needs a budget (> 0 bytes)" was all a user read.
  TORCH_CHECK(budget > ahead + batched, "train.budget ", memory::format_bytes(budget),
              " leaves nothing for the training step: decoded data takes ",
              memory::format_bytes(ahead + batched), " of the budget (the largest ",
              config.task == "segmentation" ? "image and mask" : "video", " decoded ahead",
              batched > 0 ? ", and the one being batched" : "",
              "); raise train.budget well above that");
  return budget - ahead - batched;
}

}  // namespace framefit::train
