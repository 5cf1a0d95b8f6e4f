#include "framefit/models/network.h"

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>

#include "framefit/models/conv3d.h"
#include "framefit/models/pooling.h"

namespace framefit::models {

const std::vector<std::string>& layer_types() {
  static const std::vector<std::string> types = {
      "conv2d",  "conv3d",  "sepconv2d",      "sepconv3d", "bn",     "gn",     "relu",
      "maxpool", "avgpool", "global_avgpool", "flatten",   "linear", "dropout"};
  return types;
}

std::string format_count(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? " x " : "") + std::to_string(shape[i]);
  return out;
}

int64_t NetworkShapes::parameters() const {
  int64_t n = 0;
  for (const auto& l : layers) n += l.parameters;
  return n;
}

int64_t NetworkShapes::buffers() const {
  int64_t n = 0;
  for (const auto& l : layers) n += l.buffers;
  return n;
}

namespace {

int64_t product(const std::vector<int64_t>& v, size_t from = 0) {
  return std::accumulate(v.begin() + static_cast<std::ptrdiff_t>(from), v.end(), int64_t{1},
                         std::multiplies<int64_t>());
}

bool is_conv(const std::string& t) { return t == "conv2d" || t == "conv3d"; }
bool is_sepconv(const std::string& t) { return t == "sepconv2d" || t == "sepconv3d"; }
bool is_pool(const std::string& t) { return t == "maxpool" || t == "avgpool"; }
int64_t conv_dims(const std::string& t) { return t[t.size() - 2] == '3' ? 3 : 2; }  // "..3d"

// A spatial field with one value for every dimension or one per dimension.
std::vector<int64_t> expand(const std::vector<int64_t>& field, int64_t dims, int64_t fallback,
                            const std::string& layer, const char* what) {
  // A stride of 0 would divide by zero in the shape inference below.
  const int64_t minimum = std::string(what) == "padding" ? 0 : 1;
  for (const int64_t v : field) {
    TORCH_CHECK(v >= minimum, "layer ", layer, ": ", what, " must be at least ", minimum, ", got [",
                c10::Join(", ", field), "]");
  }
  if (field.empty()) return std::vector<int64_t>(dims, fallback);
  if (field.size() == 1) return std::vector<int64_t>(dims, field[0]);
  TORCH_CHECK(static_cast<int64_t>(field.size()) == dims, "layer ", layer, ": ", what, " has ",
              field.size(), " values for ", dims, " spatial dimensions; give one value or ", dims);
  return field;
}

std::string layer_name(const LayerSpec& spec, size_t index) {
  return spec.name.empty() ? spec.type + std::to_string(index) : spec.name;
}

// Output size of a sliding window, PyTorch's floor rule (0 where the window does not fit once:
// C++ division truncates a negative span towards zero, which would give 1).
int64_t window_out(int64_t size, int64_t kernel, int64_t stride, int64_t padding) {
  const int64_t span = size + 2 * padding - kernel;
  return span < 0 ? 0 : span / stride + 1;
}

// A relu whose next layer is a lean maxpool runs with it as one (pooling.h).
bool relu_pools_next(const std::vector<LayerSpec>& layers, size_t i, bool lean_pooling) {
  return lean_pooling && layers[i].type == "relu" && i + 1 < layers.size() &&
         layers[i + 1].type == "maxpool";
}

// oneDNN's blocked layouts hold channels in groups of 16: `elements` of a `channels`-channel
// tensor, padded.
int64_t blocked(int64_t elements, int64_t channels) {
  return channels <= 0 ? elements : elements / channels * ((channels + 15) / 16 * 16);
}

// A convolution's backward (LibTorch 1.13 on the CPU, oneDNN): the output gradient flowing in,
// its reordered copy, the input reordered (from 16 channels on; a first layer's 3 channels are
// read as they are) and the input's gradient, computed in the blocked layout.
int64_t conv_backward_elements(int64_t in, int64_t in_channels, int64_t out, int64_t out_channels,
                               bool input_gradient) {
  return out + blocked(out, out_channels) + (in_channels >= 16 ? blocked(in, in_channels) : 0) +
         (input_gradient ? blocked(in, in_channels) : 0);
}

// Elements layer i's backward holds at once, per sample (LayerShape::backward_elements), as
// measured on LibTorch 1.13's CPU kernels: a depthwise-separable convolution holds its pointwise
// part's and then its depthwise part's; BatchNorm's input gradient takes a temporary of its size;
// the other layers hold their output's gradient and produce their input's. `trains_before`: an
// earlier layer has parameters, so the input needs a gradient.
int64_t backward_elements(const std::vector<LayerSpec>& layers, size_t i, bool lean_pooling,
                          const std::vector<int64_t>& in_shape,
                          const std::vector<int64_t>& out_shape, int64_t depthwise_out,
                          bool trains_before) {
  const auto& type = layers[i].type;
  // A view; a ReLU whose backward is the lean pool's after it.
  if (type == "flatten" || relu_pools_next(layers, i, lean_pooling)) return 0;
  const int64_t in = product(in_shape), out = product(out_shape);
  const int64_t in_gradient = trains_before ? in : 0;
  if (is_sepconv(type)) {
    // Below 16 channels the pointwise part also holds a plain copy of the depthwise output.
    const int64_t pointwise =
        conv_backward_elements(depthwise_out, in_shape[0], out, out_shape[0], true) +
        (in_shape[0] < 16 ? depthwise_out : 0);
    const int64_t depthwise =
        conv_backward_elements(in, in_shape[0], depthwise_out, in_shape[0], trains_before);
    return std::max(pointwise, depthwise);
  }
  if (is_conv(type)) {
    return conv_backward_elements(in, in_shape[0], out, out_shape[0], trains_before);
  }
  if (type == "bn") return out + 2 * in_gradient;
  return out + in_gradient;
}

}  // namespace

