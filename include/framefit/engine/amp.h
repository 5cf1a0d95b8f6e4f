#pragma once
// Mixed precision for LibTorch, which has neither a C++ autocast scope guard (1.13) nor a
// GradScaler: an autocast guard, a capturable autocast state (so recomputation in backward runs
// under the same precision as the forward pass), and a dynamic loss scaler for fp16.
#include <torch/types.h>

#include <string>
#include <vector>

namespace framefit::engine {

enum class Precision { FP32, BF16, FP16 };
Precision parse_precision(const std::string& name);  // "fp32" | "bf16" | "fp16"
std::string to_string(Precision precision);
// Refuses, saying why, bf16 on a CPU where no bf16 convolution runs (core/runtime.h, cpu_bf16).
// Training calls it once for the precision it was asked for, before anything is allocated
// (fp16 on the CPU is refused by AutocastGuard).
void check_runs_on(Precision precision, torch::Device device);
// Why `precision` runs slowly on `device`, where it does: bf16 on a CPU whose bf16 kernels are
// emulated (no bf16 instructions: many times slower than fp32; a ResNet-18 step over 600 frames
// had not finished in 26 minutes); "" otherwise. For a warning before the first step.
std::string slow_precision_reason(Precision precision, torch::Device device);

// Autocast settings of the current thread, for CPU and CUDA.
struct AutocastState {
  bool cpu_enabled = false;
  torch::ScalarType cpu_dtype = torch::kBFloat16;
  bool cuda_enabled = false;
  torch::ScalarType cuda_dtype = torch::kHalf;
  static AutocastState current();
  void apply() const;
};

// Enables autocast to `precision` on `device` for its lifetime (nothing for FP32), restoring the
// previous state and clearing the cast cache on exit.
class AutocastGuard {
 public:
  AutocastGuard(torch::Device device, Precision precision);
  explicit AutocastGuard(const AutocastState& state);  // enter a captured state
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
};

struct LossScalerOptions {
  double initial_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  // steps without overflow before the scale grows
  bool enabled = true;             // disabled: scale 1, nothing checked (fp32/bf16 training)
};

// `options` for a step at `precision`: loss scaling runs for fp16 only (bf16 and fp32 have
// float32's exponent range).
LossScalerOptions scaler_options_for(LossScalerOptions options, Precision precision);

// PyTorch's GradScaler semantics on ATen's _amp_ kernels: scale the loss, unscale gradients in
// place while checking for inf/NaN, skip the optimizer step on overflow and back off the scale,
// grow it after `growth_interval` clean steps.
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});
  torch::Tensor scale(const torch::Tensor& loss);
  // Divides the gradients by the scale; returns true if they are all finite. Idempotent per step.
  bool unscale(const std::vector<torch::Tensor>& parameters);
  // Call after unscale(): updates the scale; returns true when the optimizer step may run.
  bool update();
  double current_scale() const;
  int64_t skipped_steps() const { return skipped_; }
  bool enabled() const { return options_.enabled; }

  // State for checkpoints: {scale, growth_tracker, skipped} as a tensor of 3 doubles.
  torch::Tensor state() const;
  void load_state(const torch::Tensor& state);

 private:
  void ensure_device(torch::Device device);
  LossScalerOptions options_;
  torch::Tensor scale_;           // [1] float32 on the gradients' device
  torch::Tensor growth_tracker_;  // [1] int32
  torch::Tensor found_inf_;       // [1] float32
  bool unscaled_ = false;
  int64_t skipped_ = 0;
};

}  // namespace framefit::engine
