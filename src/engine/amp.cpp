#include "framefit/engine/amp.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "framefit/core/runtime.h"

namespace framefit::engine {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::FP32;
  if (name == "bf16") return Precision::BF16;
  if (name == "fp16") return Precision::FP16;
  TORCH_CHECK(false, "unknown precision '", name, "': use fp32, bf16 or fp16");
}

void check_runs_on(Precision precision, torch::Device device) {
  // fp16 on the CPU is AutocastGuard's to refuse, as it always was.
  TORCH_CHECK(!(device.is_cpu() && precision == Precision::BF16 &&
                cpu_bf16().kernels == Bf16Kernels::Unavailable),
              "bf16 autocast cannot run here: ", cpu_bf16().reason, "; use fp32");
}

std::string slow_precision_reason(Precision precision, torch::Device device) {
  if (!device.is_cpu() || precision != Precision::BF16 ||
      cpu_bf16().kernels != Bf16Kernels::Emulated)
    return "";
  return "bf16 runs emulated here (" + cpu_bf16().reason +
         "): expect steps many times slower than fp32; precision fp32 (or auto) avoids it";
}

std::string to_string(Precision precision) {
  switch (precision) {
    case Precision::FP32: return "fp32";
    case Precision::BF16: return "bf16";
    case Precision::FP16: return "fp16";
  }
  return "?";
}

// The autocast API moved from per-backend functions to device-type arguments in LibTorch 2.4.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  return s;
}
void AutocastState::apply() const {
  at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
  at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
}
#else
AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu_enabled = at::autocast::is_cpu_enabled();
  s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
  s.cuda_enabled = at::autocast::is_enabled();
  s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
  return s;
}
void AutocastState::apply() const {
  at::autocast::set_cpu_enabled(cpu_enabled);
  at::autocast::set_autocast_cpu_dtype(cpu_dtype);
  at::autocast::set_enabled(cuda_enabled);
  at::autocast::set_autocast_gpu_dtype(cuda_dtype);
}
#endif

AutocastGuard::AutocastGuard(torch::Device device, Precision precision)
    : previous_(AutocastState::current()) {
  AutocastState next = previous_;
  if (precision != Precision::FP32) {
    const auto dtype = precision == Precision::BF16 ? torch::kBFloat16 : torch::kHalf;
    TORCH_CHECK(!(device.is_cpu() && precision == Precision::FP16),
                "fp16 autocast is not available on CPU in this LibTorch: use bf16 on CPU");
    if (device.is_cpu()) {
      next.cpu_enabled = true;
      next.cpu_dtype = dtype;
    } else {
      next.cuda_enabled = true;
      next.cuda_dtype = dtype;
    }
  }
  at::autocast::increment_nesting();
  next.apply();
}

AutocastGuard::AutocastGuard(const AutocastState& state) : previous_(AutocastState::current()) {
  at::autocast::increment_nesting();
  state.apply();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  previous_.apply();
}

// ---------------------------------------------------------------------------------------------

LossScaler::LossScaler(LossScalerOptions options) : options_(options) {
  TORCH_CHECK(options.initial_scale > 0 && options.growth_factor > 1 &&
                  options.backoff_factor > 0 && options.backoff_factor < 1 &&
                  options.growth_interval > 0,
              "loss scaler options: need initial_scale > 0, growth_factor > 1, "
              "0 < backoff_factor < 1, growth_interval > 0");
  scale_ = torch::full({1}, options.enabled ? options.initial_scale : 1.0, torch::kFloat32);
  growth_tracker_ = torch::zeros({1}, torch::kInt32);
  found_inf_ = torch::zeros({1}, torch::kFloat32);
}

void LossScaler::ensure_device(torch::Device device) {
  if (scale_.device() == device) return;
  scale_ = scale_.to(device);
  growth_tracker_ = growth_tracker_.to(device);
  found_inf_ = found_inf_.to(device);
}

torch::Tensor LossScaler::scale(const torch::Tensor& loss) {
  if (!options_.enabled) return loss;
  ensure_device(loss.device());
  unscaled_ = false;
  return loss * scale_.to(loss.scalar_type());
}

bool LossScaler::unscale(const std::vector<torch::Tensor>& parameters) {
  if (!options_.enabled) return true;
  if (unscaled_) return found_inf_.item<float>() == 0.0f;
  std::vector<torch::Tensor> grads;
  for (const auto& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  found_inf_.zero_();
  if (!grads.empty()) {
    ensure_device(grads.front().device());
    const auto inv_scale = scale_.to(torch::kFloat64).reciprocal().to(torch::kFloat32);
    if (scale_.is_cuda()) {
      // One fused kernel, no host synchronisation (what PyTorch's GradScaler uses).
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, inv_scale);
    } else {
      // LibTorch 1.13 has no CPU kernel for it.
      torch::NoGradGuard no_grad;
      for (auto& g : grads) {
        found_inf_.add_(torch::logical_not(torch::isfinite(g)).any().to(torch::kFloat32));
        g.mul_(inv_scale.to(g.scalar_type()));
      }
      found_inf_.clamp_max_(1);
    }
  }
  unscaled_ = true;
  return found_inf_.item<float>() == 0.0f;
}

bool LossScaler::update() {
  if (!options_.enabled) return true;
  TORCH_CHECK(unscaled_, "LossScaler::update() needs unscale() first in the same step");
  const bool finite = found_inf_.item<float>() == 0.0f;
  if (scale_.is_cuda()) {
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor,
                           options_.backoff_factor, options_.growth_interval);
  } else if (!finite) {
    scale_.mul_(options_.backoff_factor);
    growth_tracker_.zero_();
  } else if (growth_tracker_.item<int>() + 1 >= options_.growth_interval) {
    scale_.mul_(options_.growth_factor);
    growth_tracker_.zero_();
  } else {
    growth_tracker_.add_(1);
  }
  unscaled_ = false;
  if (!finite) ++skipped_;
  return finite;
}

double LossScaler::current_scale() const { return scale_.item<double>(); }

torch::Tensor LossScaler::state() const {
  return torch::tensor({scale_.item<double>(), static_cast<double>(growth_tracker_.item<int>()),
                        static_cast<double>(skipped_)},
                       torch::kFloat64);
}

void LossScaler::load_state(const torch::Tensor& state) {
  TORCH_CHECK(state.numel() == 3, "loss scaler state must hold 3 numbers; got ", state.numel());
  const auto s = state.to(torch::kCPU, torch::kFloat64);
  scale_.fill_(s[0].item<double>());
  growth_tracker_.fill_(static_cast<int>(s[1].item<double>()));
  skipped_ = static_cast<int64_t>(s[2].item<double>());
}

LossScalerOptions scaler_options_for(LossScalerOptions options, Precision precision) {
  options.enabled = options.enabled && precision == Precision::FP16;
  return options;
}

}  // namespace framefit::engine
