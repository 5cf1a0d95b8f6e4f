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

int64_t product(at::IntArrayRef v) {
  return std::accumulate(v.begin(), v.end(), int64_t{1}, std::multiplies<int64_t>());
}

// Each argmax kept as its offset within its window (0 to kernel volume - 1) in the smallest
// integer type that holds it: one byte for windows of up to 256 positions, where LibTorch keeps
// an int64 position in the input plane.
torch::ScalarType offset_type(const Window& w) {
  const int64_t volume = product(w.kernel);
  return volume <= 256 ? torch::kByte : volume <= 32768 ? torch::kShort : torch::kLong;
}

// Planes converted at a time: the int64 temporaries of a conversion stay at 2 MB each.
int64_t block_planes(int64_t positions) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, positions));
}

// The first input row of each output row's window along spatial dimension d, shaped to
// broadcast over [planes, outputs...].
torch::Tensor window_starts(const Window& w, int64_t d, int64_t outputs, torch::Device device) {
  std::vector<int64_t> shape(w.kernel.size() + 1, 1);
  shape[static_cast<size_t>(d) + 1] = outputs;
  const auto rows = torch::arange(outputs, torch::TensorOptions(torch::kLong).device(device));
  return (rows * w.stride[d] - w.padding[d]).view(shape);
}

// indices [N,C,outputs...] (positions in the input planes of spatial `in_sizes`) as offsets in
// their windows. Consumes `indices` (overwritten).
torch::Tensor window_offsets(torch::Tensor indices, const Window& w, at::IntArrayRef in_sizes) {
  const auto type = offset_type(w);
  if (type == torch::kLong) return indices;
  const auto out_sizes = indices.sizes().slice(2);
  const int64_t dims = static_cast<int64_t>(out_sizes.size());
  std::vector<int64_t> plane_shape = {-1};
  plane_shape.insert(plane_shape.end(), out_sizes.begin(), out_sizes.end());
  auto all = indices.contiguous().view(plane_shape);
  auto offsets = torch::empty(all.sizes(), indices.options().dtype(type));
  const int64_t planes = all.size(0), block = block_planes(product(out_sizes));
  for (int64_t first = 0; first < planes; first += block) {
    auto position = all.narrow(0, first, std::min(block, planes - first));
    auto offset = torch::zeros_like(position);
    int64_t below = product(in_sizes);  // input positions per step of dimension d
    for (int64_t d = 0; d < dims; ++d) {
      below /= in_sizes[d];
      auto coordinate = position.div(below, "floor");
      position.remainder_(below);
      offset.mul_(w.kernel[d])
          .add_(coordinate.sub_(window_starts(w, d, out_sizes[d], position.device())));
    }
    offsets.narrow(0, first, position.size(0)).copy_(offset);
  }
  return offsets.view(indices.sizes());
}

// Forward keeps each argmax as its offset in its window (window_offsets) and, with relu_first,
// the ReLU's mask as one byte per output; backward scatters the output gradient into the argmax
// positions, summing where windows overlap - what PyTorch's max pooling backward computes,
// without its input. The pooled output itself is not kept: the next layer may keep it (a
// convolution's input) or not (global pooling, or a slice concatenated with others).
class LeanMaxPoolFunction : public torch::autograd::Function<LeanMaxPoolFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const Window& window, bool relu_first) {
    auto [y, indices] = pool_with_indices(x, window);
    if (relu_first) y.relu_();
    const auto in_sizes = x.sizes().slice(2);
    ctx->save_for_backward({window_offsets(std::move(indices), window, in_sizes),
                            relu_first ? y.gt(0) : torch::Tensor()});
    ctx->saved_data["input_sizes"] = x.sizes().vec();
    ctx->saved_data["kernel"] = window.kernel;
    ctx->saved_data["stride"] = window.stride;
    ctx->saved_data["padding"] = window.padding;
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& offsets = saved[0];
    const auto& mask = saved[1];
    const auto sizes = ctx->saved_data["input_sizes"].toIntVector();
    Window w;
    w.kernel = ctx->saved_data["kernel"].toIntVector();
    w.stride = ctx->saved_data["stride"].toIntVector();
    w.padding = ctx->saved_data["padding"].toIntVector();
    auto grad = grads[0];
    if (!grad.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    if (mask.defined()) grad = grad * mask;
    const auto in_sizes = at::IntArrayRef(sizes).slice(2);
    const auto out_sizes = offsets.sizes().slice(2);
    const int64_t dims = static_cast<int64_t>(out_sizes.size());
    const int64_t planes = sizes[0] * sizes[1];
    auto grad_input = torch::zeros({planes, product(in_sizes)},
                                   grad.options().memory_format(c10::MemoryFormat::Contiguous));
    std::vector<int64_t> plane_shape = {planes};
    plane_shape.insert(plane_shape.end(), out_sizes.begin(), out_sizes.end());
    const auto all_offsets = offsets.reshape(plane_shape);
    const auto all_grads = grad.reshape({planes, -1});
    const int64_t block = block_planes(product(out_sizes));
    for (int64_t first = 0; first < planes; first += block) {
      const int64_t count = std::min(block, planes - first);
      auto offset = all_offsets.narrow(0, first, count).to(torch::kLong);
      torch::Tensor position;  // in the input plane
      if (offsets.scalar_type() == torch::kLong) {
        position = std::move(offset);
      } else {
        position = torch::zeros_like(offset);
        int64_t inside = product(w.kernel);  // window positions per step of dimension d
        int64_t below = product(in_sizes);   // input positions per step of dimension d
        for (int64_t d = 0; d < dims; ++d) {
          inside /= w.kernel[d];
          below /= in_sizes[d];
          auto coordinate = offset.div(inside, "floor");
          offset.remainder_(inside);
          position.add_(
              coordinate.add_(window_starts(w, d, out_sizes[d], offset.device())).mul_(below));
        }
      }
      grad_input.narrow(0, first, count)
          .scatter_add_(1, position.reshape({count, -1}), all_grads.narrow(0, first, count));
    }
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
