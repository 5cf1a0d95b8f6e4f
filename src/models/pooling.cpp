#include "framefit/models/pooling.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <limits>
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
// integer type that holds it (max_pool_offset_bytes), where LibTorch keeps an int64 position in
// the input plane.
torch::ScalarType offset_type(const Window& w) {
  const int64_t bytes = max_pool_offset_bytes(w.kernel);
  return bytes == 1 ? torch::kByte : bytes == 2 ? torch::kShort : torch::kLong;
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

// Where ReLU's backward passes the gradient: LibTorch's threshold_backward zeroes it where the
// output is <= 0, so it passes at NaN too.
torch::Tensor relu_mask(const torch::Tensor& y) { return y.le(0).logical_not_(); }

// A pooling's sizes as three spatial dimensions (2d: a first one of size 1), for the CPU loops.
struct Geometry {
  int64_t in[3], out[3], kernel[3], stride[3], padding[3];
  int64_t in_plane() const { return in[0] * in[1] * in[2]; }
  int64_t out_plane() const { return out[0] * out[1] * out[2]; }
  int64_t first(int64_t d, int64_t row) const { return row * stride[d] - padding[d]; }
};

Geometry geometry_of(const Window& w, at::IntArrayRef in_sizes, at::IntArrayRef out_sizes) {
  Geometry g{{1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}};
  const size_t skip = 3 - in_sizes.size();
  for (size_t d = 0; d < in_sizes.size(); ++d) {
    g.in[skip + d] = in_sizes[d];
    g.out[skip + d] = out_sizes[d];
    g.kernel[skip + d] = w.kernel[d];
    g.stride[skip + d] = w.stride[d];
    g.padding[skip + d] = w.padding[d];
  }
  return g;
}

// Calls visit(output index, first input position of its window) for every output of a plane, in
// order. The first position may lie outside the plane (padding); the argmax does not.
template <typename Visit>
void for_each_window(const Geometry& g, Visit&& visit) {
  const int64_t rows = g.in[1] * g.in[2];
  int64_t i = 0;
  for (int64_t ot = 0; ot < g.out[0]; ++ot) {
    const int64_t t0 = g.first(0, ot);
    for (int64_t oh = 0; oh < g.out[1]; ++oh) {
      const int64_t h0 = g.first(1, oh);
      for (int64_t ow = 0; ow < g.out[2]; ++ow, ++i) {
        const int64_t w0 = g.first(2, ow);
        visit(i, t0 * rows + h0 * g.in[2] + w0);
      }
    }
  }
}

// One input row of a row of windows: for each output column ow, its columns ow * stride - padding
// + dw (dw = 0 .. kernel - 1, those inside the row) compared in order with the running maximum
// (the first largest wins; NaN wins). Pointers that do not alias and 32-bit offsets, so that the
// compiler vectorizes the loop over outputs (4x faster than an output at a time here).
template <typename scalar_t>
void pool_row(const scalar_t* __restrict row, int64_t width, int64_t kernel, int64_t stride,
              int64_t padding, int32_t window_row, int64_t outputs, scalar_t* __restrict best,
              int32_t* __restrict best_offset) {
  for (int64_t dw = 0; dw < kernel; ++dw) {
    const int64_t first = std::max<int64_t>(0, (padding - dw + stride - 1) / stride);
    const int64_t last = std::min(outputs, (width - 1 + padding - dw) / stride + 1);
    const scalar_t* column = row + dw - padding;
    const int32_t offset = window_row + static_cast<int32_t>(dw);
    for (int64_t ow = first; ow < last; ++ow) {
      const scalar_t v = column[ow * stride];
      const bool take = v > best[ow] || v != v;
      best[ow] = take ? v : best[ow];
      best_offset[ow] = take ? offset : best_offset[ow];
    }
  }
}

// Max pooling on the CPU in one pass over the input, a row of outputs at a time (pool_row): each
// output's maximum, PyTorch's choice, and where `offsets` is given its offset in its window; with
// relu_first the maximum's ReLU and, where `mask` is given, where ReLU passes its gradient
// (relu_mask). LibTorch's kernel, an output at a time, writes int64 positions, which would then
// be converted: 5x slower on seeds/001's windows here.
template <typename scalar_t, typename Offset>
void max_pool_cpu(const scalar_t* x, scalar_t* y, Offset* offsets, bool* mask, int64_t planes,
                  const Geometry& g, bool relu_first) {
  const int64_t rows = g.in[1] * g.in[2], width = g.in[2], out_width = g.out[2];
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> best(static_cast<size_t>(out_width));
    std::vector<int32_t> best_offset(static_cast<size_t>(out_width));
    for (int64_t plane = begin; plane < end; ++plane) {
      const scalar_t* in = x + plane * g.in_plane();
      int64_t out = plane * g.out_plane();
      for (int64_t ot = 0; ot < g.out[0]; ++ot) {
        const int64_t t0 = g.first(0, ot), t_begin = std::max<int64_t>(t0, 0);
        const int64_t t_end = std::min(t0 + g.kernel[0], g.in[0]);
        for (int64_t oh = 0; oh < g.out[1]; ++oh, out += out_width) {
          const int64_t h0 = g.first(1, oh), h_begin = std::max<int64_t>(h0, 0);
          const int64_t h_end = std::min(h0 + g.kernel[1], g.in[1]);
          // Before any value is taken: -inf at the window's first position inside the input.
          const int64_t first_row = ((t_begin - t0) * g.kernel[1] + (h_begin - h0)) * g.kernel[2];
          for (int64_t ow = 0; ow < out_width; ++ow) {
            best[ow] = -std::numeric_limits<scalar_t>::infinity();
            best_offset[ow] = static_cast<int32_t>(
                first_row + std::max<int64_t>(0, g.padding[2] - ow * g.stride[2]));
          }
          for (int64_t t = t_begin; t < t_end; ++t) {
            for (int64_t h = h_begin; h < h_end; ++h) {
              const auto window_row =
                  static_cast<int32_t>(((t - t0) * g.kernel[1] + (h - h0)) * g.kernel[2]);
              pool_row(in + t * rows + h * width, width, g.kernel[2], g.stride[2], g.padding[2],
                       window_row, out_width, best.data(), best_offset.data());
            }
          }
          for (int64_t ow = 0; ow < out_width; ++ow) {
            const scalar_t v = best[ow];
            const bool passes = !(v <= 0);  // relu_mask
            if (offsets) offsets[out + ow] = static_cast<Offset>(best_offset[ow]);
            if (mask) mask[out + ow] = passes;
            y[out + ow] = relu_first && !passes ? scalar_t(0) : v;
          }
        }
      }
    }
  });
}

