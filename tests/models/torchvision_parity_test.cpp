// framefit's ResNets against torchvision, with reference files written by
// tests/python/reference.py (ctest runs it first as the fixture "torchvision_reference").
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>

#include "framefit/data/dataset.h"
#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"
#include "test_util.h"

using namespace framefit::models;

namespace {
using framefit::test_util::kReferenceData;

using framefit::test_util::relative_error;

class TorchvisionParity : public ::testing::TestWithParam<int64_t> {
 protected:
  std::string arch() const { return "resnet" + std::to_string(GetParam()); }
  void SetUp() override {
    if (!std::ifstream(kReferenceData + "/" + arch() + ".pt").good()) {
      GTEST_SKIP() << "no reference data in " << kReferenceData
                   << ": run through ctest, which runs tests/python/reference.py first";
    }
  }
};
}  // namespace

TEST_P(TorchvisionParity, SameParameterNamesInTheSameOrder) {
  const auto expected =
      framefit::test_util::read_lines(kReferenceData + "/" + arch() + "_keys.txt");
  std::vector<std::string> ours;
  for (const auto& entry : state_dict(*ResNet(ResNetOptions(GetParam())))) {
    ours.push_back(entry.first);
  }
  EXPECT_EQ(ours, expected);
}

TEST_P(TorchvisionParity, LogitsAndFeaturesMatch) {
  torch::NoGradGuard no_grad;
  // The file is an OrderedDict state_dict: strict loading proves every key was read.
  const auto state = read_state_dict(kReferenceData + "/" + arch() + ".pt");
  const auto x = read_tensor(kReferenceData + "/input.pt");

  ResNet classifier{ResNetOptions(GetParam())};
  EXPECT_TRUE(load_state_dict(*classifier, state).complete());
  classifier->eval();
  EXPECT_LE(relative_error(classifier->forward(x),
                           read_tensor(kReferenceData + "/" + arch() + "_logits.pt")),
            1e-4);

  LoadOptions ignore_fc;
  ignore_fc.ignore_prefixes = {"fc."};
  ResNet encoder(ResNetOptions(GetParam()).num_classes(0));
  EXPECT_TRUE(load_state_dict(*encoder, state, ignore_fc).complete());
  encoder->eval();
  EXPECT_LE(relative_error(encoder->forward(x),
                           read_tensor(kReferenceData + "/" + arch() + "_features.pt")),
            1e-4);

  ResNet nhwc(ResNetOptions(GetParam()).channels_last(true));
  load_state_dict(*nhwc, state);
  nhwc->eval();
  EXPECT_LE(
      relative_error(nhwc->forward(x), read_tensor(kReferenceData + "/" + arch() + "_logits.pt")),
      1e-4);
}

TEST_P(TorchvisionParity, SavedWeightsLoadInPyTorchAndGiveTheSameOutputs) {
  // Train-mode steps change every parameter and BatchNorm statistic; then PyTorch must load
  // the saved file strictly and reproduce framefit's eval-mode logits.
  ResNet model(ResNetOptions(GetParam()).num_classes(10));
  torch::optim::SGD sgd(model->parameters(), 0.01);
  model->train();
  for (int step = 0; step < 2; ++step) {
    sgd.zero_grad();
    model->forward(torch::randn({4, 3, 64, 64})).logsumexp(1).mean().backward();
    sgd.step();
  }
  model->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 3, 64, 64});
  const std::string weights = kReferenceData + "/" + arch() + "_from_framefit.pt";
  const std::string input = kReferenceData + "/" + arch() + "_from_framefit_input.pt";
  const std::string expected = kReferenceData + "/" + arch() + "_from_framefit_logits.pt";
  write_state_dict(state_dict(*model), weights);
  write_tensor(x, input);
  write_tensor(model->forward(x), expected);
  const std::string command = std::string(FRAMEFIT_PYTHON) + " " + FRAMEFIT_SOURCE_DIR +
                              "/tests/python/reference.py check-load " + arch() + " " + weights +
                              " " + input + " " + expected;
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

INSTANTIATE_TEST_SUITE_P(ResNets, TorchvisionParity, ::testing::Values(18, 50),
                         [](const auto& info) { return "resnet" + std::to_string(info.param); });

// The training colour jitter (data.brightness ... data.hue) and rotation (data.rotation) against
// torchvision's ColorJitter functions and rotate on the same uint8 frames: the same bytes, each
// alone and in a jittered order.
TEST(AugmentationParity, SameBytesAsTorchvision) {
  if (!std::ifstream(kReferenceData + "/colors_input.pt").good()) {
    GTEST_SKIP() << "no reference data in " << kReferenceData << ": run through ctest";
  }
  const auto frames = read_tensor(kReferenceData + "/colors_input.pt");
  const auto check = [&](const std::string& name, framefit::data::Augmentation a) {
    const auto expected = read_tensor(kReferenceData + "/colors_" + name + ".pt");
    const auto got = framefit::data::adjust_colors(frames, a);
    const auto differ = got.ne(expected).sum().item<int64_t>();
    EXPECT_EQ(differ, 0)
        << name << ": " << differ << " of " << got.numel() << " bytes differ, largest difference "
        << (got.to(torch::kInt) - expected.to(torch::kInt)).abs().max().item<int>();
  };
  framefit::data::Augmentation a;
  a.brightness = 1.3;
  check("brightness", a);
  a = {};
  a.contrast = 0.6;
  check("contrast", a);
  a = {};
  a.saturation = 1.7;
  check("saturation", a);
  a = {};
  a.hue = 0.21;
  check("hue", a);
  a.hue = -0.37;
  check("hue_negative", a);
  a = {};
  a.jitter_order = {3, 1, 0, 2};
  a.hue = 0.1, a.contrast = 1.2, a.brightness = 0.8, a.saturation = 0.5;
  check("sequence", a);
  for (const auto& [name, degrees] : {std::pair{"rotated", 7.3}, {"rotated_negative", -23.0}}) {
    const auto expected = read_tensor(kReferenceData + "/colors_" + std::string(name) + ".pt");
    const auto got = framefit::data::rotate_frames(frames, degrees);
    EXPECT_EQ(got.ne(expected).sum().item<int64_t>(), 0) << name;
  }
}
