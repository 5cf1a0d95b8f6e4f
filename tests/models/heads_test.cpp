#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

#include "framefit/engine/loss.h"
#include "framefit/models/heads.h"

using namespace framefit;

namespace {
// True if outputs up to frame `t` ignore every later frame.
bool is_causal(models::TemporalHead& head, int64_t frames, int64_t t) {
  torch::NoGradGuard no_grad;
  head.eval();
  auto x = torch::randn({frames, 16});
  auto changed = x.clone();
  changed.slice(0, t + 1).add_(torch::randn({frames - t - 1, 16}));
  return torch::allclose(head.forward(x).slice(1, 0, t + 1), head.forward(changed).slice(1, 0, t + 1),
                         1e-5, 1e-6);
}
}  // namespace

TEST(Heads, ShapesAndCausality) {
  models::LinearHead linear(models::LinearHeadOptions(16, 7));
  EXPECT_EQ(linear->forward(torch::randn({20, 16})).sizes(), (std::vector<int64_t>{1, 20, 7}));
  models::LSTMHead lstm(models::LSTMHeadOptions(16, 7).hidden(32));
  EXPECT_EQ(lstm->forward(torch::randn({20, 16})).sizes(), (std::vector<int64_t>{1, 20, 7}));
  EXPECT_TRUE(is_causal(*lstm, 20, 9));
  models::LSTMHead bidirectional(models::LSTMHeadOptions(16, 7).hidden(32).bidirectional(true));
  EXPECT_EQ(bidirectional->forward(torch::randn({20, 16})).size(2), 7);
  EXPECT_FALSE(is_causal(*bidirectional, 20, 9));
  models::TCNHead tcn(models::TCNHeadOptions(16, 7).stages(3).layers(4).channels(8));
  EXPECT_EQ(tcn->forward(torch::randn({50, 16})).sizes(), (std::vector<int64_t>{3, 50, 7}));
  EXPECT_TRUE(is_causal(*tcn, 50, 20));
  EXPECT_EQ(tcn->receptive_field(), 3 * 2 * 15 + 1);
  models::TCNHead acausal(models::TCNHeadOptions(16, 7).layers(3).channels(8).causal(false));
  EXPECT_FALSE(is_causal(*acausal, 50, 20));
  EXPECT_EQ(models::make_head("tcn", 16, 7)->num_classes(), 7);
  EXPECT_THROW(models::make_head("gru", 16, 7), c10::Error);
}

TEST(Heads, WrongFeatureSizeIsExplained) {
  models::LSTMHead lstm(models::LSTMHeadOptions(16, 7));
  try {
    lstm->forward(torch::randn({5, 32}));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("expects 16-d features"), std::string::npos);
  }
  EXPECT_THROW(lstm->forward(torch::randn({1, 5, 16})), c10::Error);
}

TEST(PhaseLoss, CrossEntropyWeightsSmoothingAndChecks) {
  auto logits = torch::randn({2, 10, 4});
  auto labels = torch::randint(0, 4, {10}, torch::kLong);
  auto expected = torch::nn::functional::cross_entropy(logits[0], labels) +
                  torch::nn::functional::cross_entropy(logits[1], labels);
  EXPECT_TRUE(torch::allclose(engine::phase_loss(logits, labels), expected));

  engine::PhaseLossOptions weighted;
  weighted.class_weights = torch::tensor({1.0, 2.0, 0.5, 1.0});
  EXPECT_TRUE(torch::allclose(
      engine::phase_loss(logits[0], labels, weighted),
      torch::nn::functional::cross_entropy(
          logits[0], labels, torch::nn::functional::CrossEntropyFuncOptions().weight(weighted.class_weights))));

  engine::PhaseLossOptions smooth;
  smooth.smoothing = 0.15;
  auto constant = torch::randn({1, 4}).expand({10, 4}).contiguous();
  EXPECT_TRUE(torch::allclose(engine::phase_loss(constant, labels, smooth), engine::phase_loss(constant, labels)));
  EXPECT_GT(engine::phase_loss(logits[0], labels, smooth).item<double>(),
            engine::phase_loss(logits[0], labels).item<double>());

  // Label smoothing x: (1 - x) times the cross-entropy plus x times the mean over classes of
  // -log p, as PyTorch defines it.
  engine::PhaseLossOptions smoothed;
  smoothed.label_smoothing = 0.2;
  const auto log_p = torch::log_softmax(logits[0], 1);
  const auto by_hand =
      0.8 * torch::nn::functional::cross_entropy(logits[0], labels) + 0.2 * (-log_p.mean(1)).mean();
  EXPECT_TRUE(torch::allclose(engine::phase_loss(logits[0], labels, smoothed), by_hand));

  auto ignored = labels.clone();
  ignored[3] = -100;
  EXPECT_NO_THROW(engine::phase_loss(logits, ignored));
  auto message = [&](const torch::Tensor& l) {
    return test_util::error_message([&] { engine::phase_loss(logits, l); });
  };
  EXPECT_NE(message(torch::zeros({9}, torch::kLong)).find("one label per frame"), std::string::npos);
  EXPECT_NE(message(torch::full({10}, 4, torch::kLong)).find("[0, 4)"), std::string::npos);
}

namespace {
// The head's output and gradients (features, then every parameter) for a fixed upstream grad.
std::vector<torch::Tensor> head_gradients(models::LSTMHeadImpl& head, const torch::Tensor& features,
                                          const torch::Tensor& upstream, bool reference) {
  head.zero_grad();
  auto x = features.detach().requires_grad_(true);
  const auto logits = reference ? head.fc(std::get<0>(head.lstm(x.unsqueeze(0)))) : head.forward(x);
  (logits * upstream).sum().backward();
  std::vector<torch::Tensor> result{logits.detach(), x.grad()};
  for (const auto& p : head.parameters()) result.push_back(p.grad().clone());
  return result;
}
}  // namespace

// The LSTM head's own CPU layer (one matrix product for each weight gradient) computes what
// LibTorch's LSTM module computes, in every shape the head supports.
TEST(Heads, LstmLayerMatchesLibTorchLstm) {
  torch::manual_seed(5);
  struct Case {
    int64_t layers;
    bool bidirectional;
    int64_t frames;
  };
  for (const auto dtype : {torch::kDouble, torch::kFloat}) {
    for (const auto& c : {Case{1, false, 37}, Case{2, true, 23}, Case{1, true, 1}}) {
      SCOPED_TRACE(::testing::Message() << "dtype " << dtype << ", layers " << c.layers
                                        << ", bidirectional " << c.bidirectional << ", T "
                                        << c.frames);
      models::LSTMHead head(
          models::LSTMHeadOptions(12, 5).hidden(16).layers(c.layers).bidirectional(c.bidirectional));
      head->to(dtype);
      const auto features = torch::randn({c.frames, 12}, dtype);
      const auto upstream = torch::randn({1, c.frames, 5}, dtype);
      const auto ours = head_gradients(*head, features, upstream, false);
      const auto expected = head_gradients(*head, features, upstream, true);
      ASSERT_EQ(ours.size(), expected.size());
      const double tolerance = dtype == torch::kDouble ? 1e-10 : 1e-4;
      for (size_t i = 0; i < ours.size(); ++i) {
        const double scale = expected[i].abs().max().item<double>() + 1e-12;
        EXPECT_LT((ours[i] - expected[i]).abs().max().item<double>() / scale, tolerance)
            << "tensor " << i << " (0: logits, 1: features' gradient, then parameters)";
      }
    }
  }
}
