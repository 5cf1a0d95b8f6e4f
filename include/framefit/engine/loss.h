#pragma once
// Per-frame phase-recognition loss over all stages of a temporal head.
#include <torch/types.h>

namespace framefit::engine {

struct PhaseLossOptions {
  torch::Tensor class_weights;  // [C], optional: for imbalanced phases
  // MS-TCN's smoothing term: weight (0.15 in the paper; 0 = off) of the truncated MSE between
  // consecutive frames' log-probabilities, clamped at `smoothing_clamp` (tau = 4).
  double smoothing = 0.0;
  double smoothing_clamp = 4.0;
  int64_t ignore_index = -100;  // frames with this label do not count
  // PyTorch's label_smoothing: the target is (1 - x) on the label plus x spread evenly over
  // all classes; 0: off.
  double label_smoothing = 0.0;
};

// logits [S,T,C] (or [T,C]), labels [T] int64 -> scalar: the sum over stages of the mean
// cross-entropy (plus smoothing). Labels of the wrong length or out of range are an error.
torch::Tensor phase_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                         const PhaseLossOptions& options = {});

// Tool presence (multi-label): logits [T,K], targets [T,K] of 1 (present), 0 (absent) or -1
// (not annotated) -> the mean binary cross-entropy with logits over the annotated entries
// (PyTorch's BCEWithLogitsLoss on them); 0, still attached to the logits, when none is.
// `positive_weight` [K], optional: BCEWithLogitsLoss's pos_weight, the weight of each tool's
// present entries (rare tools weigh more).
torch::Tensor tool_loss(const torch::Tensor& logits, const torch::Tensor& targets,
                        const torch::Tensor& positive_weight = {});
// pos_weight from the training frames' counts per tool [K]: annotated frames without the tool
// over those with it, so both weigh alike; a tool never present weighs 1. Float32 on the CPU.
torch::Tensor tool_positive_weights(const torch::Tensor& present, const torch::Tensor& annotated);

// Class weights from the training labels' counts per class [C]: total / (count x C), so a class
// at the average frequency weighs 1 and a rare one more; a class that never occurs counts as 1.
// Float32 on the CPU.
torch::Tensor inverse_frequency_weights(const torch::Tensor& counts);

}  // namespace framefit::engine
