#include "framefit/models/video_resnet.h"

#include <torch/torch.h>

#include "framefit/models/conv3d.h"

namespace framefit::models {

VideoArch parse_video_arch(const std::string& name) {
  if (name == "r3d_18") return VideoArch::R3D_18;
  if (name == "r2plus1d_18") return VideoArch::R2Plus1D_18;
  TORCH_CHECK(false, "unknown video model '", name, "': use r3d_18 or r2plus1d_18");
}

std::string to_string(VideoArch arch) {
  switch (arch) {
    case VideoArch::R3D_18: return "r3d_18";
    case VideoArch::R2Plus1D_18: return "r2plus1d_18";
  }
  return "?";
}

namespace {
using torch::nn::BatchNorm3d;
using torch::nn::Conv3dOptions;
using torch::nn::ReLU;
using torch::nn::ReLUOptions;

// In-place like torchvision's ReLU(inplace=True): it follows a BatchNorm, whose backward does
// not need its output, so this saves one activation per block.
ReLU make_relu() { return ReLU(ReLUOptions(/*inplace=*/true)); }

// torchvision's midplanes: the (2+1)D factorisation keeps about the 3x3x3 convolution's
// parameter count. Both convolutions of a block use the value from its input/output widths.
int64_t mid_channels(int64_t in_channels, int64_t channels) {
  return (in_channels * channels * 3 * 3 * 3) / (in_channels * 3 * 3 + 3 * channels);
}

LeanConv3d conv3x3x3(int64_t in, int64_t out, int64_t stride) {
  return LeanConv3d(Conv3dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

// Conv3DSimple or Conv2Plus1D, as torchvision's conv_builder.
torch::nn::AnyModule conv_builder(VideoArch arch, int64_t in, int64_t out, int64_t mid,
                                  int64_t stride) {
  if (arch == VideoArch::R3D_18) return torch::nn::AnyModule(conv3x3x3(in, out, stride));
  return torch::nn::AnyModule(Conv2Plus1d(in, out, mid, stride));
}

// Blocks per layer of both architectures (torchvision's [2, 2, 2, 2]).
constexpr int64_t kBlocksPerLayer = 2;
constexpr int64_t kWidths[] = {64, 128, 256, 512};
}  // namespace

// ---------------------------------------------------------------------------------------------
// Conv2Plus1d

Conv2Plus1dImpl::Conv2Plus1dImpl(int64_t in_channels, int64_t out_channels, int64_t mid_channels,
                                 int64_t stride) {
  spatial = register_module("0", LeanConv3d(Conv3dOptions(in_channels, mid_channels, {1, 3, 3})
                                                .stride({1, stride, stride})
                                                .padding({0, 1, 1})
                                                .bias(false)));
  norm = register_module("1", BatchNorm3d(mid_channels));
  relu = register_module("2", make_relu());
  temporal = register_module("3", LeanConv3d(Conv3dOptions(mid_channels, out_channels, {3, 1, 1})
                                                 .stride({stride, 1, 1})
                                                 .padding({1, 0, 0})
                                                 .bias(false)));
}

torch::Tensor Conv2Plus1dImpl::forward(const torch::Tensor& x) { return after_spatial(spatial(x)); }

torch::Tensor Conv2Plus1dImpl::after_spatial(const torch::Tensor& h) {
  return recompute_norm ? norm_relu_conv(h, *norm, *temporal) : temporal(relu(norm(h)));
}

// ---------------------------------------------------------------------------------------------
// VideoBasicBlock

VideoBasicBlockImpl::VideoBasicBlockImpl(VideoArch arch, int64_t in_channels, int64_t channels,
                                         int64_t stride) {
  const int64_t mid = mid_channels(in_channels, channels);
  torch::nn::Sequential first, second;
  first->push_back(conv_builder(arch, in_channels, channels, mid, stride));
  first->push_back(BatchNorm3d(channels));
  first->push_back(make_relu());
  second->push_back(conv_builder(arch, channels, channels, mid, 1));
  second->push_back(BatchNorm3d(channels));
  conv1 = register_module("conv1", first);
  conv2 = register_module("conv2", second);
  if (stride != 1 || in_channels != channels) {
    // Both builders downsample by `stride` in time and space.
    downsample = register_module(
        "downsample",
        torch::nn::Sequential(
            LeanConv3d(Conv3dOptions(in_channels, channels, 1).stride(stride).bias(false)),
            BatchNorm3d(channels)));
  }
}

torch::Tensor VideoBasicBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor out;
  if (recompute_norm) {
    const auto h = conv1->begin()->forward(x);  // conv1's convolution, whichever kind
    auto& norm = *conv1->ptr(1)->as<torch::nn::BatchNorm3dImpl>();
    if (auto* simple = conv2->ptr(0)->as<LeanConv3dImpl>()) {
      out = norm_relu_conv(h, norm, *simple);
    } else {
      auto* factored = conv2->ptr(0)->as<Conv2Plus1dImpl>();
      out = factored->after_spatial(norm_relu_conv(h, norm, *factored->spatial));
    }
    out = conv2->ptr(1)->as<torch::nn::BatchNorm3dImpl>()->forward(out);
  } else {
    out = conv2->forward(conv1->forward(x));
  }
  out.add_(downsample ? downsample->forward(x) : x);  // in place on a BatchNorm output
  return out.relu_();
}

// ---------------------------------------------------------------------------------------------
// VideoResNet

VideoResNetImpl::VideoResNetImpl(const VideoResNetOptions& options)
    : options_(options), arch_(parse_video_arch(options.arch())) {
  TORCH_CHECK(options.num_classes() >= 0, "num_classes must be >= 0 (0 = feature mode); got ",
              options.num_classes());
  if (arch_ == VideoArch::R3D_18) {
    stem = register_module(
        "stem",
        torch::nn::Sequential(
            LeanConv3d(
                Conv3dOptions(3, 64, {3, 7, 7}).stride({1, 2, 2}).padding({1, 3, 3}).bias(false)),
            BatchNorm3d(64), make_relu()));
  } else {
    // torchvision's R2Plus1dStem: 45 spatial channels, then a temporal convolution.
    stem = register_module(
        "stem",
        torch::nn::Sequential(
            LeanConv3d(
                Conv3dOptions(3, 45, {1, 7, 7}).stride({1, 2, 2}).padding({0, 3, 3}).bias(false)),
            BatchNorm3d(45), make_relu(),
            LeanConv3d(Conv3dOptions(45, 64, {3, 1, 1}).stride(1).padding({1, 0, 0}).bias(false)),
            BatchNorm3d(64), make_relu()));
  }
  int64_t channels = 64;
  torch::nn::Sequential* layers[] = {&layer1, &layer2, &layer3, &layer4};
  for (int64_t l = 0; l < 4; ++l) {
    torch::nn::Sequential layer;
    for (int64_t b = 0; b < kBlocksPerLayer; ++b) {
      layer->push_back(VideoBasicBlock(arch_, channels, kWidths[l], b == 0 && l > 0 ? 2 : 1));
      channels = kWidths[l];
    }
    *layers[l] = register_module("layer" + std::to_string(l + 1), layer);
  }
  if (options.num_classes() > 0) {
    fc = register_module("fc", torch::nn::Linear(feature_dim(), options.num_classes()));
  }

  // torchvision's initialisation: He (fan_out) for convolutions, N(0, 0.01) for fc.
  for (auto& module : modules(/*include_self=*/false)) {
    if (auto* c = module->as<LeanConv3d>()) {
      torch::nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
      c->lean_backward = options.lean_backward();
    }
  }
  if (fc) {
    torch::NoGradGuard no_grad;
    fc->weight.normal_(0, 0.01);
    fc->bias.zero_();
  }
}

std::vector<std::string> VideoResNetImpl::block_names() const {
  std::vector<std::string> names = {"stem"};
  for (int64_t l = 1; l <= 4; ++l) {
    for (int64_t b = 0; b < kBlocksPerLayer; ++b) {
      names.push_back("layer" + std::to_string(l) + "." + std::to_string(b));
    }
  }
  names.push_back("head");
  return names;
}

void VideoResNetImpl::check_input(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 5, "VideoResNet expects a batch of clips [N,3,T,H,W]; got shape ",
              x.sizes(), ". Pass one clip of frames [T,3,H,W] as x.transpose(0, 1).unsqueeze(0).");
  TORCH_CHECK(x.size(1) == 3, "VideoResNet expects 3 colour channels in dimension 1 of ",
              "[N,3,T,H,W]; got ", x.sizes(), ". Clips stored as [N,T,3,H,W] need ",
              ".permute({0,2,1,3,4}).");
  TORCH_CHECK(x.is_floating_point(), "VideoResNet expects normalised floating-point input; got ",
              x.scalar_type(),
              ". Convert uint8 frames [T,3,H,W] with framefit::engine::frames_to_input() ",
              "(torchvision's video weights expect Kinetics mean/std), then ",
              ".transpose(0, 1).unsqueeze(0).");
  const int64_t min = min_input_size();
  TORCH_CHECK(x.size(2) >= 1, "VideoResNet needs at least one frame; got ", x.sizes());
  TORCH_CHECK(x.size(3) >= min && x.size(4) >= min, "frames of ", x.size(3), "x", x.size(4),
              " are too small for ", to_string(arch_), ": it downsamples space by ", min,
              ", so height and width must be at least ", min, " (its clips are usually 112x112)");
}

torch::Tensor VideoResNetImpl::forward_blocks(const torch::Tensor& input, int64_t begin,
                                              int64_t end) {
  const auto count = static_cast<int64_t>(block_names().size());
  TORCH_CHECK(0 <= begin && begin <= end && end <= count, "block range [", begin, ", ", end,
              ") outside the ", count, " blocks of ", to_string(arch_),
              " (stem, layer1.0 ... layer4.1, head)");
  if (begin == 0) check_input(input);
  auto x = input;
  for (int64_t i = begin; i < end; ++i) {
    if (i == 0 && recompute_norm && arch_ == VideoArch::R2Plus1D_18) {
      const auto h = stem->ptr(0)->as<LeanConv3dImpl>()->forward(x);
      x = norm_relu_conv(h, *stem->ptr(1)->as<torch::nn::BatchNorm3dImpl>(),
                         *stem->ptr(3)->as<LeanConv3dImpl>());
      x = stem->ptr(4)->as<torch::nn::BatchNorm3dImpl>()->forward(x).relu_();
    } else if (i == 0) {
      x = stem->forward(x);
    } else if (i == count - 1) {
      x = torch::adaptive_avg_pool3d(x, {1, 1, 1}).flatten(1);
      if (fc) x = fc(x);
    } else {
      torch::nn::Sequential* layers[] = {&layer1, &layer2, &layer3, &layer4};
      const auto& layer = *layers[(i - 1) / kBlocksPerLayer];
      x = (*layer)[(i - 1) % kBlocksPerLayer]->as<VideoBasicBlockImpl>()->forward(x);
    }
  }
  return x;
}

torch::Tensor VideoResNetImpl::forward(const torch::Tensor& x) {
  return forward_blocks(x, 0, static_cast<int64_t>(block_names().size()));
}

torch::Tensor VideoResNetImpl::features(const torch::Tensor& x) {
  const auto count = static_cast<int64_t>(block_names().size());
  return torch::adaptive_avg_pool3d(forward_blocks(x, 0, count - 1), {1, 1, 1}).flatten(1);
}

// ---------------------------------------------------------------------------------------------
// Sizes without building

VideoResNetSize video_resnet_size(const VideoResNetOptions& options) {
  const VideoArch arch = parse_video_arch(options.arch());
  TORCH_CHECK(options.num_classes() >= 0, "num_classes must be >= 0 (0 = feature mode); got ",
              options.num_classes());
  VideoResNetSize size;
  auto conv = [&](int64_t in, int64_t out, int64_t kt, int64_t kh, int64_t kw) {
    size.parameters += in * out * kt * kh * kw;
  };
  auto norm = [&](int64_t channels) {
    size.parameters += 2 * channels;
    size.buffer_elements += 2 * channels;
    size.buffer_counters += 1;
  };
  // One conv_builder convolution (with the inner BatchNorm of Conv2Plus1D).
  auto builder = [&](int64_t in, int64_t out, int64_t mid) {
    if (arch == VideoArch::R3D_18) {
      conv(in, out, 3, 3, 3);
    } else {
      conv(in, mid, 1, 3, 3), norm(mid), conv(mid, out, 3, 1, 1);
    }
  };
  if (arch == VideoArch::R3D_18) {
    conv(3, 64, 3, 7, 7), norm(64);
  } else {
    conv(3, 45, 1, 7, 7), norm(45), conv(45, 64, 3, 1, 1), norm(64);
  }
  int64_t channels = 64;
  for (int64_t l = 0; l < 4; ++l) {
    for (int64_t b = 0; b < kBlocksPerLayer; ++b) {
      const int64_t width = kWidths[l], stride = b == 0 && l > 0 ? 2 : 1;
      const int64_t mid = mid_channels(channels, width);
      builder(channels, width, mid), norm(width);
      builder(width, width, mid), norm(width);
      if (stride != 1 || channels != width) conv(channels, width, 1, 1, 1), norm(width);
      channels = width;
    }
  }
  size.feature_dim = channels;
  size.parameters += options.num_classes() * channels + options.num_classes();  // fc
  size.min_input_size = 16;
  return size;
}

}  // namespace framefit::models
