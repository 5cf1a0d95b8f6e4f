#pragma once
// The learning rate of a run: its schedule over the optimizer steps, and train.lr scaled for the
// samples a step takes (train.lr_batch).
#include <cstdint>
#include <string>

#include "framefit/train/config.h"

namespace framefit::train {

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

// The factor train.lr_batch scales train.lr and train.min_lr by for `samples_per_step` (1 when
// it is 0), and a line saying so (empty when it is 0).
double learning_rate_factor(const TrainConfig& train, int64_t samples_per_step);
std::string describe_learning_rate(const TrainConfig& train, int64_t samples_per_step);

}  // namespace framefit::train
