// Exactness of chunked_encode against naive training (all frames with grad) and against
// chunk-by-chunk training where BatchNorm statistics or dropout make the two differ.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

#include "framefit/engine/amp.h"
#include "framefit/engine/chunked.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"

using namespace framefit;
using models::NormKind;
using models::ResNet;
using models::ResNetOptions;

namespace {

torch::Tensor video(int64_t frames, int64_t size, uint64_t seed = 1) {
  auto gen = at::detail::createCPUGenerator(seed);
  return torch::randint(0, 256, {frames, 3, size, size}, gen, torch::kUInt8);
}

// A fixed linear readout of the features: a loss whose gradient reaches every frame.
torch::Tensor readout_loss(const torch::Tensor& features) {
  auto gen = at::detail::createCPUGenerator(99);
  auto weights = torch::randn(features.sizes(), gen, features.scalar_type());
  return (features * weights).sum();
}

std::vector<torch::Tensor> grads_of(const engine::FrameEncoder& encoder, const torch::Tensor& frames,
                                    const engine::ChunkedOptions& options, bool via_backward) {
  auto features = engine::chunked_encode(encoder, frames, options);
  auto loss = readout_loss(features);
  if (!via_backward) {
    return torch::autograd::grad({loss}, encoder.parameters, {}, false, false, true);
  }
  for (auto& p : encoder.parameters) p.mutable_grad() = torch::Tensor();
  loss.backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : encoder.parameters) grads.push_back(p.grad().clone());
  return grads;
}

double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double scale = 1e-30, diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i].defined() && b[i].defined()) << "parameter " << i << " has no gradient";
    if (!a[i].defined() || !b[i].defined()) return 1e30;
    scale = std::max(scale, b[i].abs().max().item<double>());
    diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
  }
  return diff / scale;
}

struct Case {
  NormKind norm;
  torch::ScalarType dtype;
  double tolerance;
  bool recompute_norm = false;  // the blocks' BatchNorm and ReLU recomputed in backward
};
void PrintTo(const Case& c, std::ostream* out) {
  *out << models::to_string(c.norm) << ", " << c.dtype << ", tolerance " << c.tolerance
       << (c.recompute_norm ? ", BatchNorm recomputed" : "");
}

class ChunkedExactness : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(ChunkedExactness, GradientsEqualNaiveTraining) {
  const auto c = GetParam();
  torch::manual_seed(0);
  ResNet net(
      ResNetOptions(18).num_classes(0).norm(c.norm).groups(8).recompute_norm(c.recompute_norm));
  net->to(c.dtype);
  net->train();
  const auto encoder = engine::frame_encoder(net.ptr());
  const auto frames = video(11, 32);
  engine::ChunkedOptions naive;
  naive.chunk = 0;
  naive.dtype = c.dtype;
  const auto reference = grads_of(encoder, frames, naive, /*via_backward=*/true);
  for (int64_t keep : {0, 1, 2}) {
    engine::ChunkedOptions chunked = naive;
    chunked.chunk = 4;  // 4 + 4 + 3 frames
    chunked.keep = keep;
    EXPECT_LE(max_relative_difference(grads_of(encoder, frames, chunked, true), reference), c.tolerance)
        << "backward(), keep " << keep;
    EXPECT_LE(max_relative_difference(grads_of(encoder, frames, chunked, false), reference), c.tolerance)
        << "autograd::grad, keep " << keep;
  }
}

INSTANTIATE_TEST_SUITE_P(
    NormsAndPrecisions, ChunkedExactness,
    ::testing::Values(Case{NormKind::FrozenBatchNorm, torch::kFloat64, 1e-10},
                      Case{NormKind::GroupNorm, torch::kFloat64, 1e-10},
                      Case{NormKind::FrozenBatchNorm, torch::kFloat32, 1e-4},
                      Case{NormKind::GroupNorm, torch::kFloat32, 1e-4},
                      Case{NormKind::FrozenBatchNorm, torch::kFloat64, 1e-10, true},
                      Case{NormKind::FrozenBatchNorm, torch::kFloat32, 1e-4, true}),
    [](const auto& info) {
      return models::to_string(info.param.norm) +
             (info.param.dtype == torch::kFloat64 ? "_float64" : "_float32") +
             (info.param.recompute_norm ? "_norm_recomputed" : "");
    });

