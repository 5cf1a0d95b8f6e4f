// The engine on CUDA: skipped where no GPU is present (run with scripts/cuda_check.sh).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "framefit/engine/chunked.h"
#include "framefit/engine/step.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/heads.h"
#include "framefit/models/resnet.h"
#include "framefit/plan/calibration.h"
#include "framefit/plan/planner.h"
#include "plan/tiny_plan.h"

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

TEST_F(CudaEngine, BatchNormKeepsBf16And16BitInputs) {
  // Mixed-dtype kernels: float32 statistics and parameters, the 16-bit input kept as it is.
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(0);
    models::Norm2d low(models::Norm2dOptions(8)), ref(models::Norm2dOptions(8));
    low->to(cuda);
    ref->to(cuda);
    const auto x = torch::randn({4, 8, 5, 5}, cuda).to(dtype).requires_grad_();
    const auto y = low->forward(x);
    EXPECT_EQ(y.scalar_type(), dtype);
    // Straight from the norm kernel: no float32 copy in or out, which backward would keep.
    EXPECT_EQ(y.grad_fn()->name().find("ToCopy"), std::string::npos) << y.grad_fn()->name();
    EXPECT_TRUE(torch::allclose(y.to(torch::kFloat), ref->forward(x.detach().to(torch::kFloat)),
                                2e-2, 2e-2));
    EXPECT_TRUE(torch::allclose(low->running_mean, ref->running_mean, 1e-3, 1e-3));
    y.to(torch::kFloat).square().sum().backward();
    EXPECT_EQ(x.grad().scalar_type(), dtype);
    EXPECT_TRUE(low->weight.grad().defined());
  }
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
  engine::TrainingStep step(encoder, head, engine::make_optimizer(params, {}), options,
                            memory::Tracker::of(cuda));
  framefit::Video video{torch::randint(0, 256, {40, 3, 64, 64}).to(torch::kUInt8),
                        torch::randint(0, 7, {40}, torch::kLong), "gpu video"};
  auto report = step.step({video});
  EXPECT_TRUE(std::isfinite(report.loss));
  EXPECT_TRUE(report.optimizer_stepped || report.overflow_skipped);
  EXPECT_GT(report.peak_bytes, 0);
  for (int i = 0; i < 3; ++i) report = step.step({video});
  EXPECT_TRUE(report.optimizer_stepped);
  EXPECT_GT(step.scaler().current_scale(), 1.0);
}

// The planner on CUDA: costs calibrated on the GPU, a plan for a budget between the smallest
// plan and naive training, and real steps under that budget (CUDA's tracker enforces it).
TEST_F(CudaEngine, PlannedStepFitsTheBudgetAndMatchesThePrediction) {
  const auto spec = test_util::tiny_plan_spec(cuda);
  const auto costs = plan::calibrate(spec, engine::Precision::FP32, memory::Tracker::of(cuda),
                                     test_util::quick_calibration());
  auto sizes = plan::static_sizes(spec);
  // The cuBLAS workspaces the tracker measured when made (32 MiB each on Hopper) are in every
  // step's peak; the plan counts them.
  sizes.library_bytes = memory::Tracker::of(cuda).library_bytes();
  EXPECT_GT(sizes.library_bytes, 0);
  const std::map<engine::Precision, plan::ChunkCosts> by_precision = {{engine::Precision::FP32, costs}};
  plan::PlanRequest request;
  request.model = spec;
  request.frames = 160;
  request.keep = 1;
  const auto smallest = plan::fit(request, sizes, by_precision, 1, 0.1).minimum_budget_bytes;
  auto naive_request = request;
  naive_request.chunk = 0;
  naive_request.keep = 0;
  const auto naive_peak = plan::fit(naive_request, sizes, by_precision, 1, 0.1).breakdown.peak_bytes;
  ASSERT_LT(smallest, naive_peak);
  const int64_t budget = (smallest + naive_peak) / 2;
  const auto chosen = plan::fit(request, sizes, by_precision, budget, 0.1);
  ASSERT_TRUE(chosen.fits) << chosen.advice;

  torch::manual_seed(1);
  models::ResNet net(spec.encoder_options());
  auto head = models::make_head(spec.head, net->feature_dim(), spec.classes);
  net->to(cuda);
  head->to(cuda);
  auto encoder = engine::frame_encoder(net.ptr());
  auto params = encoder.parameters;
  for (auto& p : head->parameters()) params.push_back(p);
  engine::StepOptions options;
  options.chunked.chunk = chosen.settings.chunk;
  options.chunked.keep = chosen.settings.keep;
  options.chunked.cache_frozen = chosen.settings.cache_frozen;
  options.chunked.device = cuda;
  engine::OptimizerOptions optimizer;
  optimizer.kind = spec.optimizer;
  engine::TrainingStep step(encoder, head, engine::make_optimizer(params, optimizer), options,
                            memory::Tracker::of(cuda));
  framefit::Video video{
      torch::randint(0, 256, {request.frames, 3, spec.size, spec.size}).to(torch::kUInt8),
      torch::randint(0, spec.classes, {request.frames}, torch::kLong), "gpu video"};
  auto& tracker = memory::Tracker::of(cuda);
  tracker.set_budget(budget);
  engine::StepReport first, second;
  EXPECT_NO_THROW({
    first = step.step({video});
    second = step.step({video});
  });
  tracker.set_budget(0);
  EXPECT_TRUE(first.replans.empty() && second.replans.empty());
  const double measured = static_cast<double>(second.peak_bytes);
  std::cout << "[ cuda plan ] chunk " << chosen.settings.chunk << " keep " << chosen.settings.keep
            << ", budget " << budget << ", predicted " << chosen.breakdown.peak_bytes
            << ", measured " << second.peak_bytes << ", libraries " << sizes.library_bytes << "\n";
  EXPECT_LE(second.peak_bytes, budget);
  EXPECT_NEAR(static_cast<double>(chosen.breakdown.peak_bytes), measured, 0.10 * measured);
}
