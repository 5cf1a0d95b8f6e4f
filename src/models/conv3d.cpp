#include "framefit/models/conv3d.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <variant>

namespace framefit::models {

// The convolution options hold a c10::variant in LibTorch 1.13 and a std::variant from 2.x on:
// unqualified get and holds_alternative find either's by argument-dependent lookup.
using std::get;
using std::holds_alternative;

namespace {

// Restores oneDNN's global switch however backward ends. LibTorch re-selects the convolution
// kernel in backward from this switch; nothing else runs operators while a backward does.
class OneDnnOff {
 public:
  OneDnnOff() : was_(at::globalContext().userEnabledMkldnn()) {
    at::globalContext().setUserEnabledMkldnn(false);
  }
  ~OneDnnOff() { at::globalContext().setUserEnabledMkldnn(was_); }
  OneDnnOff(const OneDnnOff&) = delete;
  OneDnnOff& operator=(const OneDnnOff&) = delete;

 private:
  bool was_;
};

class LeanConv3dFunction : public torch::autograd::Function<LeanConv3dFunction> {
 public:
  // `bias`: none or one tensor (a custom function takes no undefined tensor).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, at::TensorList bias,
                               std::vector<int64_t> stride, std::vector<int64_t> padding) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["bias"] = !bias.empty();
    return at::convolution(x, weight, bias.empty() ? torch::Tensor() : bias[0], stride, padding,
                           /*dilation=*/{1, 1, 1},
                           /*transposed=*/false, /*output_padding=*/{0, 0, 0}, /*groups=*/1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& weight = saved[1];
    const bool has_bias = ctx->saved_data["bias"].toBool();
    const std::array<bool, 3> wanted = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                        has_bias && ctx->needs_input_grad(2)};
    const std::vector<int64_t> bias_sizes = {weight.size(0)};
    OneDnnOff one_dnn_off;
    auto [grad_x, grad_weight, grad_bias] = at::convolution_backward(
        grads[0], x, weight, has_bias ? c10::OptionalIntArrayRef(bias_sizes) : c10::nullopt,
        ctx->saved_data["stride"].toIntVector(), ctx->saved_data["padding"].toIntVector(),
        /*dilation=*/{1, 1, 1}, /*transposed=*/false, /*output_padding=*/{0, 0, 0}, /*groups=*/1,
        wanted);
    // One gradient per forward argument, the bias list flattened.
    torch::autograd::variable_list result = {grad_x, grad_weight};
    if (has_bias) result.push_back(grad_bias);
    result.insert(result.end(), {torch::Tensor(), torch::Tensor()});
    return result;
  }
};

// The autocast API moved from per-backend functions to device-type arguments in LibTorch 2.4.
bool cpu_autocast_enabled() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(at::kCPU);
#else
  return at::autocast::is_cpu_enabled();
#endif
}

std::vector<int64_t> output_size(const torch::nn::detail::ConvNdOptions<3>& o,
                                 const torch::Tensor& x) {
  std::vector<int64_t> out;
  for (int64_t d = 0; d < 3; ++d) {
    const int64_t padding = get<torch::ExpandingArray<3>>(o.padding())->at(d);
    out.push_back((x.size(2 + d) + 2 * padding - o.kernel_size()->at(d)) / o.stride()->at(d) + 1);
  }
  return out;
}

// takes_lean_backward without the switch.
bool lean_backward_applies(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  const auto& o = conv.options;
  if (!x.defined() || x.dim() != 5 || !x.device().is_cpu() || x.scalar_type() != torch::kFloat32 ||
      cpu_autocast_enabled() || !torch::GradMode::is_enabled() ||
      !(x.requires_grad() || conv.weight.requires_grad()) || o.groups() != 1 ||
      !holds_alternative<torch::ExpandingArray<3>>(o.padding()) ||
      !holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
    return false;
  }
  for (int64_t d = 0; d < 3; ++d) {
    if (o.dilation()->at(d) != 1) return false;
  }
  int64_t positions = 1;
  for (const int64_t size : output_size(o, x)) positions *= size;
  return positions <= kLeanBackwardMaxPositions;
}

}  // namespace

bool takes_lean_backward(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  return conv.lean_backward && lean_backward_applies(conv, x);
}

int64_t set_lean_backward(torch::nn::Module& module, bool on) {
  int64_t count = 0;
  for (const auto& child : module.modules()) {
    if (auto* conv = child->as<LeanConv3dImpl>()) {
      conv->lean_backward = on;
      ++count;
    }
  }
  return count;
}

int64_t lean_applicable_calls(const torch::nn::Module& module) {
  int64_t calls = 0;
  for (const auto& child : module.modules()) {
    if (const auto* conv = child->as<LeanConv3dImpl>()) calls += conv->lean_applicable_calls;
  }
  return calls;
}

torch::Tensor LeanConv3dImpl::forward(const torch::Tensor& x) {
  if (!lean_backward_applies(*this, x)) return Conv3dImpl::forward(x);
  ++lean_applicable_calls;
  if (!lean_backward) return Conv3dImpl::forward(x);
  const auto& padding = get<torch::ExpandingArray<3>>(options.padding());
  std::vector<torch::Tensor> biases;
  if (bias.defined()) biases.push_back(bias);
  return LeanConv3dFunction::apply(
      x, weight, at::TensorList(biases),
      std::vector<int64_t>(options.stride()->begin(), options.stride()->end()),
      std::vector<int64_t>(padding->begin(), padding->end()));
}

}  // namespace framefit::models
