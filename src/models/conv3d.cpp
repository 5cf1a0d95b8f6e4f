#include "framefit/models/conv3d.h"

#include <torch/torch.h>

#include <variant>

#include "framefit/core/runtime.h"

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
                               std::vector<int64_t> stride, std::vector<int64_t> padding,
                               int64_t kind) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["bias"] = !bias.empty();
    ctx->saved_data["kind"] = kind;
    return at::convolution(x, weight, bias.empty() ? torch::Tensor() : bias[0], stride, padding,
                           /*dilation=*/{1, 1, 1},
                           /*transposed=*/false, /*output_padding=*/{0, 0, 0}, /*groups=*/1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["bias"].toBool();
    auto [grad_x, grad_weight, grad_bias] = convolution_backward(
        static_cast<ConvBackward>(ctx->saved_data["kind"].toInt()), grads[0], saved[0], saved[1],
        has_bias, ctx->saved_data["stride"].toIntVector(), ctx->saved_data["padding"].toIntVector(),
        /*dilation=*/{1, 1, 1}, /*groups=*/1,
        {ctx->needs_input_grad(0), ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(2)});
    // One gradient per forward argument, the bias list flattened.
    torch::autograd::variable_list result = {grad_x, grad_weight};
    if (has_bias) result.push_back(grad_bias);
    result.insert(result.end(), {torch::Tensor(), torch::Tensor(), torch::Tensor()});
    return result;
  }
};

int64_t output_positions(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  const auto& o = conv.options;
  int64_t positions = 1;
  for (int64_t d = 0; d < 3; ++d) {
    const int64_t padding = get<torch::ExpandingArray<3>>(o.padding())->at(d);
    positions *= (x.size(2 + d) + 2 * padding - o.kernel_size()->at(d)) / o.stride()->at(d) + 1;
  }
  return positions;
}

// Whether either lean backward could take x: a CPU float32 input outside autocast whose gradient
// or the weight's is needed, a plain convolution (one group, no dilation, zero padding).
bool lean_backward_possible(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  const auto& o = conv.options;
  if (!x.defined() || x.dim() != 5 || !x.device().is_cpu() || x.scalar_type() != torch::kFloat32 ||
      autocast_enabled(/*cuda=*/false) || !torch::GradMode::is_enabled() ||
      !(x.requires_grad() || conv.weight.requires_grad()) || o.groups() != 1 ||
      !holds_alternative<torch::ExpandingArray<3>>(o.padding()) ||
      !holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
    return false;
  }
  for (int64_t d = 0; d < 3; ++d) {
    if (o.dilation()->at(d) != 1) return false;
  }
  return true;
}

// takes_lean_backward without the switch.
bool lean_backward_applies(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  return lean_backward_possible(conv, x) && output_positions(conv, x) <= kLeanBackwardMaxPositions;
}

// takes_split_backward without the switch.
bool split_backward_applies(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  return lean_backward_possible(conv, x) && output_positions(conv, x) >= kSplitBackwardMinPositions;
}

// Sets a switch (a member of LeanConv3dImpl) on every LeanConv3d in `module`; returns how many
// there are.
int64_t set_on_every_lean_conv(torch::nn::Module& module, bool LeanConv3dImpl::*flag, bool on) {
  int64_t count = 0;
  for (const auto& child : module.modules()) {
    if (auto* conv = child->as<LeanConv3dImpl>()) {
      conv->*flag = on;
      ++count;
    }
  }
  return count;
}

}  // namespace

bool takes_lean_backward(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  return conv.lean_backward && lean_backward_applies(conv, x);
}

bool takes_split_backward(const LeanConv3dImpl& conv, const torch::Tensor& x) {
  return conv.split_backward && split_backward_applies(conv, x);
}

int64_t set_lean_backward(torch::nn::Module& module, bool on) {
  return set_on_every_lean_conv(module, &LeanConv3dImpl::lean_backward, on);
}

