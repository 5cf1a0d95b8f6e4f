#include "framefit/models/resnet.h"

#include <torch/torch.h>

#include <array>

namespace framefit::models {

NormKind parse_norm_kind(const std::string& name) {
  if (name == "bn") return NormKind::BatchNorm;
  if (name == "frozen_bn") return NormKind::FrozenBatchNorm;
  if (name == "group_norm") return NormKind::GroupNorm;
  TORCH_CHECK(false, "unknown norm '", name, "': use bn, frozen_bn or group_norm");
}

std::string to_string(NormKind kind) {
  switch (kind) {
    case NormKind::BatchNorm: return "bn";
    case NormKind::FrozenBatchNorm: return "frozen_bn";
    case NormKind::GroupNorm: return "group_norm";
  }
  return "?";
}

ActivationLayout parse_activation_layout(const std::string& name) {
  if (name == "auto") return ActivationLayout::Auto;
  if (name == "nchw") return ActivationLayout::Nchw;
  if (name == "channels_last") return ActivationLayout::ChannelsLast;
  TORCH_CHECK(false, "unknown layout '", name, "': use auto, nchw or channels_last");
}

StageLayout resolve_layout(ActivationLayout layout, NormKind norm, c10::DeviceType device) {
  if (layout != ActivationLayout::Auto) return {layout == ActivationLayout::ChannelsLast, ""};
  if (norm == NormKind::GroupNorm) return {};
  return {true, device == c10::DeviceType::CPU ? "layer4" : ""};
}

// ---------------------------------------------------------------------------------------------
// Norm2d

Norm2dImpl::Norm2dImpl(const Norm2dOptions& options) : options_(options) {
  const int64_t c = options.channels();
  TORCH_CHECK(c > 0, "Norm2d needs a positive channel count; got ", c);
  weight = register_parameter("weight", torch::ones({c}));
  bias = register_parameter("bias", torch::zeros({c}));
  if (options.kind() == NormKind::GroupNorm) {
    TORCH_CHECK(options.groups() > 0 && c % options.groups() == 0, "group_norm with ",
                options.groups(), " groups cannot split ", c,
                " channels: choose a group count that divides every stage's width (e.g. 32)");
  } else {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }
  if (options.kind() == NormKind::FrozenBatchNorm) freeze();
}

void Norm2dImpl::freeze() {
  frozen_ = true;
  weight.set_requires_grad(false);
  bias.set_requires_grad(false);
}

torch::Tensor Norm2dImpl::forward(const torch::Tensor& input) {
  // Under autocast, activations arrive in bf16/fp16 while parameters stay float32. BatchNorm has
  // mixed-dtype kernels (CPU: bf16, CUDA: fp16 and bf16, as PyTorch's autocast uses them) that
  // compute in float32 and save the low-precision input; for anything else (GroupNorm, LibTorch
  // 1.13's CPU kernels need one dtype) normalise a float32 copy, which backward keeps: twice the
  // input's bytes.
  const auto dtype = input.scalar_type();
  const bool mixed = options_.kind() != NormKind::GroupNorm &&
                     weight.scalar_type() == torch::kFloat &&
                     (dtype == torch::kBFloat16 || (input.is_cuda() && dtype == torch::kHalf));
  const auto x = mixed || dtype == weight.scalar_type() ? input : input.to(weight.scalar_type());
  auto out = norm(x);
  return out.scalar_type() == dtype ? out : out.to(dtype);
}

torch::Tensor Norm2dImpl::norm(const torch::Tensor& x) {
  if (options_.kind() == NormKind::GroupNorm) {
    return torch::group_norm(x, options_.groups(), weight, bias, options_.eps());
  }
  const bool use_batch_stats = is_training() && !frozen_;
  if (use_batch_stats) {
    torch::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
  }
  return torch::batch_norm(x, weight, bias, running_mean, running_var, use_batch_stats,
                           options_.momentum(), options_.eps(), /*cudnn_enabled=*/true);
}

// ---------------------------------------------------------------------------------------------
// ResidualBlock

namespace {
torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel)
                               .stride(stride)
                               .padding(kernel / 2)
                               .bias(false));
}
Norm2dOptions with_channels(Norm2dOptions norm, int64_t channels) {
  return norm.channels(channels);
}
}  // namespace

