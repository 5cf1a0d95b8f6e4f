#include "framefit/models/norm_relu_conv.h"

#include <torch/torch.h>

#include <variant>

#include "framefit/core/runtime.h"
#include "framefit/models/resnet.h"

namespace framefit::models {

// The convolution options hold a c10::variant in LibTorch 1.13 and a std::variant from 2.x on:
// unqualified get and holds_alternative find either's by argument-dependent lookup.
using std::get;
using std::holds_alternative;

namespace {

// relu(x * scale + shift) per channel, the same operations in forward and in backward's
// recomputation, so both see the same values (the same ReLU mask).
torch::Tensor normalized_relu(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, const torch::Tensor& mean,
                              const torch::Tensor& invstd) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = x.size(1);
  const auto scale = invstd * weight;
  const auto shift = bias - mean * scale;
  return torch::addcmul(shift.view(shape), x, scale.view(shape)).relu_();
}

class NormReluConvFunction : public torch::autograd::Function<NormReluConvFunction> {
 public:
  // `stats`: the batch's mean and 1/sqrt(var + eps); with frozen statistics a third, the running
  // variance (and the first is the running mean). `conv_bias`: none or one tensor (a custom
  // function takes no undefined tensor).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& norm_weight, const torch::Tensor& norm_bias,
                               const torch::Tensor& conv_weight, at::TensorList conv_bias,
                               at::TensorList stats, double eps, std::vector<int64_t> stride,
                               std::vector<int64_t> padding, std::vector<int64_t> dilation,
                               int64_t groups, int64_t kind) {
    std::vector<torch::Tensor> saved = {x, norm_weight, norm_bias, conv_weight};
    saved.insert(saved.end(), stats.begin(), stats.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["bias"] = !conv_bias.empty();
    const auto rectified = normalized_relu(x, norm_weight, norm_bias, stats[0], stats[1]);
    return at::convolution(
        rectified, conv_weight, conv_bias.empty() ? torch::Tensor() : conv_bias[0], stride, padding,
        dilation, /*transposed=*/false, std::vector<int64_t>(stride.size(), 0), groups);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& norm_weight = saved[1];
    const auto& mean = saved[4];
    const bool batch_stats = saved.size() == 6;
    const bool has_bias = ctx->saved_data["bias"].toBool();
    const bool norm_grads =
        ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
    auto rectified = normalized_relu(x, norm_weight, saved[2], mean, saved[5]);
    auto [grad_rectified, grad_conv_weight, grad_conv_bias] = convolution_backward(
        static_cast<ConvBackward>(ctx->saved_data["kind"].toInt()), grads[0], rectified, saved[3],
        has_bias, ctx->saved_data["stride"].toIntVector(), ctx->saved_data["padding"].toIntVector(),
        ctx->saved_data["dilation"].toIntVector(), ctx->saved_data["groups"].toInt(),
        {norm_grads, ctx->needs_input_grad(3), has_bias && ctx->needs_input_grad(4)});
    torch::Tensor grad_x, grad_norm_weight, grad_norm_bias;
    if (norm_grads) {
      // ReLU's backward, in place: one pass (a mask and masked_fill_ took two and more memory).
      at::threshold_backward_out(grad_rectified, grad_rectified, rectified, 0);
      rectified = torch::Tensor();
      std::tie(grad_x, grad_norm_weight, grad_norm_bias) = at::native_batch_norm_backward(
          grad_rectified, x, norm_weight, batch_stats ? torch::Tensor() : mean,
          batch_stats ? torch::Tensor() : saved[6], batch_stats ? mean : torch::Tensor(),
          batch_stats ? saved[5] : torch::Tensor(), batch_stats, ctx->saved_data["eps"].toDouble(),
          {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
    }
    // One gradient per forward argument, the tensor lists flattened.
    torch::autograd::variable_list result = {grad_x, grad_norm_weight, grad_norm_bias,
                                             grad_conv_weight};
    if (has_bias) result.push_back(grad_conv_bias);
    result.resize(result.size() + (saved.size() - 4) + 6);  // stats; eps ... kind
    return result;
  }
};

template <size_t D>
std::vector<int64_t> to_vector(const torch::ExpandingArray<D>& values) {
  return {values->begin(), values->end()};
}

// Whether the fused sequence applies: in training with grad, x float32 or float64 outside
// autocast with parameters of its dtype, a convolution with explicit zero padding.
template <size_t D, typename Conv>
bool applies(const torch::Tensor& x, const torch::Tensor& norm_weight,
             const torch::nn::ConvNdImpl<D, Conv>& conv) {
  const auto& o = conv.options;
  return torch::GradMode::is_enabled() && x.dim() == static_cast<int64_t>(D) + 2 &&
         (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble) &&
         norm_weight.defined() && norm_weight.scalar_type() == x.scalar_type() &&
         conv.weight.scalar_type() == x.scalar_type() && !autocast_enabled(x.is_cuda()) &&
         (x.requires_grad() || norm_weight.requires_grad() || conv.weight.requires_grad()) &&
         holds_alternative<torch::ExpandingArray<D>>(o.padding()) &&
         holds_alternative<torch::enumtype::kZeros>(o.padding_mode());
}

// Normalises with the batch's statistics (updating the running ones, as BatchNorm does) or
// the running ones, then runs the fused function.
template <size_t D, typename Conv>
torch::Tensor fused(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                    const torch::Tensor& running_mean, const torch::Tensor& running_var,
                    bool batch_stats, double momentum, double eps,
                    const torch::nn::ConvNdImpl<D, Conv>& conv, ConvBackward kind) {
  std::vector<torch::Tensor> stats;
  {
    torch::NoGradGuard no_grad;
    if (batch_stats) {
      auto [mean, var] = at::batch_norm_update_stats(x, running_mean, running_var, momentum);
      stats = {mean, (var + eps).rsqrt()};
    } else {
      stats = {running_mean.clone(), (running_var + eps).rsqrt(), running_var.clone()};
    }
  }
  const auto& o = conv.options;
  std::vector<torch::Tensor> conv_bias;
  if (conv.bias.defined()) conv_bias.push_back(conv.bias);
  return NormReluConvFunction::apply(
      x, weight, bias, conv.weight, at::TensorList(conv_bias), at::TensorList(stats), eps,
      to_vector(o.stride()), to_vector(get<torch::ExpandingArray<D>>(o.padding())),
      to_vector(o.dilation()), o.groups(), static_cast<int64_t>(kind));
}

}  // namespace

int64_t set_recompute_norm(torch::nn::Module& module, bool on) {
  int64_t count = 0;
  const auto set = [&](torch::nn::Module* m) {
    if (auto* recomputing = dynamic_cast<RecomputesNorm*>(m)) {
      recomputing->recompute_norm = on;
      ++count;
    }
  };
  // Itself apart: modules() with itself needs it held by a shared_ptr (not yet, in a constructor).
  set(&module);
  for (const auto& child : module.modules(/*include_self=*/false)) set(child.get());
  return count;
}

torch::Tensor norm_relu_conv(const torch::Tensor& x, Norm2dImpl& norm,
                             torch::nn::Conv2dImpl& conv) {
  if (norm.options().kind() == NormKind::GroupNorm || !applies(x, norm.weight, conv)) {
    return conv.forward(torch::relu(norm.forward(x)));
  }
  const bool batch_stats = norm.is_training() && !norm.frozen();
  if (batch_stats) {
    torch::NoGradGuard no_grad;
    norm.num_batches_tracked.add_(1);
  }
  return fused(x, norm.weight, norm.bias, norm.running_mean, norm.running_var, batch_stats,
               norm.options().momentum(), norm.options().eps(), conv, ConvBackward::Plain);
}

torch::Tensor norm_relu_conv(const torch::Tensor& x, torch::nn::BatchNorm3dImpl& norm,
                             LeanConv3dImpl& conv) {
  const auto& o = norm.options;
  if (!o.affine() || !o.track_running_stats() || !applies(x, norm.weight, conv)) {
    return conv.forward(norm.forward(x).relu_());
  }
  // BatchNorm's forward: a momentum of None averages over all batches seen.
  double momentum = o.momentum().value_or(0.0);
  if (norm.is_training()) {
    torch::NoGradGuard no_grad;
    norm.num_batches_tracked.add_(1);
    if (!o.momentum()) momentum = 1.0 / norm.num_batches_tracked.item<double>();
  }
  return fused(x, norm.weight, norm.bias, norm.running_mean, norm.running_var, norm.is_training(),
               momentum, o.eps(), conv, conv.backward_for(x));
}

}  // namespace framefit::models