NetworkShapes infer_shapes(const std::vector<LayerSpec>& layers, const std::vector<int64_t>& input,
                           bool lean_pooling) {
  NetworkShapes result;
  TORCH_CHECK(input.size() >= 1 && input.size() <= 4,
              "the network input must be given per sample as [C,H,W] or [C,T,H,W]; got ",
              input.size(), " dimensions");
  for (int64_t d : input)
    TORCH_CHECK(d > 0, "the network input ", format_shape(input), " has an empty dimension");
  std::set<std::string> names;
  std::vector<int64_t> shape = input;
  std::vector<int64_t> before_flatten;  // named in a Linear mismatch: what was flattened
  // Whether the current activation is already kept for backward by an earlier layer (a ReLU
  // keeps its output, which the next pool or conv keeps again as its input: one tensor).
  bool kept = false;
  // Whether an earlier layer has parameters, so that the current activation needs a gradient.
  bool trains_before = false;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& spec = layers[i];
    const std::vector<int64_t> in_shape = shape;
    int64_t depthwise_elements = 0;  // a depthwise-separable convolution's intermediate
    LayerShape out;
    out.name = layer_name(spec, i);
    out.type = spec.type;
    const auto fail = [&](std::string problem, std::string fix) {
      result.problems.push_back({out.name, std::move(problem), std::move(fix)});
    };
    TORCH_CHECK(
        std::find(layer_types().begin(), layer_types().end(), spec.type) != layer_types().end(),
        "layer ", out.name, ": unknown type \"", spec.type,
        "\"; known types: ", c10::Join(", ", layer_types()));
    TORCH_CHECK(names.insert(out.name).second, "two layers are named \"", out.name,
                "\"; give each a unique name");
    const int64_t spatial = static_cast<int64_t>(shape.size()) - 1;  // dims after channels
    const int64_t channels = shape[0];
    const auto spatial_rank_check = [&](int64_t want) {
      if (spatial == want) return true;
      fail(c10::str(spec.type, " needs a [C,", want == 3 ? "T," : "", "H,W] input but gets ",
                    format_shape(shape)),
           spatial == 0
               ? "move the layer before flatten"
               : c10::str("use the ", spatial == 3 ? "3d" : "2d", " variant of the layer"));
      return false;
    };
    if (is_conv(spec.type) || is_sepconv(spec.type)) {
      const int64_t dims = conv_dims(spec.type);
      if (!spatial_rank_check(dims)) break;
      TORCH_CHECK(spec.out > 0, "layer ", out.name, ": set `out`, the number of output channels");
      if (spec.in > 0 && spec.in != channels) {
        fail(c10::str("expects ", spec.in, " input channels but its input has ", channels, " (",
                      format_shape(shape), ")"),
             c10::str("set in: ", channels, " or leave `in` out to infer it"));
        break;
      }
      const auto k = expand(spec.kernel, dims, 3, out.name, "kernel");
      const auto s = expand(spec.stride, dims, 1, out.name, "stride");
      const auto p = expand(spec.padding, dims, 0, out.name, "padding");
      const int64_t groups = is_sepconv(spec.type) ? 1 : std::max<int64_t>(spec.groups, 1);
      if (channels % groups != 0 || spec.out % groups != 0) {
        fail(c10::str(groups, " groups do not divide ", channels, " input and ", spec.out,
                      " output channels"),
             "choose groups that divide both");
        break;
      }
      std::vector<int64_t> next = {spec.out};
      bool fits = true;
      for (int64_t d = 0; d < dims; ++d) {
        const int64_t o = window_out(shape[d + 1], k[d], s[d], p[d]);
        fits = fits && o >= 1;
        next.push_back(o);
      }
      if (!fits) {
        fail(c10::str("kernel ", format_shape(k), " does not fit its input ", format_shape(shape),
                      " (padding ", format_shape(p), ")"),
             "use larger inputs, more padding, or fewer downsampling layers before it");
        break;
      }
      const int64_t kvol = product(k);
      out.saved_elements = kept ? 0 : product(shape);  // the convolution keeps its input
      if (is_conv(spec.type)) {
        const int64_t weight = spec.out * (channels / groups) * kvol;
        out.parameters = weight + (spec.bias ? spec.out : 0);
        out.largest_parameter = weight;
        out.largest_parameter_name = out.name + ".weight";
      } else {
        // The pointwise conv also keeps its input: the depthwise output.
        std::vector<int64_t> depthwise_out = next;
        depthwise_out[0] = channels;
        out.saved_elements += product(depthwise_out);
        depthwise_elements = product(depthwise_out);
        const int64_t depthwise = channels * kvol, pointwise = spec.out * channels;
        out.parameters = depthwise + pointwise + (spec.bias ? channels + spec.out : 0);
        out.largest_parameter = std::max(depthwise, pointwise);
        out.largest_parameter_name =
            out.name + (pointwise >= depthwise ? ".pointwise.weight" : ".depthwise.weight");
      }
      shape = next;
    } else if (spec.type == "bn" || spec.type == "gn") {
      if (spatial < 1) {
        fail(c10::str(spec.type, " needs a [C,...] feature map but gets ", format_shape(shape)),
             "move it before flatten");
        break;
      }
      if (spec.type == "gn" && (spec.groups <= 0 || channels % spec.groups != 0)) {
        fail(c10::str("GroupNorm with ", spec.groups, " groups cannot split ", channels,
                      " channels"),
             "choose a group count that divides the channels");
        break;
      }
      out.parameters = 2 * channels;
      out.largest_parameter = channels;
      out.largest_parameter_name = out.name + ".weight";
      out.buffers = spec.type == "bn" ? 2 * channels : 0;
      out.saved_elements = kept ? 0 : product(shape);
    } else if (spec.type == "relu") {
      // relu's gradient needs its output; before a lean maxpool, the pool keeps the pooled one.
      out.saved_elements = relu_pools_next(layers, i, lean_pooling) ? 0 : product(shape);
    } else if (spec.type == "dropout") {
      if (!(spec.p >= 0 && spec.p <= 1)) {
        fail(c10::str("dropout probability ", spec.p, " is not in [0, 1]"),
             "set p to the fraction of activations to drop, e.g. 0.5");
        break;
      }
      out.saved_elements = product(shape);  // the mask, in the activations' dtype
    } else if (is_pool(spec.type)) {
      if (spatial != 2 && spatial != 3) {
        fail(c10::str(spec.type, " needs a [C,H,W] or [C,T,H,W] input but gets ",
                      format_shape(shape)),
             "move it before flatten");
        break;
      }
      const auto k = expand(spec.kernel, spatial, 2, out.name, "kernel");
      const auto s = spec.stride.empty() ? k : expand(spec.stride, spatial, 1, out.name, "stride");
      const auto p = expand(spec.padding, spatial, 0, out.name, "padding");
      bool padding_ok = true;
      for (int64_t d = 0; d < spatial; ++d) padding_ok = padding_ok && 2 * p[d] <= k[d];
      if (!padding_ok) {
        fail(c10::str("padding ", format_shape(p), " is more than half its window ",
                      format_shape(k), " (PyTorch's pooling rejects it)"),
             "use a padding of at most half the window in each dimension");
        break;
      }
      std::vector<int64_t> next = {channels};
      bool fits = true;
      for (int64_t d = 0; d < spatial; ++d) {
        const int64_t o = window_out(shape[d + 1], k[d], s[d], p[d]);
        fits = fits && o >= 1;
        next.push_back(o);
      }
      if (!fits) {
        fail(c10::str("window ", format_shape(k), " does not fit its input ", format_shape(shape)),
             "use larger inputs or fewer downsampling layers before it");
        break;
      }
      if (spec.type == "maxpool") {
        // PyTorch's keeps int64 indices and its input; the lean one each argmax's offset in its
        // window (a byte up to 256 positions, pooling.h) and a byte of ReLU's mask.
        const int64_t offset_bytes = max_pool_offset_bytes(k);
        const bool after_relu = i > 0 && relu_pools_next(layers, i - 1, lean_pooling);
        out.saved_index_bytes =
            product(next) * (lean_pooling ? offset_bytes + (after_relu ? 1 : 0) : 8);
        out.saved_elements = !lean_pooling && !kept ? product(shape) : 0;
      } else {
        out.saved_elements = kept ? 0 : product(shape);
      }
      shape = next;
    } else if (spec.type == "global_avgpool") {
      if (spatial < 1) {
        fail(c10::str("global_avgpool needs a [C,...] feature map but gets ", format_shape(shape)),
             "move it before flatten");
        break;
      }
      std::fill(shape.begin() + 1, shape.end(), 1);
    } else if (spec.type == "flatten") {
      before_flatten = shape;
      shape = {product(shape)};
    } else if (spec.type == "linear") {
      TORCH_CHECK(spec.out > 0, "layer ", out.name, ": set `out`, the number of output features");
      if (shape.size() != 1) {
        fail(c10::str("Linear gets a ", format_shape(shape), " feature map, not a vector"),
             "add a flatten layer (or global_avgpool then flatten) before it");
        break;
      }
      int64_t in = shape[0];
      if (spec.in > 0 && spec.in != shape[0]) {
        std::string fix = c10::str("set in_features to ", format_count(shape[0]));
        if (before_flatten.size() > 1) {
          fix += ", or put global_avgpool before flatten (then in_features is the channel count)";
        }
        result.problems.push_back(
            {out.name,
             c10::str("Linear expects ", format_count(spec.in),
                      " input features but the flattened input has ", format_count(shape[0]),
                      before_flatten.empty() ? "" : " (" + format_shape(before_flatten) + ")"),
             fix, spec.in, shape[0]});
        in = spec.in;  // carry on as written: the author's code allocates this size
      }
      out.parameters = in * spec.out + (spec.bias ? spec.out : 0);
      out.largest_parameter = in * spec.out;
      out.largest_parameter_name = out.name + ".weight";
      out.saved_elements = kept ? 0 : in;
      shape = {spec.out};
    }
    out.output = shape;
    out.backward_elements = backward_elements(layers, i, lean_pooling, in_shape, shape,
                                              depthwise_elements, trains_before);
    trains_before = trains_before || out.parameters > 0;
    if (spec.type == "relu") {
      kept = true;
    } else if (spec.type != "flatten") {
      kept = false;  // a new tensor (flatten is a view of the same one)
    }
    result.layers.push_back(out);
  }
  if (result.problems.empty()) result.output = shape;
  return result;
}