ResidualBlockImpl::ResidualBlockImpl(int64_t in_channels, int64_t width, int64_t stride,
                                     bool bottleneck, const Norm2dOptions& norm) {
  const int64_t expansion = bottleneck ? 4 : 1;
  out_channels_ = width * expansion;
  if (bottleneck) {
    // torchvision's ResNet v1.5: the stride sits on the 3x3 convolution.
    conv1 = register_module("conv1", conv(in_channels, width, 1, 1));
    bn1 = register_module("bn1", Norm2d(with_channels(norm, width)));
    conv2 = register_module("conv2", conv(width, width, 3, stride));
    bn2 = register_module("bn2", Norm2d(with_channels(norm, width)));
    conv3 = register_module("conv3", conv(width, out_channels_, 1, 1));
    bn3 = register_module("bn3", Norm2d(with_channels(norm, out_channels_)));
  } else {
    conv1 = register_module("conv1", conv(in_channels, width, 3, stride));
    bn1 = register_module("bn1", Norm2d(with_channels(norm, width)));
    conv2 = register_module("conv2", conv(width, width, 3, 1));
    bn2 = register_module("bn2", Norm2d(with_channels(norm, width)));
  }
  if (stride != 1 || in_channels != out_channels_) {
    downsample = register_module(
        "downsample", torch::nn::Sequential(conv(in_channels, out_channels_, 1, stride),
                                            Norm2d(with_channels(norm, out_channels_))));
  }
}

torch::Tensor ResidualBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor out;
  if (recompute_norm) {
    out = norm_relu_conv(conv1(x), *bn1, *conv2);
    out = conv3 ? bn3(norm_relu_conv(out, *bn2, *conv3)) : bn2(out);
  } else {
    // In place where autograd allows it, as torchvision does: no norm's backward needs its output.
    out = bn1(conv1(x)).relu_();
    out = bn2(conv2(out));
    if (conv3) out = bn3(conv3(out.relu_()));
  }
  const auto identity = downsample ? downsample->forward(x) : x;
  // Under autocast a float32 identity cannot be added into a bf16/fp16 output in place.
  if (out.scalar_type() == identity.scalar_type()) return out.add_(identity).relu_();
  return torch::relu(out + identity);
}

// ---------------------------------------------------------------------------------------------
// ResNet

namespace {
// Blocks per layer and block kind of each depth (torchvision's table).
struct Layout {
  std::array<int64_t, 4> blocks;
  bool bottleneck;
};
Layout layout_of(int64_t depth) {
  switch (depth) {
    case 18: return {{2, 2, 2, 2}, false};
    case 34: return {{3, 4, 6, 3}, false};
    case 50: return {{3, 4, 6, 3}, true};
    default: TORCH_CHECK(false, "ResNet depth must be 18, 34 or 50; got ", depth);
  }
}
}  // namespace

int64_t parse_resnet_name(const std::string& name) {
  if (name == "resnet18") return 18;
  if (name == "resnet34") return 34;
  if (name == "resnet50") return 50;
  TORCH_CHECK(false, "unknown model '", name, "': use resnet18, resnet34 or resnet50");
}

