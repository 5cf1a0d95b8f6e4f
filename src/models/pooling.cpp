#include "framefit/models/pooling.h"

#include <torch/torch.h>

#include <functional>
#include <numeric>

namespace framefit::models {

namespace {

std::vector<int64_t> per_dimension(const std::vector<int64_t>& field, int64_t dims,
                                   const std::vector<int64_t>& fallback) {
  if (field.empty()) return fallback;
  if (field.size() == 1) return std::vector<int64_t>(dims, field[0]);
  return field;
}

struct Window {
  std::vector<int64_t> kernel, stride, padding;
};

Window window_of(const MaxPoolOptions& options, int64_t dims) {
  Window w;
  w.kernel = per_dimension(options.kernel(), dims, {});
  TORCH_CHECK(static_cast<int64_t>(w.kernel.size()) == dims, "max_pool: kernel has ",
              options.kernel().size(), " values for ", dims,
              " spatial dimensions; give one value or one per dimension");
  w.stride = per_dimension(options.stride(), dims, w.kernel);
  w.padding = per_dimension(options.padding(), dims, std::vector<int64_t>(dims, 0));
  TORCH_CHECK(w.stride.size() == w.kernel.size() && w.padding.size() == w.kernel.size(),
              "max_pool: stride and padding take one value or one per spatial dimension (", dims,
              ")");
  return w;
}

// LibTorch 1.13's CPU kernel of 3d max pooling has no bfloat16 or half: such inputs pool in
// float32, which picks the same maxima (the conversion is exact both ways).
bool pools_in_float32(const torch::Tensor& x, const Window& w) {
  return w.kernel.size() == 3 && x.device().is_cpu() &&
         (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf);
}

std::tuple<torch::Tensor, torch::Tensor> pool_with_indices(const torch::Tensor& x,
                                                           const Window& w) {
  if (pools_in_float32(x, w)) {
    auto [y, indices] =
        at::max_pool3d_with_indices(x.to(torch::kFloat32), w.kernel, w.stride, w.padding);
    return {y.to(x.scalar_type()), indices};
  }
  if (w.kernel.size() == 3) return at::max_pool3d_with_indices(x, w.kernel, w.stride, w.padding);
  return at::max_pool2d_with_indices(x, w.kernel, w.stride, w.padding);
}

// Forward keeps the indices (int64, one per output) and, with relu_first, the pooled output;
// backward scatters the output gradient into the argmax positions, summing where windows
// overlap - what PyTorch's max pooling backward computes, without its input.
class LeanMaxPoolFunction : public torch::autograd::Function<LeanMaxPoolFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const Window& window, bool relu_first) {
    auto [y, indices] = pool_with_indices(x, window);
    if (relu_first) y.relu_();
    ctx->save_for_backward({indices, relu_first ? y : torch::Tensor()});
    ctx->saved_data["input_sizes"] = x.sizes().vec();
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& indices = saved[0];
    const auto& pooled = saved[1];
    const auto sizes = ctx->saved_data["input_sizes"].toIntVector();
    auto grad = grads[0];
    if (!grad.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    if (pooled.defined()) grad = at::threshold_backward(grad, pooled, 0);
    const int64_t planes = sizes[0] * sizes[1];
    const int64_t positions =
        std::accumulate(sizes.begin() + 2, sizes.end(), int64_t{1}, std::multiplies<int64_t>());
    auto grad_input = torch::zeros({planes, positions},
                                   grad.options().memory_format(c10::MemoryFormat::Contiguous));
    grad_input.scatter_add_(1, indices.reshape({planes, -1}), grad.reshape({planes, -1}));
    return {grad_input.view(sizes), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor max_pool(const torch::Tensor& x, const MaxPoolOptions& options, bool relu_first) {
  const int64_t dims = x.dim() - 2;
  TORCH_CHECK(dims == 2 || dims == 3, "max_pool takes [N,C,H,W] or [N,C,T,H,W]; got ", x.sizes());
  const auto window = window_of(options, dims);
  if (!options.lean()) {
    const auto in = relu_first ? torch::relu(x) : x;
    return std::get<0>(pool_with_indices(in, window));
  }
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) {  // nothing to keep
    auto y = std::get<0>(pool_with_indices(x, window));
    return relu_first ? y.relu_() : y;
  }
  return LeanMaxPoolFunction::apply(x, window, relu_first);
}

}  // namespace framefit::models