namespace {

class SeparableConvImpl : public torch::nn::Module {
 public:
  SeparableConvImpl(int64_t dims, int64_t in, int64_t out, std::vector<int64_t> kernel,
                    std::vector<int64_t> stride, std::vector<int64_t> padding, bool bias) {
    if (dims == 3) {
      depthwise3 = register_module(
          "depthwise",
          torch::nn::Conv3d(torch::nn::Conv3dOptions(in, in, torch::IntArrayRef(kernel))
                                .stride(torch::IntArrayRef(stride))
                                .padding(torch::IntArrayRef(padding))
                                .groups(in)
                                .bias(bias)));
      pointwise3 = register_module(
          "pointwise", torch::nn::Conv3d(torch::nn::Conv3dOptions(in, out, 1).bias(bias)));
    } else {
      depthwise2 = register_module(
          "depthwise",
          torch::nn::Conv2d(torch::nn::Conv2dOptions(in, in, torch::IntArrayRef(kernel))
                                .stride(torch::IntArrayRef(stride))
                                .padding(torch::IntArrayRef(padding))
                                .groups(in)
                                .bias(bias)));
      pointwise2 = register_module(
          "pointwise", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).bias(bias)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return depthwise3 ? pointwise3(depthwise3(x)) : pointwise2(depthwise2(x));
  }
  // forward(x) with the depthwise part padded by `padding` instead of its own.
  torch::Tensor forward_padded(const torch::Tensor& x, at::IntArrayRef padding) {
    if (depthwise3) {
      const auto& o = depthwise3->options;
      return pointwise3(torch::conv3d(x, depthwise3->weight, depthwise3->bias, o.stride(), padding,
                                      o.dilation(), o.groups()));
    }
    const auto& o = depthwise2->options;
    return pointwise2(torch::conv2d(x, depthwise2->weight, depthwise2->bias, o.stride(), padding,
                                    o.dilation(), o.groups()));
  }

 private:
  torch::nn::Conv3d depthwise3{nullptr}, pointwise3{nullptr};
  torch::nn::Conv2d depthwise2{nullptr}, pointwise2{nullptr};
};
TORCH_MODULE(SeparableConv);

// GroupNorm (same parameters and names) that takes bf16/fp16 activations under autocast:
// LibTorch 1.13's kernels need the input in the parameters' dtype, so a low-precision input is
// normalised as a float32 copy (which backward keeps) and the result cast back.
class MixedGroupNormImpl : public torch::nn::GroupNormImpl {
 public:
  using GroupNormImpl::GroupNormImpl;
  torch::Tensor forward(const torch::Tensor& x) {
    if (!options.affine() || x.scalar_type() == weight.scalar_type()) {
      return GroupNormImpl::forward(x);
    }
    return GroupNormImpl::forward(x.to(weight.scalar_type())).to(x.scalar_type());
  }
};
TORCH_MODULE(MixedGroupNorm);

// Global average pooling that keeps the rank: [N,C,...] -> [N,C,1,...,1].
class GlobalAvgPoolImpl : public torch::nn::Module {
 public:
  torch::Tensor forward(const torch::Tensor& x) {
    std::vector<int64_t> dims;
    for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    return x.mean(dims, /*keepdim=*/true);
  }
};
TORCH_MODULE(GlobalAvgPool);

torch::nn::AnyModule build_layer(const LayerSpec& spec, const std::vector<int64_t>& in_shape,
                                 const std::string& name, bool lean_backward, bool lean_pooling) {
  const int64_t channels = in_shape[0];
  const int64_t spatial = static_cast<int64_t>(in_shape.size()) - 1;
  const auto& t = spec.type;
  if (is_conv(t) || is_sepconv(t)) {
    const int64_t dims = conv_dims(t);
    const auto k = expand(spec.kernel, dims, 3, name, "kernel");
    const auto s = expand(spec.stride, dims, 1, name, "stride");
    const auto p = expand(spec.padding, dims, 0, name, "padding");
    if (is_sepconv(t))
      return torch::nn::AnyModule(SeparableConv(dims, channels, spec.out, k, s, p, spec.bias));
    const int64_t groups = std::max<int64_t>(spec.groups, 1);
    if (dims == 3) {
      const auto options = torch::nn::Conv3dOptions(channels, spec.out, torch::IntArrayRef(k))
                               .stride(torch::IntArrayRef(s))
                               .padding(torch::IntArrayRef(p))
                               .groups(groups)
                               .bias(spec.bias);
      if (groups > 1) return torch::nn::AnyModule(torch::nn::Conv3d(options));
      LeanConv3d conv(options);
      conv->lean_backward = lean_backward;
      return torch::nn::AnyModule(conv);
    }
    return torch::nn::AnyModule(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, spec.out, torch::IntArrayRef(k))
                              .stride(torch::IntArrayRef(s))
                              .padding(torch::IntArrayRef(p))
                              .groups(groups)
                              .bias(spec.bias)));
  }
  if (t == "bn") {
    if (spatial == 3) return torch::nn::AnyModule(torch::nn::BatchNorm3d(channels));
    if (spatial == 2) return torch::nn::AnyModule(torch::nn::BatchNorm2d(channels));
    return torch::nn::AnyModule(torch::nn::BatchNorm1d(channels));
  }
  if (t == "gn") return torch::nn::AnyModule(MixedGroupNorm(spec.groups, channels));
  if (t == "relu") return torch::nn::AnyModule(torch::nn::ReLU());
  if (t == "dropout") return torch::nn::AnyModule(torch::nn::Dropout(spec.p));
  if (t == "flatten") return torch::nn::AnyModule(torch::nn::Flatten());
  if (t == "global_avgpool") return torch::nn::AnyModule(GlobalAvgPool());
  if (t == "linear") {
    return torch::nn::AnyModule(
        torch::nn::Linear(torch::nn::LinearOptions(in_shape[0], spec.out).bias(spec.bias)));
  }
  // Pools: 2d or 3d from the input's rank.
  const auto k = expand(spec.kernel, spatial, 2, name, "kernel");
  const auto s = spec.stride.empty() ? k : expand(spec.stride, spatial, 1, name, "stride");
  const auto p = expand(spec.padding, spatial, 0, name, "padding");
  if (t == "maxpool") {
    return torch::nn::AnyModule(MaxPool(MaxPoolOptions(k).stride(s).padding(p).lean(lean_pooling)));
  }
  if (spatial == 3) {
    return torch::nn::AnyModule(
        torch::nn::AvgPool3d(torch::nn::AvgPool3dOptions(torch::IntArrayRef(k))
                                 .stride(torch::IntArrayRef(s))
                                 .padding(torch::IntArrayRef(p))));
  }
  return torch::nn::AnyModule(
      torch::nn::AvgPool2d(torch::nn::AvgPool2dOptions(torch::IntArrayRef(k))
                               .stride(torch::IntArrayRef(s))
                               .padding(torch::IntArrayRef(p))));
}

}  // namespace

