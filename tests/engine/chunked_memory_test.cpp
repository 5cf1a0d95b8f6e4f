// Memory of chunked training, measured with the tracking allocator (slow: hundreds of frames).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

#include "framefit/engine/chunked.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"

using namespace framefit;

namespace {
torch::Tensor video(int64_t frames, int64_t size) {
  return torch::randint(0, 256, {frames, 3, size, size}, torch::kUInt8);
}

// Peak tensor bytes of one forward + backward above what was in use before it.
int64_t step_peak(const engine::FrameEncoder& encoder, const torch::Tensor& frames, int64_t chunk) {
  engine::ChunkedOptions options;
  options.chunk = chunk;
  auto window = memory::Tracker::cpu().mark();
  auto features = engine::chunked_encode(encoder, frames, options);
  features.square().sum().backward();
  features = torch::Tensor();
  return window.peak_bytes() - window.entry_bytes();
}

}  // namespace

TEST(ChunkedMemory, PeakDoesNotGrowWithVideoLength) {
  models::ResNet net(models::ResNetOptions(18).num_classes(0).norm(models::NormKind::GroupNorm).groups(8));
  const auto encoder = engine::frame_encoder(net.ptr());
  step_peak(encoder, video(16, 64), 8);  // warm-up
  const auto short_frames = video(32, 64);
  const auto long_frames = video(256, 64);
  const int64_t short_peak = step_peak(encoder, short_frames, 8);
  const int64_t long_peak = step_peak(encoder, long_frames, 8);
  // Only the per-frame features and their gradient (and a few [T,D] temporaries) grow.
  const int64_t per_frame = 512 * 4;
  EXPECT_LE(long_peak, short_peak + 4 * (256 - 32) * per_frame + short_peak / 10)
      << "T=32: " << short_peak << " B, T=256: " << long_peak << " B";
}

TEST(ChunkedMemory, BudgetThatNaiveTrainingExceedsButChunkedFits) {
  models::ResNet net(models::ResNetOptions(18).num_classes(0).norm(models::NormKind::FrozenBatchNorm));
  const auto encoder = engine::frame_encoder(net.ptr());
  const auto frames = video(256, 64);
  const int64_t chunked_peak = step_peak(encoder, frames, 16);
  net->zero_grad();
  auto& tracker = memory::Tracker::cpu();
  memory::ScopedBudget budget(tracker, tracker.current_bytes() + chunked_peak * 5 / 4);
  bool naive_failed = false;
  try {
    step_peak(encoder, frames, 0);
  } catch (const memory::OutOfMemoryError& e) {
    naive_failed = true;
  }
  EXPECT_TRUE(naive_failed) << "naive training of 256 frames fit in " << chunked_peak * 5 / 4 << " B";
  net->zero_grad();
  EXPECT_NO_THROW(step_peak(encoder, frames, 16));
}

TEST(ChunkedMemory, InferenceRunsChunkByChunk) {
  // Without grad (evaluation, predict) the chunks run one after another: from T = 32 to T = 256
  // the peak grows by the features only, where one pass over the video would grow with every
  // frame's activations. In eval mode (BatchNorm on its running statistics) the features equal
  // one pass's.
  models::ResNet net(models::ResNetOptions(18).num_classes(0).norm(models::NormKind::BatchNorm));
  net->eval();
  const auto encoder = engine::frame_encoder(net.ptr());
  const auto peak_and_features = [&](const torch::Tensor& frames, int64_t chunk) {
    torch::InferenceMode inference;
    engine::ChunkedOptions options;
    options.chunk = chunk;
    auto window = memory::Tracker::cpu().mark();
    auto features = engine::chunked_encode(encoder, frames, options);
    return std::make_pair(window.peak_bytes() - window.entry_bytes(), features);
  };
  peak_and_features(video(16, 64), 8);  // warm-up
  const auto short_frames = video(32, 64), long_frames = video(256, 64);
  const auto [short_peak, short_features] = peak_and_features(short_frames, 8);
  const auto [long_peak, long_features] = peak_and_features(long_frames, 8);
  const int64_t per_frame = 512 * 4;
  EXPECT_LE(long_peak, short_peak + 2 * (256 - 32) * per_frame + short_peak / 10)
      << "T=32: " << short_peak << " B, T=256: " << long_peak << " B";
  const auto [one_pass_peak, one_pass] = peak_and_features(long_frames, 0);
  EXPECT_GT(one_pass_peak, 4 * long_peak);
  EXPECT_EQ(long_features.sizes(), one_pass.sizes());
  EXPECT_TRUE(torch::allclose(long_features, one_pass, 1e-4, 1e-5));
}
