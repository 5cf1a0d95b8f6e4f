// The tracker on CUDA (LibTorch's caching allocator): skipped where no GPU is present. Run on a
// GPU machine with a CUDA LibTorch build (see docs/memory.md).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "framefit/engine/extract.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"

using framefit::memory::Tracker;

namespace {
constexpr int64_t kMiB = 1 << 20;

class CudaTracker : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
  Tracker& tracker() { return Tracker::of(torch::Device(torch::kCUDA, 0)); }
};
}  // namespace

TEST_F(CudaTracker, CountsBytesAndPeaks) {
  auto& t = tracker();
  const int64_t before = t.current_bytes();
  auto window = t.mark();
  {
    auto a = torch::empty({4 * kMiB}, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
    EXPECT_EQ(t.current_bytes() - before, 16 * kMiB);
    {
      auto phase = t.phase("inner");
      auto b = torch::empty({8 * kMiB}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
    }
    EXPECT_EQ(window.peak_bytes() - window.entry_bytes(), 24 * kMiB);
  }
  EXPECT_EQ(t.current_bytes(), before);
  window.close();
  EXPECT_EQ(window.peak_bytes() - window.entry_bytes(), 24 * kMiB);
  EXPECT_EQ(t.phase_stats().at("inner").peak_increase_bytes, 8 * kMiB);
  EXPECT_GE(t.reserved_bytes(), t.current_bytes());
}

TEST_F(CudaTracker, BudgetRaisesARecoverableOutOfMemory) {
  auto& t = tracker();
  t.release_cache();
  t.set_budget(256 * kMiB);
  bool raised = false;
  try {
    auto big = torch::empty({1024 * kMiB}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
  } catch (const std::exception& e) {
    raised = framefit::memory::is_out_of_memory(e);
    EXPECT_TRUE(raised) << e.what();
  }
  EXPECT_TRUE(raised);
  t.set_budget(0);
  EXPECT_NO_THROW(torch::empty({1024 * kMiB}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA)));
}

TEST_F(CudaTracker, ExtractOnCudaMatchesCpu) {
  framefit::models::ResNet net(framefit::models::ResNetOptions(18).num_classes(0));
  net->eval();
  const auto frames = torch::randint(0, 256, {12, 3, 64, 64}).to(torch::kUInt8);
  auto on_cpu = framefit::engine::extract_features([&](const torch::Tensor& x) { return net->forward(x); },
                                                   frames);
  net->to(torch::kCUDA);
  framefit::engine::ExtractOptions options;
  options.device = torch::Device(torch::kCUDA, 0);
  options.chunk = 5;
  auto window = tracker().mark();
  auto on_gpu = framefit::engine::extract_features([&](const torch::Tensor& x) { return net->forward(x); },
                                                   frames, options);
  EXPECT_GT(window.peak_bytes() - window.entry_bytes(), 0);
  // TF32 convolutions on Hopper: compare loosely.
  EXPECT_LE((on_gpu - on_cpu).abs().max().item<double>() / on_cpu.abs().max().item<double>(), 1e-2);
}