NetworkImpl::NetworkImpl(const NetworkOptions& options)
    : options_(options),
      shapes_(infer_shapes(options.layers(), options.input(), options.lean_pooling())) {
  if (!shapes_.ok()) {
    std::string problems;
    for (const auto& p : shapes_.problems) {
      problems += c10::str("\n  ", p.layer, ": ", p.problem, " (fix: ", p.fix, ")");
    }
    TORCH_CHECK(false, "the network does not fit its input ", format_shape(options.input()), ":",
                problems);
  }
  std::vector<int64_t> shape = options.input();
  for (size_t i = 0; i < options.layers().size(); ++i) {
    const auto& name = shapes_.layers[i].name;
    auto layer = build_layer(options.layers()[i], shape, name, options.lean_backward(),
                             options.lean_pooling());
    register_module(name, layer.ptr());
    layers_.push_back(std::move(layer));
    shape = shapes_.layers[i].output;
  }
}

namespace {

// A layer's window along the first spatial dimension: the rows of its input an output row
// reads (a ReLU: its own).
struct RowWindow {
  int64_t kernel = 1, stride = 1, padding = 0;
};

// Layer i's window, its spatial rank from the tensor it reads.
RowWindow row_window(const NetworkOptions& options, const NetworkShapes& shapes, int64_t i) {
  const auto& spec = options.layers()[static_cast<size_t>(i)];
  const auto& name = shapes.layers[i].name;
  const auto& in = i == 0 ? options.input() : shapes.layers[i - 1].output;
  const int64_t spatial = static_cast<int64_t>(in.size()) - 1;
  RowWindow w;
  if (is_conv(spec.type) || is_sepconv(spec.type)) {
    const int64_t dims = conv_dims(spec.type);
    w.kernel = expand(spec.kernel, dims, 3, name, "kernel")[0];
    w.stride = expand(spec.stride, dims, 1, name, "stride")[0];
    w.padding = expand(spec.padding, dims, 0, name, "padding")[0];
  } else if (is_pool(spec.type)) {
    w.kernel = expand(spec.kernel, spatial, 2, name, "kernel")[0];
    w.stride = spec.stride.empty() ? w.kernel : expand(spec.stride, spatial, 1, name, "stride")[0];
    w.padding = expand(spec.padding, spatial, 0, name, "padding")[0];
  }
  return w;
}

}  // namespace