ResNetImpl::ResNetImpl(const ResNetOptions& options) : options_(options) {
  const Layout layout = layout_of(options.depth());
  const auto& blocks = layout.blocks;
  const bool bottleneck = layout.bottleneck;
  TORCH_CHECK(options.num_classes() >= 0, "num_classes must be >= 0 (0 = feature mode); got ",
              options.num_classes());
  const auto norm = Norm2dOptions(64).kind(options.norm()).groups(options.groups());

  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 64, 7)
                                                         .stride(2)
                                                         .padding(3)
                                                         .bias(false)));
  bn1 = register_module("bn1", Norm2d(norm));
  int64_t channels = 64;
  auto make_layer = [&](int64_t width, int64_t count, int64_t stride) {
    torch::nn::Sequential layer;
    for (int64_t i = 0; i < count; ++i) {
      ResidualBlock block(channels, width, i == 0 ? stride : 1, bottleneck, norm);
      channels = block->out_channels();
      layer->push_back(block);
    }
    return layer;
  };
  layer1 = register_module("layer1", make_layer(64, blocks[0], 1));
  layer2 = register_module("layer2", make_layer(128, blocks[1], 2));
  layer3 = register_module("layer3", make_layer(256, blocks[2], 2));
  if (!options.drop_layer4()) layer4 = register_module("layer4", make_layer(512, blocks[3], 2));
  feature_dim_ = channels;
  if (options.num_classes() > 0) {
    fc = register_module("fc", torch::nn::Linear(feature_dim_, options.num_classes()));
  }

  // torchvision's initialisation: He (fan_out) for convolutions, identity for norms.
  for (auto& module : modules(/*include_self=*/false)) {
    if (auto* c = module->as<torch::nn::Conv2d>()) {
      torch::nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    }
  }
  if (!options.freeze().empty()) freeze_up_to(options.freeze());
  const auto names = stage_names();
  first_nchw_stage_ = static_cast<int64_t>(names.size());
  if (!options.nchw_from().empty()) {
    const auto it = std::find(names.begin(), names.end(), options.nchw_from());
    TORCH_CHECK(it != names.end() || (options.drop_layer4() && options.nchw_from() == "layer4"),
                "nchw_from must name a stage (conv1, layer1, ..., layer4); got '",
                options.nchw_from(), "'");
    first_nchw_stage_ = it - names.begin();
  }
  if (options.recompute_norm()) set_recompute_norm(*this, true);
  if (options.channels_last()) {
    torch::NoGradGuard no_grad;
    for (int64_t stage = 0; stage < first_nchw_stage_; ++stage) {
      for (auto& module : stage_modules(names[stage])) {
        for (auto& p : module->parameters()) {
          if (p.dim() == 4) p.set_data(p.contiguous(torch::MemoryFormat::ChannelsLast));
        }
      }
    }
  }
}

std::vector<std::shared_ptr<torch::nn::Module>> ResNetImpl::stage_modules(
    const std::string& stage) {
  if (stage == "conv1") return {conv1.ptr(), bn1.ptr()};
  return {named_children()[stage]};
}

std::vector<std::string> ResNetImpl::stage_names() const {
  std::vector<std::string> names = {"conv1", "layer1", "layer2", "layer3"};
  if (layer4) names.push_back("layer4");
  return names;
}

void ResNetImpl::freeze_up_to(const std::string& stage) {
  const auto names = stage_names();
  const auto last = std::find(names.begin(), names.end(), stage);
  TORCH_CHECK(last != names.end(), "cannot freeze up to '", stage, "': stages are conv1, layer1, "
              "layer2, layer3", layer4 ? ", layer4" : " (layer4 is dropped)");
  for (auto it = names.begin(); it != last + 1; ++it) {
    for (auto& root : stage_modules(*it)) {
      for (auto& p : root->parameters()) p.set_requires_grad(false);
      for (auto& m : root->modules(/*include_self=*/true)) {
        if (auto* norm = m->as<Norm2d>()) norm->freeze();
      }
    }
  }
}

int64_t ResNetImpl::min_input_size() const { return layer4 ? 32 : 16; }

void ResNetImpl::check_input(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 4, "ResNet expects a batch of images [N,3,H,W]; got a tensor of shape ",
              x.sizes(), ". For one video of T frames pass [T,3,H,W].");
  TORCH_CHECK(x.size(1) == 3, "ResNet expects 3 colour channels in dimension 1 ([N,3,H,W]); got ",
              x.sizes(), ". Frames stored as [N,H,W,3] need .permute({0,3,1,2}).");
  TORCH_CHECK(x.is_floating_point(), "ResNet expects normalised floating-point input; got ",
              x.scalar_type(), ". Convert uint8 frames with framefit::engine::frames_to_input().");
  const int64_t min = min_input_size();
  TORCH_CHECK(x.size(2) >= min && x.size(3) >= min, "input of ", x.size(2), "x", x.size(3),
              " is too small for this ResNet: it downsamples by ", min,
              ", so height and width must be at least ", min);
}

int64_t ResNetImpl::frozen_stage_count() const {
  if (options_.freeze().empty()) return 0;
  const auto names = stage_names();
  return std::find(names.begin(), names.end(), options_.freeze()) - names.begin() + 1;
}

