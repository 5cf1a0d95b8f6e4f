#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "test_util.h"

#include "framefit/engine/extract.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"

using namespace framefit;

TEST(Extract, ChunkedEqualsWholeVideo) {
  models::ResNet net(models::ResNetOptions(18).num_classes(0));
  net->to(torch::kFloat64);
  net->eval();
  const auto frames = torch::randn({10, 3, 32, 32}, torch::kFloat64);
  auto encoder = [&](const torch::Tensor& x) { return net->forward(x); };
  engine::ExtractOptions whole;
  whole.chunk = 10;
  whole.dtype = torch::kFloat64;
  engine::ExtractOptions chunked = whole;
  chunked.chunk = 3;
  int64_t last_progress = 0;
  chunked.on_progress = [&](int64_t done, int64_t total) {
    EXPECT_EQ(total, 10);
    EXPECT_GT(done, last_progress);
    last_progress = done;
  };
  const auto a = engine::extract_features(encoder, frames, whole);
  const auto b = engine::extract_features(encoder, frames, chunked);
  EXPECT_EQ(last_progress, 10);
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{10, 512}));
  EXPECT_EQ(b.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-6));
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(a, net->forward(frames).to(torch::kFloat32), 1e-6, 1e-6));
}

TEST(Extract, MemoryIsBoundedByTheChunkNotTheVideo) {
  models::ResNet net(models::ResNetOptions(18).num_classes(0));
  net->eval();
  auto encoder = [&](const torch::Tensor& x) { return net->forward(x); };
  auto peak_for = [&](int64_t frames_count, int64_t chunk) {
    const auto frames = torch::randint(0, 256, {frames_count, 3, 96, 96}).to(torch::kUInt8);
    engine::ExtractOptions options;
    options.chunk = chunk;
    engine::extract_features(encoder, frames, options);  // warm-up: oneDNN caches
    auto window = memory::Tracker::cpu().mark();
    engine::extract_features(encoder, frames, options);
    return window.peak_bytes() - window.entry_bytes();
  };
  const int64_t short_video = peak_for(8, 4);
  const int64_t long_video = peak_for(64, 4);
  const int64_t one_pass = peak_for(64, 64);
  // Four times the frames: only the [T,512] float features grow (96 KiB more here).
  EXPECT_LE(long_video - short_video, 64 * 512 * 4) << short_video << " vs " << long_video;
  // All frames at once holds far more activations than 4 at a time.
  EXPECT_GT(one_pass, 3 * long_video) << one_pass << " vs " << long_video;
}

TEST(Extract, Uint8FramesAreNormalisedPerChunk) {
  const auto frames = torch::full({2, 3, 4, 4}, 255, torch::kUInt8);
  const auto x = engine::frames_to_input(frames, torch::kCPU, torch::kFloat32);
  EXPECT_NEAR(x[0][0][0][0].item<float>(), (1.0 - 0.485) / 0.229, 1e-5);
  EXPECT_NEAR(x[1][2][3][3].item<float>(), (1.0 - 0.406) / 0.225, 1e-5);
  const auto floats = torch::randn({1, 3, 4, 4});
  EXPECT_TRUE(torch::equal(engine::frames_to_input(floats, torch::kCPU, torch::kFloat32), floats));
  EXPECT_TRUE(engine::frames_to_input(floats, torch::kCPU, torch::kFloat32, true)
                  .is_contiguous(torch::MemoryFormat::ChannelsLast));
}

TEST(Extract, BadInputIsExplained) {
  auto identity = [](const torch::Tensor& x) { return x.flatten(1); };
  EXPECT_NE(framefit::test_util::error_message([&] { engine::extract_features(identity, torch::zeros({0, 3, 8, 8})); })
                .find("T = 0"),
            std::string::npos);
  EXPECT_NE(framefit::test_util::error_message([&] { engine::extract_features(identity, torch::zeros({4, 8, 8, 3})); })
                .find("[T,H,W,3]"),
            std::string::npos);
  EXPECT_NE(framefit::test_util::error_message([&] {
              engine::extract_features(identity, torch::zeros({4, 3, 8, 8}, torch::kInt32));
            }).find("uint8"),
            std::string::npos);
  // Float frames are taken as normalised; a NaN pixel gave its frame NaN features silently.
  auto frames = torch::zeros({4, 3, 8, 8});
  frames[2][1][3][3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(framefit::test_util::error_message([&] {
              engine::extract_features(identity, frames);
            }).find("frame 2 has pixels that are not finite"),
            std::string::npos);
  engine::ExtractOptions zero_chunk;
  zero_chunk.chunk = 0;
  EXPECT_NE(framefit::test_util::error_message([&] { engine::extract_features(identity, torch::zeros({4, 3, 8, 8}), zero_chunk); })
                .find("chunk must be >= 1"),
            std::string::npos);
}