void NetworkImpl::set_time_slices(int64_t slices) {
  TORCH_CHECK(slices >= 0, "time slices must be 0 (off) or more; got ", slices);
  time_slices_ = slices;
}

bool NetworkImpl::sliceable() const {
  for (int64_t i = 0; i < layer_count(); ++i) {
    if (sliced_run_end(i, layer_count()) > i) return true;
  }
  return false;
}

int64_t NetworkImpl::sliced_run_end(int64_t head, int64_t end) const {
  const auto& specs = options_.layers();
  const auto& type = specs[static_cast<size_t>(head)].type;
  if (!is_conv(type) && !is_sepconv(type)) return head;
  // Up to the last pooling layer among the ReLUs and poolings after it: a run without pooling
  // would keep its whole output anyway (a ReLU's) and add the concatenation of the slices.
  int64_t run_end = head;
  for (int64_t i = head + 1; i < end; ++i) {
    const auto& spec = specs[static_cast<size_t>(i)];
    if (spec.type == "relu") continue;
    if (!is_pool(spec.type) || row_window(options_, shapes_, i).padding != 0) {
      break;
    }
    run_end = i + 1;
  }
  if (run_end == head) return head;
  // At least two rows of output to slice.
  const auto& output = shapes_.layers[run_end - 1].output;
  return output.size() >= 2 && output[1] >= 2 ? run_end : head;
}

