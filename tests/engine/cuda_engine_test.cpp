// The engine on CUDA: skipped where no GPU is present (run with scripts/cuda_check.sh).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "framefit/engine/chunked.h"
#include "framefit/engine/step.h"
#include "framefit/models/resnet.h"

using namespace framefit;

namespace {
class CudaEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device cuda{torch::kCUDA, 0};
};

std::vector<torch::Tensor> grads(const engine::FrameEncoder& encoder, const torch::Tensor& frames,
                                 const engine::ChunkedOptions& options) {
  auto features = engine::chunked_encode(encoder, frames, options);
  auto weights = torch::linspace(-1, 1, features.numel(), features.options()).view(features.sizes());
  return torch::autograd::grad({(features * weights).sum()}, encoder.parameters, {}, false, false, true);
}
}  // namespace

TEST_F(CudaEngine, ChunkedGradientsEqualNaiveInFloat64) {
  torch::manual_seed(0);
  models::ResNet net(models::ResNetOptions(18).num_classes(0).norm(models::NormKind::GroupNorm).groups(8));
  net->to(cuda, torch::kFloat64);
  const auto encoder = engine::frame_encoder(net.ptr());
  const auto frames = torch::randint(0, 256, {11, 3, 32, 32}).to(torch::kUInt8);  // stays on the host
  engine::ChunkedOptions naive;
  naive.chunk = 0;
  naive.device = cuda;
  naive.dtype = torch::kFloat64;
  engine::ChunkedOptions chunked = naive;
  chunked.chunk = 4;
  const auto a = grads(encoder, frames, naive);
  const auto b = grads(encoder, frames, chunked);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / a[i].abs().max().clamp_min(1e-30)).item<double>());
  }
  EXPECT_LE(worst, 1e-10);
}

TEST_F(CudaEngine, Fp16StepWithLossScaling) {
  torch::manual_seed(0);
  models::ResNet net(models::ResNetOptions(18).num_classes(0).norm(models::NormKind::FrozenBatchNorm));
  auto head = models::make_head("tcn", 512, 7);
  net->to(cuda);
  head->to(cuda);
  engine::StepOptions options;
  options.chunked.chunk = 8;
  options.chunked.device = cuda;
  options.precision = engine::Precision::FP16;
  auto encoder = engine::frame_encoder(net.ptr());
  auto params = encoder.parameters;
  for (auto& p : head->parameters()) params.push_back(p);
  engine::TrainingStep step(encoder, head, engine::make_optimizer(params, {}), options);
  engine::Video video{torch::randint(0, 256, {40, 3, 64, 64}).to(torch::kUInt8),
                      torch::randint(0, 7, {40}, torch::kLong), "gpu video"};
  auto report = step.step({video});
  EXPECT_TRUE(std::isfinite(report.loss));
  EXPECT_TRUE(report.optimizer_stepped || report.overflow_skipped);
  EXPECT_GT(report.peak_bytes, 0);
  for (int i = 0; i < 3; ++i) report = step.step({video});
  EXPECT_TRUE(report.optimizer_stepped);
  EXPECT_GT(step.scaler().current_scale(), 1.0);
}
