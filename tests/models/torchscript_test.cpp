// Encoders from TorchScript: a module scripted and saved by Python (tests/python/reference.py)
// trains in C++ with Python's loss and gradients, and through the chunked engine exactly.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>

#include "test_util.h"

#include "framefit/engine/chunked.h"
#include "framefit/models/torchscript.h"
#include "framefit/models/weights.h"

using namespace framefit;

namespace {
using framefit::test_util::kReferenceData;

class TorchScript : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::ifstream(kReferenceData + "/tiny_encoder.pt").good()) {
      GTEST_SKIP() << "no reference data in " << kReferenceData
                   << ": run through ctest, which runs tests/python/reference.py first";
    }
  }
};
}  // namespace

TEST_F(TorchScript, TrainingStepMatchesPythonsLossAndGradients) {
  models::TorchScriptEncoder encoder(kReferenceData + "/tiny_encoder.pt");
  encoder->train();
  std::map<std::string, torch::Tensor> reference;
  for (auto& [name, tensor] :
       models::read_state_dict(kReferenceData + "/tiny_encoder_reference.pt")) {
    reference[name] = tensor;
  }
  const auto x = models::read_tensor(kReferenceData + "/tiny_encoder_input.pt");
  auto loss = encoder->forward(x).pow(2).mean();
  loss.backward();
  EXPECT_NEAR(loss.item<double>(), reference.at("loss").item<double>(), 1e-12);
  int checked = 0;
  for (const auto& [name, tensor] : encoder->named_state()) {
    if (tensor.requires_grad()) {
      const auto& want = reference.at("grad." + name);
      EXPECT_TRUE(torch::allclose(tensor.grad(), want, 1e-10, 1e-12)) << name;
    } else {
      EXPECT_TRUE(torch::allclose(tensor.to(torch::kDouble),
                                  reference.at("buffer." + name).to(torch::kDouble)))
          << name << " (BatchNorm statistics)";
    }
    ++checked;
  }
  EXPECT_EQ(checked, 4 + 4 + 1);  // conv, bn affine, fc; bn statistics and counter
  // The optimizer sees the same tensors.
  EXPECT_EQ(encoder->parameters().size(), 6u);
}

TEST_F(TorchScript, ChunkedEngineGradientsEqualNaive) {
  models::TorchScriptEncoder encoder(kReferenceData + "/tiny_encoder.pt");
  encoder->eval();  // BatchNorm statistics per chunk would differ from the whole batch's
  const auto frames = models::read_tensor(kReferenceData + "/tiny_encoder_input.pt");
  const auto frame_encoder = engine::frame_encoder(
      encoder.ptr(), [encoder](const torch::Tensor& x) mutable { return encoder->forward(x); });
  auto grads = [&](int64_t chunk) {
    encoder->zero_grad();
    engine::ChunkedOptions options;
    options.chunk = chunk;
    options.dtype = torch::kDouble;
    engine::chunked_encode(frame_encoder, frames, options).pow(2).mean().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : encoder->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto naive = grads(0);
  const auto chunked = grads(3);
  for (size_t i = 0; i < naive.size(); ++i) {
    EXPECT_TRUE(torch::allclose(chunked[i], naive[i], 1e-10, 1e-12)) << "parameter " << i;
  }
}

TEST(TorchScriptErrors, DamagedFileIsAnErrorNotWrongWeights) {
#if !FRAMEFIT_WITH_LIBZIP
  GTEST_SKIP() << "built without libzip: archives are not checked";
#endif
  // torch::jit::load skips the zip's CRC-32s: one changed byte of a weight loaded without a word.
  const std::string path = "/tmp/framefit_damaged_script.pt";
  test_util::write_script_module(path, {{"w", torch::full({256}, 1.5f)}},
                                 "def forward(self, x):\n  return x * self.w.sum()\n");
  EXPECT_EQ(models::TorchScriptEncoder(path)->named_state()[0].second[7].item<float>(), 1.5f);
  auto bytes = test_util::read_bytes(path);
  const std::string one_and_a_half("\x00\x00\xc0\x3f", 4);
  const auto at = bytes.find(one_and_a_half + one_and_a_half);
  ASSERT_NE(at, std::string::npos);
  bytes[at + 2] = '\x40';  // 1.5 becomes 3.0
  test_util::write_bytes(path, bytes);
  const auto e = test_util::error_message([&] { models::TorchScriptEncoder encoder(path); });
  EXPECT_NE(e.find("TorchScript encoder " + path + " is damaged: its entry"), std::string::npos)
      << e;
  EXPECT_NE(e.find("CRC error"), std::string::npos) << e;
  std::remove(path.c_str());
}

TEST(TorchScriptErrors, MissingOrBadFileIsNamed) {
  try {
    models::TorchScriptEncoder encoder("/nonexistent/encoder.pt");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/encoder.pt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("torch.jit.save"), std::string::npos);
  }
}