TEST(Chunked, FrozenStagesCachedOrRecomputedGiveTheSameGradients) {
  torch::manual_seed(0);
  ResNet net(ResNetOptions(18).num_classes(0).norm(NormKind::GroupNorm).groups(8).freeze("layer1"));
  net->to(torch::kFloat64);
  const auto encoder = engine::frame_encoder(net.ptr());
  EXPECT_TRUE(static_cast<bool>(encoder.frozen));
  for (const auto& p : net->layer1->parameters()) EXPECT_FALSE(p.requires_grad());
  const auto frames = video(9, 32);
  engine::ChunkedOptions naive;
  naive.chunk = 0;
  naive.dtype = torch::kFloat64;
  const auto reference = grads_of(encoder, frames, naive, true);
  engine::ChunkedOptions recompute = naive;
  recompute.chunk = 4;
  engine::ChunkedOptions cached = recompute;
  cached.cache_frozen = true;
  EXPECT_LE(max_relative_difference(grads_of(encoder, frames, recompute, true), reference), 1e-10);
  EXPECT_LE(max_relative_difference(grads_of(encoder, frames, cached, true), reference), 1e-10);
  EXPECT_FALSE(net->layer1[0]->as<models::ResidualBlock>()->conv1->weight.grad().defined());
}

namespace {
// Reference for batch-dependent layers: each chunk run with grad, graphs kept, one backward.
struct ChunkByChunk {
  std::vector<torch::Tensor> grads;
  torch::Tensor features;
};
ChunkByChunk chunk_by_chunk(const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                            const std::vector<torch::Tensor>& params, const torch::Tensor& frames,
                            int64_t chunk, torch::ScalarType dtype) {
  std::vector<torch::Tensor> outs;
  for (int64_t b = 0; b < frames.size(0); b += chunk) {
    outs.push_back(forward(engine::frames_to_input(frames.slice(0, b, b + chunk), torch::kCPU, dtype)));
  }
  auto features = torch::cat(outs);
  auto grads = torch::autograd::grad({readout_loss(features)}, params, {}, false, false, true);
  return {grads, features.detach()};
}

void train_mode_batch_norm_matches_chunk_by_chunk(bool recompute_norm) {
  torch::manual_seed(0);
  ResNet reference_net(ResNetOptions(18).num_classes(0));
  ResNet net(ResNetOptions(18).num_classes(0).recompute_norm(recompute_norm));
  reference_net->to(torch::kFloat64);
  net->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    const auto ours = net->parameters();
    const auto theirs = reference_net->parameters();
    for (size_t i = 0; i < ours.size(); ++i) ours[i].copy_(theirs[i]);
  }
  reference_net->train();
  net->train();
  const auto frames = video(10, 32);
  const auto reference = chunk_by_chunk([&](const torch::Tensor& x) { return reference_net->forward(x); },
                                        reference_net->parameters(), frames, 4, torch::kFloat64);
  engine::ChunkedOptions options;
  options.chunk = 4;
  options.keep = 1;
  options.dtype = torch::kFloat64;
  const auto encoder = engine::frame_encoder(net.ptr());
  const auto grads = grads_of(encoder, frames, options, false);
  EXPECT_LE(max_relative_difference(grads, reference.grads), 1e-10);
  // Statistics: three chunks, three updates, exactly like chunk-by-chunk training.
  EXPECT_EQ(net->bn1->num_batches_tracked.item<int64_t>(), 3);
  EXPECT_EQ(reference_net->bn1->num_batches_tracked.item<int64_t>(), 3);
  const auto ours = net->buffers();
  const auto theirs = reference_net->buffers();
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TRUE(torch::allclose(ours[i].to(torch::kFloat64), theirs[i].to(torch::kFloat64), 1e-12, 1e-12))
        << "buffer " << i;
  }
}
}  // namespace

TEST(Chunked, TrainModeBatchNormMatchesChunkByChunkAndUpdatesStatisticsOnce) {
  // Also with the blocks' BatchNorm and ReLU recomputed (models/norm_relu_conv.h), which updates
  // the statistics itself, in forward: still once per chunk.
  for (const bool recompute_norm : {false, true}) {
    SCOPED_TRACE(recompute_norm ? "BatchNorm recomputed" : "plain");
    train_mode_batch_norm_matches_chunk_by_chunk(recompute_norm);
  }
}