torch::Tensor ResNetImpl::forward_stages(const torch::Tensor& input, int64_t begin, int64_t end) {
  const auto count = static_cast<int64_t>(stage_names().size());
  TORCH_CHECK(0 <= begin && begin <= end && end <= count, "stage range [", begin, ", ", end,
              ") outside the ", count, " stages of this ResNet");
  auto x = input;
  if (begin == 0) check_input(x);
  for (int64_t stage = begin; stage < end; ++stage) {
    if (options_.channels_last()) {
      // The convolutions follow their input's layout, so each stage gets its own.
      x = x.contiguous(stage < first_nchw_stage_ ? torch::MemoryFormat::ChannelsLast
                                                 : torch::MemoryFormat::Contiguous);
    }
    switch (stage) {
      case 0: x = torch::max_pool2d(bn1(conv1(x)).relu_(), 3, 2, 1); break;
      case 1: x = layer1->forward(x); break;
      case 2: x = layer2->forward(x); break;
      case 3: x = layer3->forward(x); break;
      case 4: x = layer4->forward(x); break;
    }
  }
  // Pooled once, after the last stage: a range past it (the trainable part of an encoder frozen
  // through its last stage) gets features already pooled.
  if (end == count && x.dim() == 4) x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
  return x;
}

torch::Tensor ResNetImpl::features(const torch::Tensor& input) {
  return forward_stages(input, 0, static_cast<int64_t>(stage_names().size()));
}

torch::Tensor ResNetImpl::forward(const torch::Tensor& x) {
  auto f = features(x);
  return fc ? fc(f) : f;
}

}  // namespace framefit::models

namespace framefit::models {

ResNetSize resnet_size(const ResNetOptions& options) {
  const Layout layout = layout_of(options.depth());
  const auto& blocks = layout.blocks;
  const bool bottleneck = layout.bottleneck;
  const int64_t stage_count = options.drop_layer4() ? 4 : 5;
  int64_t frozen = 0;
  if (!options.freeze().empty()) {
    const std::vector<std::string> names = {"conv1", "layer1", "layer2", "layer3", "layer4"};
    const auto it = std::find(names.begin(), names.begin() + stage_count, options.freeze());
    TORCH_CHECK(it != names.begin() + stage_count, "cannot freeze up to '", options.freeze(),
                "': stages are conv1, layer1, layer2, layer3",
                options.drop_layer4() ? " (layer4 is dropped)" : ", layer4");
    frozen = it - names.begin() + 1;
  }
  const bool norm_trained = options.norm() != NormKind::FrozenBatchNorm;
  const bool has_stats = options.norm() != NormKind::GroupNorm;

  ResNetSize size;
  size.frozen_stages = frozen;
  size.min_input_size = options.drop_layer4() ? 16 : 32;
  int64_t stage = 0;  // the stage being counted
  auto weight = [&](int64_t elements, bool trainable) {
    size.parameters += elements;
    if (trainable && stage >= frozen) {
      size.trained_parameters += elements;
      size.largest_trained = std::max(size.largest_trained, elements);
    }
  };
  auto conv = [&](int64_t in, int64_t out, int64_t kernel) { weight(in * out * kernel * kernel, true); };
  auto norm = [&](int64_t channels) {
    weight(channels, norm_trained);
    weight(channels, norm_trained);
    if (has_stats) {
      size.buffer_elements += 2 * channels;
      size.buffer_counters += 1;
    }
  };
  conv(3, 64, 7);
  norm(64);
  int64_t channels = 64, stride = 4;  // conv1 (2) and max pooling (2)
  if (frozen == 1) size.frozen_channels = channels, size.frozen_stride = stride;
  const int64_t widths[] = {64, 128, 256, 512};
  for (int64_t layer = 0; layer < stage_count - 1; ++layer) {
    stage = layer + 1;
    const int64_t width = widths[layer], expansion = bottleneck ? 4 : 1;
    for (int64_t b = 0; b < blocks[layer]; ++b) {
      const int64_t block_stride = b == 0 && layer > 0 ? 2 : 1;
      if (bottleneck) {
        conv(channels, width, 1), norm(width);
        conv(width, width, 3), norm(width);
        conv(width, width * expansion, 1), norm(width * expansion);
      } else {
        conv(channels, width, 3), norm(width);
        conv(width, width, 3), norm(width);
      }
      if (block_stride != 1 || channels != width * expansion) {
        conv(channels, width * expansion, 1), norm(width * expansion);
      }
      channels = width * expansion;
      stride *= block_stride;
    }
    if (frozen == stage + 1) size.frozen_channels = channels, size.frozen_stride = stride;
  }
  size.feature_dim = channels;
  stage = stage_count;  // the classifier is never frozen
  if (options.num_classes() > 0) {
    weight(channels * options.num_classes(), true);
    weight(options.num_classes(), true);
  }
  return size;
}

}  // namespace framefit::models