// Whether max_pool_cpu pools x: a floating-point CPU tensor whose windows' offsets fit a short.
bool pools_on_cpu(const torch::Tensor& x, const Window& w) {
  return x.is_cpu() && at::isFloatingType(x.scalar_type()) && offset_type(w) != torch::kLong;
}

// max_pool_cpu on x [N,C,spatial...]: the pooled output, and when `keep` the offsets and (with
// relu_first) ReLU's mask.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> pool_on_cpu(const torch::Tensor& input,
                                                                    const Window& w,
                                                                    bool relu_first, bool keep) {
  const auto x = input.contiguous();
  const auto in_sizes = x.sizes().slice(2);
  std::vector<int64_t> out_shape = {x.size(0), x.size(1)};
  for (size_t d = 0; d < in_sizes.size(); ++d) {
    out_shape.push_back((in_sizes[d] + 2 * w.padding[d] - w.kernel[d]) / w.stride[d] + 1);
    TORCH_CHECK(out_shape.back() > 0 && 2 * w.padding[d] <= w.kernel[d], "max_pool: window ",
                w.kernel[d], " with padding ", w.padding[d], " does not fit input ", x.sizes());
  }
  const auto g = geometry_of(w, in_sizes, at::IntArrayRef(out_shape).slice(2));
  const int64_t planes = x.size(0) * x.size(1);
  auto y = torch::empty(out_shape, x.options());
  torch::Tensor offsets, mask;
  if (keep) {
    offsets = torch::empty(out_shape, x.options().dtype(offset_type(w)));
    if (relu_first) mask = torch::empty(out_shape, x.options().dtype(torch::kBool));
  }
  bool* mask_data = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lean_max_pool", [&] {
    const scalar_t* from = x.data_ptr<scalar_t>();
    scalar_t* to = y.data_ptr<scalar_t>();
    if (!keep) {
      max_pool_cpu<scalar_t, uint8_t>(from, to, nullptr, nullptr, planes, g, relu_first);
    } else if (offsets.scalar_type() == torch::kByte) {
      max_pool_cpu(from, to, offsets.data_ptr<uint8_t>(), mask_data, planes, g, relu_first);
    } else {
      max_pool_cpu(from, to, offsets.data_ptr<int16_t>(), mask_data, planes, g, relu_first);
    }
  });
  return {y, offsets, mask};
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
    if (pools_on_cpu(x, window)) {
      auto [y, offsets, mask] = pool_on_cpu(x, window, relu_first, /*keep=*/true);
      ctx->save_for_backward({offsets, mask});
      save_window(ctx, x, window);
      return y;
    }
    auto [y, indices] = pool_with_indices(x, window);
    if (relu_first) y.relu_();
    const auto in_sizes = x.sizes().slice(2);
    ctx->save_for_backward({window_offsets(std::move(indices), window, in_sizes),
                            relu_first ? relu_mask(y) : torch::Tensor()});
    save_window(ctx, x, window);
    return y;
  }

  static void save_window(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                          const Window& window) {
    ctx->saved_data["input_sizes"] = x.sizes().vec();
    ctx->saved_data["kernel"] = window.kernel;
    ctx->saved_data["stride"] = window.stride;
    ctx->saved_data["padding"] = window.padding;
  }

  // backward's scatter on the CPU for byte and short offsets: each output's gradient added at
  // its window's first position plus its offset's place in the input (a table of at most
  // 32,768), where the mask (if any) is set; planes in parallel. No int64 positions made.
  template <typename Offset>
  static void scatter_cpu(const torch::Tensor& offsets, const torch::Tensor& grad,
                          const torch::Tensor& mask, torch::Tensor& grad_input, const Geometry& g) {
    std::vector<int64_t> place(static_cast<size_t>(g.kernel[0] * g.kernel[1] * g.kernel[2]));
    for (int64_t dt = 0, o = 0; dt < g.kernel[0]; ++dt) {
      for (int64_t dh = 0; dh < g.kernel[1]; ++dh) {
        for (int64_t dw = 0; dw < g.kernel[2]; ++dw, ++o) {
          place[static_cast<size_t>(o)] = (dt * g.in[1] + dh) * g.in[2] + dw;
        }
      }
    }
    const Offset* offset = offsets.data_ptr<Offset>();
    const bool* keep = mask.defined() ? mask.data_ptr<bool>() : nullptr;
    const int64_t planes = grad_input.size(0), per_plane = g.out_plane(), in_plane = g.in_plane();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, grad.scalar_type(), "lean_max_pool_backward", [&] {
          const scalar_t* from = grad.data_ptr<scalar_t>();
          scalar_t* to = grad_input.data_ptr<scalar_t>();
          at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
            for (int64_t plane = begin; plane < end; ++plane) {
              const int64_t out = plane * per_plane;
              scalar_t* in = to + plane * in_plane;
              for_each_window(g, [&](int64_t i, int64_t first) {
                if (keep && !keep[out + i]) return;
                in[first + place[static_cast<size_t>(offset[out + i])]] += from[out + i];
              });
            }
          });
        });
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
    const auto in_sizes = at::IntArrayRef(sizes).slice(2);
    const auto out_sizes = offsets.sizes().slice(2);
    const int64_t dims = static_cast<int64_t>(out_sizes.size());
    const int64_t planes = sizes[0] * sizes[1];
    auto grad_input = torch::zeros({planes, product(in_sizes)},
                                   grad.options().memory_format(c10::MemoryFormat::Contiguous));
    if (grad.is_cpu() && offsets.scalar_type() != torch::kLong) {
      const auto g = geometry_of(w, in_sizes, out_sizes);
      const auto grad_c = grad.contiguous(), offsets_c = offsets.contiguous();
      const auto mask_c = mask.defined() ? mask.contiguous() : mask;
      if (offsets.scalar_type() == torch::kByte) {
        scatter_cpu<uint8_t>(offsets_c, grad_c, mask_c, grad_input, g);
      } else {
        scatter_cpu<int16_t>(offsets_c, grad_c, mask_c, grad_input, g);
      }
      return {grad_input.view(sizes), torch::Tensor(), torch::Tensor()};
    }
    if (mask.defined()) grad = grad * mask;
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

int64_t max_pool_offset_bytes(at::IntArrayRef kernel) {
  const int64_t volume = product(kernel);
  return volume <= 256 ? 1 : volume <= 32768 ? 2 : 8;
}

torch::Tensor max_pool(const torch::Tensor& x, const MaxPoolOptions& options, bool relu_first) {
  const int64_t dims = x.dim() - 2;
  TORCH_CHECK(dims == 2 || dims == 3, "max_pool takes [N,C,H,W] or [N,C,T,H,W]; got ", x.sizes());
  const auto window = window_of(options, dims);
  if (!options.lean()) {
    const auto in = relu_first ? torch::relu(x) : x;
    return std::get<0>(pool_with_indices(in, window));
  }
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) {  // nothing to keep
    if (pools_on_cpu(x, window)) return std::get<0>(pool_on_cpu(x, window, relu_first, false));
    auto y = std::get<0>(pool_with_indices(x, window));
    return relu_first ? y.relu_() : y;
  }
  return LeanMaxPoolFunction::apply(x, window, relu_first);
}

}  // namespace framefit::models