TEST(Chunked, DropoutIsReplayedPerChunk) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).stride(2)),
                            torch::nn::ReLU(), torch::nn::Dropout(0.5),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).stride(2)),
                            torch::nn::AdaptiveAvgPool2d(1), torch::nn::Flatten());
  net->to(torch::kFloat64);
  net->train();
  const auto forward = [&](const torch::Tensor& x) { return net->forward(x); };
  const auto frames = video(10, 24);
  torch::manual_seed(42);
  const auto reference = chunk_by_chunk(forward, net->parameters(), frames, 3, torch::kFloat64);
  torch::manual_seed(42);
  engine::ChunkedOptions options;
  options.chunk = 3;
  options.keep = 1;
  options.dtype = torch::kFloat64;
  const auto encoder = engine::frame_encoder(net.ptr(), forward);
  auto features = engine::chunked_encode(encoder, frames, options);
  EXPECT_TRUE(torch::allclose(features.detach(), reference.features, 0, 0));
  const auto next_draw = torch::rand({1}).item<double>();
  auto grads = torch::autograd::grad({readout_loss(features)}, encoder.parameters, {}, false, false, true);
  EXPECT_LE(max_relative_difference(grads, reference.grads), 1e-12);
  // Replaying a chunk's random numbers does not shift the stream the rest of the program sees.
  torch::manual_seed(42);
  chunk_by_chunk(forward, net->parameters(), frames, 3, torch::kFloat64);
  EXPECT_EQ(torch::rand({1}).item<double>(), next_draw);
}

TEST(Chunked, Bf16AutocastGradientsReachEveryWeight) {
  FRAMEFIT_SKIP_UNLESS_CPU_BF16_RUNS();
  // Autocast caches low-precision weight copies; copies made in the no-grad chunks must not
  // be reused where gradients are needed (the kept chunk, the recompute).
  torch::manual_seed(0);
  ResNet net(ResNetOptions(18).num_classes(0).norm(NormKind::FrozenBatchNorm));
  const auto encoder = engine::frame_encoder(net.ptr());
  const auto frames = video(12, 32);
  engine::ChunkedOptions naive;
  naive.chunk = 0;
  engine::ChunkedOptions chunked;
  chunked.chunk = 4;
  std::vector<torch::Tensor> reference, grads;
  {
    engine::AutocastGuard bf16(torch::kCPU, engine::Precision::BF16);
    reference = grads_of(encoder, frames, naive, false);
    grads = grads_of(encoder, frames, chunked, false);
  }
  // Both in bf16: they differ only by the kernels' summation order on other batch sizes.
  EXPECT_LE(max_relative_difference(grads, reference), 2e-2);
}

TEST(Chunked, InferenceNeedsNoGraph) {
  ResNet net(ResNetOptions(18).num_classes(0));
  net->eval();
  torch::NoGradGuard no_grad;
  const auto features = engine::chunked_encode(engine::frame_encoder(net.ptr()), video(5, 32));
  EXPECT_FALSE(features.requires_grad());
  EXPECT_EQ(features.sizes(), (std::vector<int64_t>{5, 512}));
}

TEST(Chunked, BadInputIsExplained) {
  ResNet net(ResNetOptions(18).num_classes(0));
  const auto encoder = engine::frame_encoder(net.ptr());
  auto message = [&](const torch::Tensor& frames, engine::ChunkedOptions options) {
    return test_util::error_message([&] { engine::chunked_encode(encoder, frames, options); });
  };
  engine::ChunkedOptions negative;
  negative.chunk = -1;
  EXPECT_NE(message(video(4, 32), negative).find("chunk must be >= 0"), std::string::npos);
  engine::ChunkedOptions bad_keep;
  bad_keep.keep = -2;
  EXPECT_NE(message(video(4, 32), bad_keep).find("keep must be >= 0"), std::string::npos);
  EXPECT_NE(message(torch::zeros({0, 3, 32, 32}, torch::kUInt8), {}).find("T = 0"), std::string::npos);
  EXPECT_NE(message(torch::zeros({4, 32, 32}, torch::kUInt8), {}).find("[T,3,H,W]"), std::string::npos);
}
