#include "framefit/models/unet.h"

#include <torch/torch.h>

namespace framefit::models {

namespace {
torch::nn::Conv2d conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false));
}

void check_options(const UNetOptions& o) {
  TORCH_CHECK(o.in_channels() > 0 && o.classes() > 0 && o.width() > 0,
              "UNet needs positive in_channels, classes and width; got ", o.in_channels(), ", ",
              o.classes(), ", ", o.width());
  TORCH_CHECK(o.depth() >= 0 && o.depth() <= 10,
              "UNet depth (down-sampling steps) must be in "
              "[0, 10]; got ",
              o.depth(), ". The classic UNet has 4.");
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// DoubleConv and UNetUp

DoubleConvImpl::DoubleConvImpl(int64_t in_channels, int64_t out_channels,
                               const Norm2dOptions& norm) {
  auto norm_options = norm;
  norm_options.channels(out_channels);
  conv1 = register_module("conv1", conv3x3(in_channels, out_channels));
  norm1 = register_module("norm1", Norm2d(norm_options));
  conv2 = register_module("conv2", conv3x3(out_channels, out_channels));
  norm2 = register_module("norm2", Norm2d(norm_options));
}

torch::Tensor DoubleConvImpl::forward(const torch::Tensor& x) { return after_conv1(conv1(x)); }

torch::Tensor DoubleConvImpl::after_conv1(const torch::Tensor& h) {
  const auto c = recompute_norm ? norm_relu_conv(h, *norm1, *conv2) : conv2(torch::relu(norm1(h)));
  return torch::relu(norm2(c));
}

UNetUpImpl::UNetUpImpl(int64_t in_channels, int64_t skip_channels, bool bilinear,
                       const Norm2dOptions& norm) {
  int64_t concatenated = in_channels + skip_channels;
  if (!bilinear) {
    upconv = register_module(
        "upconv", torch::nn::ConvTranspose2d(
                      torch::nn::ConvTranspose2dOptions(in_channels, skip_channels, 2).stride(2)));
    concatenated = 2 * skip_channels;
  }
  conv = register_module("conv", DoubleConv(concatenated, skip_channels, norm));
}

torch::Tensor UNetUpImpl::forward(const torch::Tensor& x, const torch::Tensor& skip) {
  TORCH_CHECK(x.dim() == 4 && skip.dim() == 4 && skip.size(2) == 2 * x.size(2) &&
                  skip.size(3) == 2 * x.size(3),
              "UNet decoder stage: the skip must be [N,C,2H,2W] for x [N,C',H,W]; got x ",
              x.sizes(), " and skip ", skip.sizes());
  const auto upsampled = upconv ? upconv(x)
                                : torch::nn::functional::interpolate(
                                      x, torch::nn::functional::InterpolateFuncOptions()
                                             .size(std::vector<int64_t>{skip.size(2), skip.size(3)})
                                             .mode(torch::kBilinear)
                                             .align_corners(false));
  // conv1 over the concatenation [skip, upsampled], computed as the sum of one convolution per
  // input with conv1's weight split along its input channels: the same function, without
  // storing the concatenation, which with its gradient was the decoder stage's largest memory
  // (a full-resolution stage's backward held both). conv1 is conv3x3: stride 1, padding 1, no bias.
  const auto& weight = conv->conv1->weight;
  const int64_t skip_channels = skip.size(1);
  const auto h =
      torch::conv2d(skip, weight.narrow(1, 0, skip_channels), {}, 1, 1) +
      torch::conv2d(upsampled, weight.narrow(1, skip_channels, weight.size(1) - skip_channels), {},
                    1, 1);
  return conv->after_conv1(h);
}

// ---------------------------------------------------------------------------------------------
// UNet

UNetImpl::UNetImpl(const UNetOptions& options) : options_(options) {
  check_options(options);
  const auto norm = Norm2dOptions(options.width()).kind(options.norm()).groups(options.groups());
  int64_t channels = options.in_channels();
  for (int64_t i = 0; i <= options.depth(); ++i) {
    const int64_t width = options.width() << i;
    down.push_back(register_module("down" + std::to_string(i), DoubleConv(channels, width, norm)));
    channels = width;
  }
  for (int64_t j = 0; j < options.depth(); ++j) {
    const int64_t skip = options.width() << (options.depth() - 1 - j);
    up.push_back(register_module("up" + std::to_string(j),
                                 UNetUp(channels, skip, options.bilinear(), norm)));
    channels = skip;
  }
  out = register_module(
      "out", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, options.classes(), 1)));
}

