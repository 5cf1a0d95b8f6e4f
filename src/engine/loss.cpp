#include "framefit/engine/loss.h"

#include <torch/torch.h>

namespace framefit::engine {

torch::Tensor phase_loss(const torch::Tensor& logits_in, const torch::Tensor& labels,
                         const PhaseLossOptions& options) {
  const auto logits = logits_in.dim() == 2 ? logits_in.unsqueeze(0) : logits_in;
  TORCH_CHECK(logits.dim() == 3, "phase_loss: logits must be [S,T,C] or [T,C]; got ",
              logits_in.sizes());
  const int64_t frames = logits.size(1), classes = logits.size(2);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == frames, "phase_loss: ", frames,
              " frames of logits but labels shaped ", labels.sizes(),
              ": there must be exactly one label per frame");
  TORCH_CHECK(labels.scalar_type() == torch::kInt64, "phase_loss: labels must be int64; got ",
              labels.scalar_type());
  const auto target = labels.to(logits.device());
  {
    const auto valid = target.ne(options.ignore_index);
    const auto counted = target.masked_select(valid);
    TORCH_CHECK(counted.numel() == 0 ||
                    (counted.min().item<int64_t>() >= 0 && counted.max().item<int64_t>() < classes),
                "phase_loss: labels must be in [0, ", classes, ") or ", options.ignore_index,
                "; got values from ", counted.min().item<int64_t>(), " to ",
                counted.max().item<int64_t>());
  }
  // bf16/fp16 logits are scored in float32; float64 stays float64 for exactness checks.
  const auto compute_dtype = logits.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto weights = options.class_weights;
  if (weights.defined()) {
    TORCH_CHECK(weights.dim() == 1 && weights.size(0) == classes, "phase_loss: class_weights must "
                "have one entry per class (", classes, "); got ", weights.sizes());
    weights = weights.to(logits.device(), compute_dtype);
  }
  torch::Tensor total;
  for (int64_t s = 0; s < logits.size(0); ++s) {
    const auto stage = logits[s].to(compute_dtype);
    auto loss =
        torch::nn::functional::cross_entropy(stage, target,
                                             torch::nn::functional::CrossEntropyFuncOptions()
                                                 .weight(weights)
                                                 .ignore_index(options.ignore_index)
                                                 .label_smoothing(options.label_smoothing));
    if (options.smoothing > 0 && frames > 1) {
      const auto log_probs = torch::log_softmax(stage, 1);
      const auto delta = log_probs.slice(0, 1) - log_probs.slice(0, 0, frames - 1).detach();
      const double tau = options.smoothing_clamp;
      loss = loss + options.smoothing * torch::clamp(delta.square(), 0, tau * tau).mean();
    }
    total = total.defined() ? total + loss : loss;
  }
  return total;
}

torch::Tensor tool_loss(const torch::Tensor& logits, const torch::Tensor& targets,
                        const torch::Tensor& positive_weight) {
  TORCH_CHECK(logits.dim() == 2 && targets.sizes() == logits.sizes(),
              "tool_loss: logits and targets must both be [T,K]; got ", logits.sizes(), " and ",
              targets.sizes(), " (one row of tool presence per frame)");
  const auto compute_dtype =
      logits.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto x = logits.to(compute_dtype);
  const auto y = targets.to(logits.device(), compute_dtype);
  const auto known = y.ge(0);
  TORCH_CHECK(y.masked_select(known).le(1).all().item<bool>(),
              "tool_loss: targets must be 1 (present), 0 (absent) or -1 (not annotated)");
  const auto count = known.sum().item<int64_t>();
  if (count == 0) return x.sum() * 0;
  auto options =
      torch::nn::functional::BinaryCrossEntropyWithLogitsFuncOptions().reduction(torch::kNone);
  if (positive_weight.defined()) {
    TORCH_CHECK(positive_weight.dim() == 1 && positive_weight.size(0) == x.size(1),
                "tool_loss: positive_weight must have one entry per tool (", x.size(1), "); got ",
                positive_weight.sizes());
    options.pos_weight(positive_weight.to(x.device(), compute_dtype));
  }
  const auto per_entry =
      torch::nn::functional::binary_cross_entropy_with_logits(x, y.clamp_min(0), options);
  return per_entry.masked_select(known).sum() / static_cast<double>(count);
}

torch::Tensor tool_positive_weights(const torch::Tensor& present, const torch::Tensor& annotated) {
  TORCH_CHECK(present.dim() == 1 && annotated.sizes() == present.sizes(),
              "tool_positive_weights: counts must both be [K], got ", present.sizes(), " and ",
              annotated.sizes());
  const auto p = present.to(torch::kDouble), n = annotated.to(torch::kDouble) - p;
  return torch::where(p > 0, n / p.clamp_min(1), torch::ones_like(p)).to(torch::kFloat32);
}

torch::Tensor inverse_frequency_weights(const torch::Tensor& counts) {
  TORCH_CHECK(counts.dim() == 1 && counts.numel() > 0,
              "inverse_frequency_weights: counts must be [C], got ", counts.sizes());
  const auto c = counts.to(torch::kDouble);
  return (c.sum() / (c.clamp_min(1) * c.numel())).to(torch::kFloat32);
}

}  // namespace framefit::engine
