#include "framefit/train/schedule.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>

namespace framefit::train {

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

double learning_rate_factor(const TrainConfig& train, int64_t samples_per_step) {
  if (train.lr_batch <= 0) return 1;
  // Goyal et al.'s linear scaling rule; the square root keeps Adam's update variance.
  const double ratio = static_cast<double>(samples_per_step) / static_cast<double>(train.lr_batch);
  return train.lr_scaling == "sqrt" ? std::sqrt(ratio) : ratio;
}

std::string describe_learning_rate(const TrainConfig& train, int64_t samples_per_step) {
  if (train.lr_batch <= 0) return "";
  return c10::str("learning rate ", train.lr * learning_rate_factor(train, samples_per_step),
                  " (train.lr ", train.lr, " is for ", train.lr_batch,
                  " samples per step, train.lr_batch; ", samples_per_step,
                  " per step here, scaled ", train.lr_scaling, ")");
}

}  // namespace framefit::train