torch::Tensor NetworkImpl::conv_padded(int64_t index, const torch::Tensor& x,
                                       at::IntArrayRef padding) {
  const auto& module = layers_[static_cast<size_t>(index)].ptr();
  if (auto* lean = module->as<LeanConv3dImpl>()) return lean->forward_padded(x, padding);
  if (auto* sep = module->as<SeparableConvImpl>()) return sep->forward_padded(x, padding);
  if (auto* conv = module->as<torch::nn::Conv3dImpl>()) {
    const auto& o = conv->options;
    return torch::conv3d(x, conv->weight, conv->bias, o.stride(), padding, o.dilation(),
                         o.groups());
  }
  auto* conv = module->as<torch::nn::Conv2dImpl>();
  TORCH_INTERNAL_ASSERT(conv != nullptr, "layer ", index, " is not a convolution");
  const auto& o = conv->options;
  return torch::conv2d(x, conv->weight, conv->bias, o.stride(), padding, o.dilation(), o.groups());
}

torch::Tensor NetworkImpl::forward_sliced(const torch::Tensor& x, int64_t head, int64_t run_end) {
  const auto& specs = options_.layers();
  const auto conv = row_window(options_, shapes_, head);
  const auto& conv_spec = specs[static_cast<size_t>(head)];
  const auto padding = expand(conv_spec.padding, conv_dims(conv_spec.type), 0, "", "padding");
  auto inner_padding = padding;  // a slice between two others reads real rows only
  inner_padding[0] = 0;
  const int64_t in_rows = x.size(2);
  const int64_t out_rows = shapes_.layers[run_end - 1].output[1];
  const int64_t count = std::min(time_slices_, out_rows);
  std::vector<torch::Tensor> outputs;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t rows_begin = j * out_rows / count, rows_end = (j + 1) * out_rows / count;
    // The rows of the convolution's output the slice needs: walked back through the pooling.
    int64_t lo = rows_begin, hi = rows_end;
    for (int64_t i = run_end - 1; i > head; --i) {
      const auto w = row_window(options_, shapes_, i);
      lo = lo * w.stride;
      hi = (hi - 1) * w.stride + w.kernel;
    }
    // ... and of its input, its padding counted as rows before and after the input.
    const int64_t first = lo * conv.stride - conv.padding;
    const int64_t last = (hi - 1) * conv.stride - conv.padding + conv.kernel;
    torch::Tensor y;
    if (first >= 0 && last <= in_rows) {
      y = conv_padded(head, x.narrow(2, first, last - first), inner_padding);
    } else {
      // A slice at the border runs with the convolution's own padding, which is real there and
      // made-up on the side facing the next slice: the rows read from there are cut off. (A
      // padded copy of the slice would be kept by the convolution for backward.) Row r of the
      // output reads input rows from begin + r * stride - padding: the rows wanted start at
      // row `skip`, the first whose window starts at `begin` or after.
      int64_t skip = (conv.padding + conv.stride - 1) / conv.stride;
      int64_t begin = first + conv.padding - skip * conv.stride;
      if (begin < 0) {
        begin = 0;
        skip = lo;
      }
      const int64_t end = std::min(last, in_rows);
      y = conv_padded(head, x.narrow(2, begin, end - begin), padding).narrow(2, skip, hi - lo);
    }
    y = forward_unsliced(std::move(y), head + 1, run_end);
    TORCH_INTERNAL_ASSERT(y.size(2) == rows_end - rows_begin, "time slice of layer ",
                          shapes_.layers[head].name, " has ", y.size(2), " rows, not ",
                          rows_end - rows_begin);
    outputs.push_back(std::move(y));
  }
  return torch::cat(outputs, 2);
}

