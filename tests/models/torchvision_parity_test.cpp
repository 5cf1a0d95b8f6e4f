// framefit's ResNets against torchvision, with reference files written by
// tests/python/reference.py (ctest runs it first as the fixture "torchvision_reference").
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>

#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"

using namespace framefit::models;

namespace {
const std::string kData = FRAMEFIT_TEST_DATA_DIR;

double relative_error(const torch::Tensor& got, const torch::Tensor& expected) {
  return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item<double>();
}

class TorchvisionParity : public ::testing::TestWithParam<int64_t> {
 protected:
  std::string arch() const { return "resnet" + std::to_string(GetParam()); }
  void SetUp() override {
    if (!std::ifstream(kData + "/" + arch() + ".pt").good()) {
      GTEST_SKIP() << "no reference data in " << kData
                   << ": run through ctest, which runs tests/python/reference.py first";
    }
  }
};
}  // namespace

TEST_P(TorchvisionParity, SameParameterNamesInTheSameOrder) {
  std::ifstream keys(kData + "/" + arch() + "_keys.txt");
  std::vector<std::string> expected;
  for (std::string line; std::getline(keys, line);) expected.push_back(line);
  std::vector<std::string> ours;
  for (const auto& entry : state_dict(*ResNet(ResNetOptions(GetParam())))) {
    ours.push_back(entry.first);
  }
  EXPECT_EQ(ours, expected);
}

TEST_P(TorchvisionParity, LogitsAndFeaturesMatch) {
  torch::NoGradGuard no_grad;
  // The file is an OrderedDict state_dict: strict loading proves every key was read.
  const auto state = read_state_dict(kData + "/" + arch() + ".pt");
  const auto x = read_tensor(kData + "/input.pt");

  ResNet classifier{ResNetOptions(GetParam())};
  EXPECT_TRUE(load_state_dict(*classifier, state).complete());
  classifier->eval();
  EXPECT_LE(relative_error(classifier->forward(x), read_tensor(kData + "/" + arch() + "_logits.pt")),
            1e-4);

  LoadOptions ignore_fc;
  ignore_fc.ignore_prefixes = {"fc."};
  ResNet encoder(ResNetOptions(GetParam()).num_classes(0));
  EXPECT_TRUE(load_state_dict(*encoder, state, ignore_fc).complete());
  encoder->eval();
  EXPECT_LE(relative_error(encoder->forward(x), read_tensor(kData + "/" + arch() + "_features.pt")),
            1e-4);

  ResNet nhwc(ResNetOptions(GetParam()).channels_last(true));
  load_state_dict(*nhwc, state);
  nhwc->eval();
  EXPECT_LE(relative_error(nhwc->forward(x), read_tensor(kData + "/" + arch() + "_logits.pt")),
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
  const std::string weights = kData + "/" + arch() + "_from_framefit.pt";
  const std::string input = kData + "/" + arch() + "_from_framefit_input.pt";
  const std::string expected = kData + "/" + arch() + "_from_framefit_logits.pt";
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
