// framefit's R3D-18 and R(2+1)D-18 against torchvision, with reference files written by
// tests/python/reference.py (ctest runs it first as the fixture "torchvision_reference").
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>

#include "framefit/models/video_resnet.h"
#include "framefit/models/weights.h"
#include "test_util.h"

using namespace framefit::models;

namespace {
using framefit::test_util::kReferenceData;

using framefit::test_util::relative_error;

class VideoParity : public ::testing::TestWithParam<std::string> {
 protected:
  std::string arch() const { return GetParam(); }
  std::string file(const std::string& suffix) const {
    return kReferenceData + "/" + arch() + suffix;
  }
  void SetUp() override {
    if (!std::ifstream(file(".pt")).good()) {
      GTEST_SKIP() << "no reference data in " << kReferenceData
                   << ": run through ctest, which runs tests/python/reference.py first";
    }
  }
};
}  // namespace

TEST_P(VideoParity, SameParameterNamesInTheSameOrder) {
  const auto expected = framefit::test_util::read_lines(file("_keys.txt"));
  std::vector<std::string> ours;
  for (const auto& entry : state_dict(*VideoResNet(VideoResNetOptions(arch())))) {
    ours.push_back(entry.first);
  }
  EXPECT_EQ(ours, expected);
}

TEST_P(VideoParity, LogitsAndFeaturesMatch) {
  torch::NoGradGuard no_grad;
  // The file is an OrderedDict state_dict: strict loading proves every key was read.
  const auto state = read_state_dict(file(".pt"));
  const auto x = read_tensor(kReferenceData + "/video_input.pt");

  VideoResNet classifier{VideoResNetOptions(arch())};
  const auto report = load_state_dict(*classifier, state);
  EXPECT_TRUE(report.complete()) << report.describe();
  classifier->eval();
  const double logits_error =
      relative_error(classifier->forward(x), read_tensor(file("_logits.pt")));
  RecordProperty("logits_relative_error", std::to_string(logits_error));
  EXPECT_LE(logits_error, 1e-4);

  LoadOptions ignore_fc;
  ignore_fc.ignore_prefixes = {"fc."};
  VideoResNet encoder(VideoResNetOptions(arch()).num_classes(0));
  EXPECT_TRUE(load_state_dict(*encoder, state, ignore_fc).complete());
  encoder->eval();
  const double features_error =
      relative_error(encoder->forward(x), read_tensor(file("_features.pt")));
  RecordProperty("features_relative_error", std::to_string(features_error));
  EXPECT_LE(features_error, 1e-4);
  std::cout << arch() << ": relative error " << logits_error << " (logits), " << features_error
            << " (features) against torchvision\n";
}

TEST_P(VideoParity, SavedWeightsLoadInPyTorchAndGiveTheSameOutputs) {
  // Train-mode steps change every parameter and BatchNorm statistic; then PyTorch must load
  // the saved file strictly and reproduce framefit's eval-mode logits.
  VideoResNet model(VideoResNetOptions(arch()).num_classes(10));
  torch::optim::SGD sgd(model->parameters(), 0.01);
  model->train();
  for (int step = 0; step < 2; ++step) {
    sgd.zero_grad();
    model->forward(torch::randn({2, 3, 4, 32, 32})).logsumexp(1).mean().backward();
    sgd.step();
  }
  model->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 3, 4, 32, 32});
  const std::string weights = file("_from_framefit.pt");
  const std::string input = file("_from_framefit_input.pt");
  const std::string expected = file("_from_framefit_logits.pt");
  write_state_dict(state_dict(*model), weights);
  write_tensor(x, input);
  write_tensor(model->forward(x), expected);
  const std::string command = std::string(FRAMEFIT_PYTHON) + " " + FRAMEFIT_SOURCE_DIR +
                              "/tests/python/reference.py check-load " + arch() + " " + weights +
                              " " + input + " " + expected;
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

INSTANTIATE_TEST_SUITE_P(VideoResNets, VideoParity, ::testing::Values("r3d_18", "r2plus1d_18"),
                         [](const auto& info) { return info.param; });
