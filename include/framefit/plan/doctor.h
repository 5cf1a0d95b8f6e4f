#pragma once
// The doctor: problems a training configuration will run into, found before anything is
// allocated, each with what to change.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

#include "framefit/models/network.h"
#include "framefit/plan/memory_model.h"
#include "framefit/plan/planner.h"

namespace framefit::plan {

struct Finding {
  enum class Severity { Error, Warning };
  Severity severity = Severity::Error;
  std::string problem;
  std::string fix;
};

// Checks a request against its model's static sizes (no calibration, no allocation): input too
// small for the network, a budget below the static minimum, BatchNorm statistics from a tiny
// chunk, fp16 on a CPU, an encoder frozen entirely, a temporal receptive field longer than the
// video. `budget_bytes` 0: no budget check.
std::vector<Finding> diagnose(const PlanRequest& request, int64_t budget_bytes);

// Frozen parameters (requires_grad false) handed to the optimizer anyway: they cost optimizer
// state (Adam: 2x their size) and are silently never trained. Named by their module path.
std::vector<Finding> check_optimizer(const torch::nn::Module& model,
                                     const torch::optim::Optimizer& optimizer);

// Checks a layer-list network (models/network.h) for its input shape without allocating: layers
// that do not fit their input (a Linear whose in_features differ from the flattened input is
// named with both sizes), a parameter tensor larger than the budget (named, with its size), and
// the static memory and largest batch for the budget. `budget_bytes` 0: no budget checks.
std::vector<Finding> diagnose_network(const std::vector<models::LayerSpec>& layers,
                                      const std::vector<int64_t>& input,
                                      const NetworkTraining& training, int64_t budget_bytes);

// The part of diagnose_network that the weights alone decide: layers that do not fit, a
// parameter tensor larger than the budget, parameters with gradients and optimizer state not
// below it. Training and planning refuse these before they build the network, whose allocation
// would otherwise end in an out-of-memory error instead of these words.
std::vector<Finding> diagnose_network_weights(const std::vector<models::LayerSpec>& layers,
                                              const std::vector<int64_t>& input,
                                              const NetworkTraining& training,
                                              int64_t budget_bytes);

bool has_errors(const std::vector<Finding>& findings);
// Throws the first error among `findings` (its problem and fix): settings that refuse a config.
void refuse_errors(const std::vector<Finding>& findings);

}  // namespace framefit::plan