torch::Tensor NetworkImpl::forward_layers(torch::Tensor x, int64_t begin, int64_t end) {
  TORCH_CHECK(0 <= begin && begin <= end && end <= layer_count(), "layers [", begin, ", ", end,
              ") are outside the network's ", layer_count(), " layers");
  if (time_slices_ < 2) return forward_unsliced(std::move(x), begin, end);
  int64_t from = begin;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t run_end = sliced_run_end(i, end);
    if (run_end == i) continue;
    x = forward_sliced(forward_unsliced(std::move(x), from, i), i, run_end);
    from = run_end;
    i = run_end - 1;
  }
  return forward_unsliced(std::move(x), from, end);
}

torch::Tensor NetworkImpl::forward_unsliced(torch::Tensor x, int64_t begin, int64_t end) {
  const auto& specs = options_.layers();
  for (int64_t i = begin; i < end; ++i) {
    const auto at = static_cast<size_t>(i);
    if (relu_pools_next(specs, at, options_.lean_pooling()) && i + 1 < end) {
      // relu then maxpool as one: pool first, ReLU on the pooled output (pooling.h).
      x = max_pool(x, layers_[at + 1].get<MaxPool>()->options, /*relu_first=*/true);
      ++i;
    } else {
      x = layers_[at].forward(x);
    }
  }
  return x;
}