void UNetImpl::check_input(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 4, "UNet expects a batch of images [N,", options_.in_channels(),
              ",H,W]; got a tensor of shape ", x.sizes());
  TORCH_CHECK(x.size(1) == options_.in_channels(), "UNet was built for ", options_.in_channels(),
              " input channels (dimension 1 of [N,C,H,W]); got ", x.sizes());
  TORCH_CHECK(x.is_floating_point(), "UNet expects floating-point input; got ", x.scalar_type());
  const int64_t multiple = int64_t{1} << options_.depth();
  const int64_t h = x.size(2), w = x.size(3);
  auto round_up = [&](int64_t v) {
    return std::max<int64_t>(1, (v + multiple - 1) / multiple) * multiple;
  };
  TORCH_CHECK(h > 0 && w > 0 && h % multiple == 0 && w % multiple == 0, "UNet of depth ",
              options_.depth(), " halves height and width ", options_.depth(),
              " times, so both must be multiples of ", multiple, "; got ", h, "x", w,
              ". Pad or resize to ", round_up(h), "x", round_up(w), ", or use a smaller depth.");
}

torch::Tensor UNetImpl::encoder_stage(int64_t i, const torch::Tensor& x) {
  TORCH_CHECK(0 <= i && i <= depth(), "encoder stage ", i, " outside [0, ", depth(), "]");
  return down[i](i == 0 ? x : torch::max_pool2d(x, 2));
}

torch::Tensor UNetImpl::decoder_stage(int64_t j, const torch::Tensor& x,
                                      const torch::Tensor& skip) {
  TORCH_CHECK(0 <= j && j < depth(), "decoder stage ", j, " outside [0, ", depth(), ")");
  return up[j](x, skip);
}

torch::Tensor UNetImpl::forward(const torch::Tensor& input) {
  check_input(input);
  std::vector<torch::Tensor> skips;
  auto x = input;
  for (int64_t i = 0; i < depth(); ++i) {
    x = encoder_stage(i, x);
    skips.push_back(x);
  }
  x = encoder_stage(depth(), x);
  for (int64_t j = 0; j < depth(); ++j) x = decoder_stage(j, x, skips[depth() - 1 - j]);
  return head(x);
}

// ---------------------------------------------------------------------------------------------
// Sizes without building

UNetSize unet_size(const UNetOptions& options) {
  check_options(options);
  const bool has_stats = options.norm() != NormKind::GroupNorm;
  UNetSize size;
  auto double_conv = [&](int64_t in, int64_t out) {
    size.parameters += (in * out + out * out) * 9 + 2 * 2 * out;  // two convs, two norm affines
    if (has_stats) size.buffer_elements += 2 * 2 * out, size.buffer_counters += 2;
  };
  int64_t channels = options.in_channels();
  for (int64_t i = 0; i <= options.depth(); ++i) {
    double_conv(channels, options.width() << i);
    channels = options.width() << i;
  }
  for (int64_t j = 0; j < options.depth(); ++j) {
    const int64_t skip = options.width() << (options.depth() - 1 - j);
    if (options.bilinear()) {
      double_conv(channels + skip, skip);
    } else {
      size.parameters += channels * skip * 4 + skip;  // 2x2 transposed convolution with bias
      double_conv(2 * skip, skip);
    }
    channels = skip;
  }
  size.parameters += channels * options.classes() + options.classes();  // 1x1 output conv
  size.size_multiple = int64_t{1} << options.depth();
  return size;
}

}  // namespace framefit::models