int64_t set_split_backward(torch::nn::Module& module, bool on) {
  return set_on_every_lean_conv(module, &LeanConv3dImpl::split_backward, on);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> convolution_backward(
    ConvBackward kind, const torch::Tensor& grad, const torch::Tensor& x,
    const torch::Tensor& weight, bool has_bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> wanted) {
  const std::vector<int64_t> bias_sizes = {weight.size(0)};
  const std::vector<int64_t> output_padding(stride.size(), 0);
  const auto backward_of = [&](const torch::Tensor& g, const torch::Tensor& input,
                               std::array<bool, 3> passes) {
    return at::convolution_backward(
        g, input, weight, has_bias ? c10::OptionalIntArrayRef(bias_sizes) : c10::nullopt, stride,
        padding, dilation, /*transposed=*/false, output_padding, groups, passes);
  };
  if (kind == ConvBackward::Plain) return backward_of(grad, x, wanted);
  if (kind == ConvBackward::Lean) {
    OneDnnOff one_dnn_off;
    return backward_of(grad, x, wanted);
  }
  // Run together, oneDNN's passes hold the input's gradient and both operands reordered (three
  // input-sized buffers); one after the other, two. Over several slices the input's gradient is
  // written in place, beside a slice's result and reordered output gradient. Slices of two
  // samples (an odd batch's last of three): at one sample LibTorch may leave oneDNN for its own
  // kernel, whose columns are 27 times the input for a 3x3x3 kernel.
  torch::Tensor grad_x, grad_weight, grad_bias;
  const int64_t samples = x.size(0);
  std::vector<std::pair<int64_t, int64_t>> slices;  // start, length
  for (int64_t start = 0; start < samples; start += slices.back().second) {
    slices.emplace_back(start, samples - start <= 3 ? samples - start : 2);
  }
  for (const auto& [start, length] : slices) {
    if (!wanted[1] && !wanted[2]) break;
    auto [unused, slice_weight, slice_bias] = backward_of(
        grad.narrow(0, start, length), x.narrow(0, start, length), {false, wanted[1], wanted[2]});
    if (wanted[1]) grad_weight = start == 0 ? slice_weight : grad_weight.add_(slice_weight);
    if (wanted[2]) grad_bias = start == 0 ? slice_bias : grad_bias.add_(slice_bias);
  }
  for (const auto& [start, length] : slices) {
    if (!wanted[0]) break;
    auto slice_x = std::get<0>(backward_of(grad.narrow(0, start, length),
                                           x.narrow(0, start, length), {true, false, false}));
    if (slices.size() == 1) {
      grad_x = std::move(slice_x);  // a copy would hold the input's gradient twice
    } else {
      if (start == 0) grad_x = torch::empty_like(x);
      grad_x.narrow(0, start, length).copy_(slice_x);
    }
  }
  return {grad_x, grad_weight, grad_bias};
}

int64_t lean_applicable_calls(const torch::nn::Module& module) {
  int64_t calls = 0;
  for (const auto& child : module.modules()) {
    if (const auto* conv = child->as<LeanConv3dImpl>()) calls += conv->lean_applicable_calls;
  }
  return calls;
}

ConvBackward LeanConv3dImpl::backward_for(const torch::Tensor& x) {
  const bool columns = lean_backward_applies(*this, x);
  if (columns) ++lean_applicable_calls;
  if (columns && lean_backward) return ConvBackward::Lean;
  return takes_split_backward(*this, x) ? ConvBackward::Split : ConvBackward::Plain;
}

torch::Tensor LeanConv3dImpl::forward(const torch::Tensor& x) {
  const auto kind = backward_for(x);
  if (kind == ConvBackward::Plain) return Conv3dImpl::forward(x);
  return run(x, kind, *get<torch::ExpandingArray<3>>(options.padding()));
}

torch::Tensor LeanConv3dImpl::forward_padded(const torch::Tensor& x, at::IntArrayRef padding) {
  TORCH_CHECK(holds_alternative<torch::enumtype::kZeros>(options.padding_mode()),
              "LeanConv3d::forward_padded pads with zeros; this convolution's padding mode is not");
  const auto kind = backward_for(x);
  if (kind == ConvBackward::Plain) {
    return torch::conv3d(x, weight, bias, options.stride(), padding, options.dilation(),
                         options.groups());
  }
  return run(x, kind, padding);
}

torch::Tensor LeanConv3dImpl::run(const torch::Tensor& x, ConvBackward kind,
                                  at::IntArrayRef padding) {
  std::vector<torch::Tensor> biases;
  if (bias.defined()) biases.push_back(bias);
  return LeanConv3dFunction::apply(
      x, weight, at::TensorList(biases),
      std::vector<int64_t>(options.stride()->begin(), options.stride()->end()), padding.vec(),
      static_cast<int64_t>(kind));
}

}  // namespace framefit::models