torch::Tensor NetworkImpl::forward(const torch::Tensor& x) {
  const auto& in = options_.input();
  const bool matches = x.dim() == static_cast<int64_t>(in.size()) + 1 &&
                       std::equal(in.begin(), in.end(), x.sizes().begin() + 1);
  TORCH_CHECK(matches, "the network was built for inputs [N, ", format_shape(in), "]; got ",
              x.sizes(), ". Rebuild it with the input shape of your data (model.input)");
  return forward_layers(x, 0, layer_count());
}

int64_t set_time_slices(torch::nn::Module& module, int64_t slices) {
  int64_t count = 0;
  const auto set = [&](torch::nn::Module& m) {
    if (auto* network = m.as<NetworkImpl>()) {
      network->set_time_slices(slices);
      count += network->sliceable() ? 1 : 0;
    }
  };
  set(module);  // apart: modules() with itself needs it held by a shared_ptr
  for (const auto& child : module.modules(/*include_self=*/false)) set(*child);
  return count;
}

std::vector<LayerSpec> clip3d_layers(int64_t classes, bool separable, bool as_written) {
  std::vector<LayerSpec> layers;
  const auto add = [&](const std::string& type, const std::string& name = "") -> LayerSpec& {
    LayerSpec l;
    l.type = type;
    l.name = name;
    layers.push_back(std::move(l));
    return layers.back();
  };
  const std::string conv = separable ? "sepconv3d" : "conv3d";
  for (int64_t block = 1; block <= 2; ++block) {
    auto& c = add(conv, "conv" + std::to_string(block));
    c.out = block == 1 ? 32 : 64;
    c.kernel = {3};
    c.padding = {1};
    add("relu");
    add("maxpool", "pool" + std::to_string(block)).kernel = {2};
  }
  if (!as_written) add("global_avgpool", "global_avg_pool");
  add("flatten");
  auto& fc1 = add("linear", "fc1");
  fc1.out = 512;
  if (as_written) fc1.in = 64 * 30 * 115 * 115;  // the author's size (the real one: 64*15*57*57)
  add("relu");
  add("linear", "fc2").out = classes;
  return layers;
}

}  // namespace framefit::models
