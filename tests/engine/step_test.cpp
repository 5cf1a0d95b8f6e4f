#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "test_util.h"

#include "framefit/engine/amp.h"
#include "framefit/engine/step.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"

using namespace framefit;

namespace {
framefit::Video make_video(int64_t frames, uint64_t seed, int64_t classes = 3, int64_t size = 32) {
  auto gen = at::detail::createCPUGenerator(seed);
  return {torch::randint(0, 256, {frames, 3, size, size}, gen, torch::kUInt8),
          torch::randint(0, classes, {frames}, gen, torch::kLong), "video" + std::to_string(seed)};
}

struct Setup {
  models::ResNet encoder{nullptr};
  std::shared_ptr<models::TemporalHead> head;
  std::unique_ptr<engine::TrainingStep> step;
};

Setup make_setup(engine::StepOptions options, torch::ScalarType dtype = torch::kFloat32,
                 const std::string& optimizer = "sgd", double lr = 0.01,
                 models::NormKind norm = models::NormKind::GroupNorm) {
  torch::manual_seed(7);
  Setup s;
  s.encoder = models::ResNet(models::ResNetOptions(18).num_classes(0).norm(norm).groups(8));
  s.head = models::make_head("lstm", 512, 3);
  s.encoder->to(dtype);
  s.head->to(dtype);
  auto encoder = engine::frame_encoder(s.encoder.ptr());
  auto params = encoder.parameters;
  for (auto& p : s.head->parameters()) params.push_back(p);
  engine::OptimizerOptions opt;
  opt.kind = optimizer;
  opt.lr = lr;
  opt.weight_decay = 0;
  options.chunked.dtype = dtype;
  s.step = std::make_unique<engine::TrainingStep>(
      encoder, s.head, engine::make_optimizer(params, opt), options, memory::Tracker::cpu());
  return s;
}

std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Weights and BatchNorm statistics (running mean, variance, batches tracked).
std::vector<torch::Tensor> state_of(const Setup& s) {
  auto out = snapshot(s.step->parameters());
  for (const auto& b : s.encoder->buffers()) out.push_back(b.clone());
  return out;
}

// One step under a tracker budget, lifted however the step ends.
engine::StepReport step_within_budget(Setup& s, const framefit::Video& video, int64_t budget) {
  auto& tracker = memory::Tracker::cpu();
  tracker.set_budget(budget);
  try {
    auto report = s.step->step({video});
    tracker.set_budget(0);
    return report;
  } catch (...) {
    tracker.set_budget(0);
    throw;
  }
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}
}  // namespace

TEST(TrainingStep, AccumulationEqualsOneBatch) {
  engine::StepOptions batch_options;
  batch_options.chunked.chunk = 4;
  auto batch = make_setup(batch_options, torch::kFloat64);
  const auto a = make_video(9, 1), b = make_video(6, 2);  // different lengths
  const auto report = batch.step->step({a, b});
  EXPECT_TRUE(report.optimizer_stepped);
  EXPECT_EQ(report.frames, 15);

  engine::StepOptions accumulate_options = batch_options;
  accumulate_options.accumulate = 2;
  auto accumulated = make_setup(accumulate_options, torch::kFloat64);
  int synced = 0;
  accumulated.step->on_gradients_ready = [&](const std::vector<torch::Tensor>& params) {
    ++synced;
    EXPECT_EQ(params.size(), accumulated.step->parameters().size());
  };
  EXPECT_FALSE(accumulated.step->step({a}).optimizer_stepped);
  EXPECT_EQ(synced, 0);
  EXPECT_TRUE(accumulated.step->step({b}).optimizer_stepped);
  EXPECT_EQ(synced, 1);
  const auto x = snapshot(batch.step->parameters());
  const auto y = snapshot(accumulated.step->parameters());
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(torch::allclose(x[i], y[i], 1e-10, 1e-12)) << i;
}

TEST(TrainingStep, ReportsPhasesAndLearns) {
  engine::StepOptions options;
  options.chunked.chunk = 4;
  options.clip_grad_norm = 1.0;
  auto s = make_setup(options, torch::kFloat32, "adamw", 1e-3);
  const auto video = make_video(12, 3);
  const auto first = s.step->step({video});
  EXPECT_GT(first.grad_norm, 0);
  for (const char* phase : {"encode", "head", "recompute"}) EXPECT_EQ(first.phases.count(phase), 1u) << phase;
  EXPECT_GT(first.peak_bytes, 0);
  double last = first.loss;
  for (int i = 0; i < 15; ++i) last = s.step->step({video}).loss;
  EXPECT_LT(last, first.loss * 0.7) << "15 steps on one video should fit it";
}

TEST(TrainingStep, EncoderFrozenThroughItsLastStageTrainsTheHead) {
  // freeze layer4: nothing of the encoder trains, so it only ever runs without grad (chunk by
  // chunk, or all frames at once) and gives the pooled features; the head learns.
  torch::manual_seed(7);
  models::ResNet resnet(models::ResNetOptions(18).num_classes(0).freeze("layer4"));
  resnet->to(torch::kFloat64);
  const auto encoder = engine::frame_encoder(resnet.ptr());
  EXPECT_TRUE(encoder.parameters.empty());
  const auto video = make_video(10, 4);
  torch::Tensor expected;
  {
    torch::NoGradGuard no_grad;
    resnet->eval();  // frozen BatchNorm: the same either way
    expected =
        resnet->features(engine::frames_to_input(video.frames, torch::kCPU, torch::kFloat64));
    resnet->train();
  }
  for (const int64_t chunk : {0, 4}) {
    engine::ChunkedOptions options;
    options.chunk = chunk;
    options.dtype = torch::kFloat64;
    const auto features = engine::chunked_encode(encoder, video.frames, options);
    EXPECT_EQ(features.sizes(), expected.sizes()) << "chunk " << chunk;
    EXPECT_FALSE(features.requires_grad());
    EXPECT_LE((features - expected).abs().max().item<double>(), 1e-10) << "chunk " << chunk;
  }
  auto head = models::make_head("lstm", 512, 3);
  head->to(torch::kFloat64);
  engine::OptimizerOptions opt;
  opt.kind = "adamw";
  opt.lr = 1e-2;
  engine::StepOptions options;
  options.chunked.chunk = 4;
  options.chunked.dtype = torch::kFloat64;
  engine::TrainingStep step(encoder, head, engine::make_optimizer(head->parameters(), opt), options,
                            memory::Tracker::cpu());
  const auto before = snapshot(resnet->parameters());
  const double first = step.step({video}).loss;
  double last = first;
  for (int i = 0; i < 10; ++i) last = step.step({video}).loss;
  EXPECT_LT(last, first);
  const auto after = resnet->parameters();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i]));
}

TEST(TrainingStep, Bf16AutocastTrains) {
  FRAMEFIT_SKIP_UNLESS_CPU_BF16_RUNS();
  engine::StepOptions options;
  options.chunked.chunk = 4;
  options.precision = engine::Precision::BF16;
  auto s = make_setup(options);
  const auto report = s.step->step({make_video(8, 4)});
  EXPECT_TRUE(std::isfinite(report.loss));
  EXPECT_TRUE(report.optimizer_stepped);
  for (const auto& p : s.step->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat32);  // master weights stay float32
  }
}

TEST(TrainingStep, BadVideosAreExplained) {
  engine::StepOptions options;
  auto s = make_setup(options);
  auto video = make_video(8, 5);
  video.labels = video.labels.slice(0, 0, 7);
  try {
    s.step->step({video});
    FAIL();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("video5: 8 frames but 7 labels"), std::string::npos) << what;
  }
  EXPECT_THROW(s.step->step({}), c10::Error);
  EXPECT_THROW(engine::make_optimizer({torch::zeros({2})}, {}), c10::Error);  // frozen parameter
  // Features stand in for frames only where the encoder trains nothing: these would skip its
  // gradients.
  auto with_features = make_video(8, 6);
  with_features.features = torch::zeros({8, 16});
  EXPECT_NE(framefit::test_util::error_message([&] {
              s.step->step({with_features});
            }).find("video6: features stand in for frames only for an encoder without trained"),
            std::string::npos);
}

TEST(TrainingStep, OutOfMemoryReplansAndRetriesTheSameStep) {
  auto& tracker = memory::Tracker::cpu();
  const auto video = make_video(48, 9, 3, 112);
  // Memory a first step takes above what is in use before it (gradients, momentum, activations).
  auto first_step_increase = [&](int64_t chunk) {
    engine::StepOptions options;
    options.chunked.chunk = chunk;
    auto setup = make_setup(options);
    auto window = tracker.mark();
    setup.step->step({video});
    return std::make_pair(window.peak_bytes() - window.entry_bytes(), snapshot(setup.step->parameters()));
  };
  const auto [chunked_increase, reference] = first_step_increase(4);
  const auto naive_increase = first_step_increase(0).first;
  ASSERT_GT(naive_increase, chunked_increase * 11 / 10) << "naive training should need more memory";

  engine::StepOptions naive;
  naive.chunked.chunk = 0;
  auto forced = make_setup(naive);
  const auto report = step_within_budget(
      forced, video, tracker.current_bytes() + (naive_increase + chunked_increase) / 2);
  ASSERT_FALSE(report.replans.empty());
  EXPECT_NE(report.replans.front().find("with chunk 0 (naive)"), std::string::npos)
      << report.replans.front();
  EXPECT_GE(report.chunk, 1);
  EXPECT_LT(report.chunk, 48);
  EXPECT_TRUE(report.optimizer_stepped);
  // The retried step is the step: GroupNorm gradients do not depend on the chunk.
  const auto updated = snapshot(forced.step->parameters());
  for (size_t i = 0; i < updated.size(); ++i) {
    EXPECT_TRUE(torch::allclose(updated[i], reference[i], 1e-4, 1e-6)) << i;
  }
}

TEST(TrainingStep, LossThatIsNotFiniteLeavesWeightsAndStatisticsAsTheyWere) {
  // BatchNorm in train mode and a frame with a NaN pixel: the loss and the gradients are NaN
  // and the forward pass spoiled the running statistics. The update is skipped and the
  // statistics put back; the next step trains as usual.
  engine::StepOptions options;
  options.chunked.chunk = 4;
  auto s = make_setup(options, torch::kFloat32, "sgd", 0.01, models::NormKind::BatchNorm);
  const auto good = make_video(8, 3);
  auto bad = make_video(8, 4);
  bad.frames = bad.frames.to(torch::kFloat32).div(255);
  bad.frames[5][1][7][9] = std::numeric_limits<float>::quiet_NaN();
  const auto before = state_of(s);
  const auto skipped = s.step->step({bad});
  EXPECT_TRUE(std::isnan(skipped.loss));
  EXPECT_TRUE(skipped.not_finite_skipped);
  EXPECT_FALSE(skipped.optimizer_stepped);
  EXPECT_TRUE(all_equal(state_of(s), before));
  const auto trained = s.step->step({good});
  EXPECT_TRUE(std::isfinite(trained.loss));
  EXPECT_FALSE(trained.not_finite_skipped);
  EXPECT_TRUE(trained.optimizer_stepped);
  EXPECT_FALSE(all_equal(state_of(s), before));

  // Accumulated over two calls, a NaN in the first spoils the step the second completes.
  options.accumulate = 2;
  auto accumulated = make_setup(options, torch::kFloat32, "sgd", 0.01, models::NormKind::BatchNorm);
  const auto start = state_of(accumulated);
  EXPECT_FALSE(accumulated.step->step({bad}).optimizer_stepped);
  const auto completed = accumulated.step->step({good});
  EXPECT_TRUE(completed.not_finite_skipped);
  EXPECT_FALSE(completed.optimizer_stepped);
  EXPECT_TRUE(all_equal(state_of(accumulated), start));
}

TEST(TrainingStep, RetryAfterOutOfMemoryLeavesTheStatisticsOfOneStep) {
  // Naive training runs out of memory partway through the encoder's forward pass, after its first
  // BatchNorm layers updated their running statistics; the retry must not update them again: the
  // step ends as a step run with the retry's settings from the start.
  auto& tracker = memory::Tracker::cpu();
  const auto video = make_video(48, 9, 3, 112);
  engine::StepOptions naive;
  naive.chunked.chunk = 0;
  int64_t naive_increase = 0;  // above what is in use before a first step
  {
    auto probe = make_setup(naive, torch::kFloat32, "sgd", 0.01, models::NormKind::BatchNorm);
    auto window = tracker.mark();
    probe.step->step({video});
    naive_increase = window.peak_bytes() - window.entry_bytes();
  }
  auto forced = make_setup(naive, torch::kFloat32, "sgd", 0.01, models::NormKind::BatchNorm);
  const auto report =
      step_within_budget(forced, video, tracker.current_bytes() + naive_increase / 2);
  ASSERT_FALSE(report.replans.empty());
  engine::StepOptions retried;
  retried.chunked.chunk = report.chunk;
  retried.chunked.keep = forced.step->options().chunked.keep;
  auto direct = make_setup(retried, torch::kFloat32, "sgd", 0.01, models::NormKind::BatchNorm);
  direct.step->step({video});
  const auto a = state_of(forced), b = state_of(direct);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-4, 1e-6)) << i;
  }
}

TEST(LossScaler, SkipsOverflowBacksOffAndGrows) {
  engine::LossScalerOptions o;
  o.initial_scale = 1024;
  o.growth_interval = 2;
  engine::LossScaler scaler(o);
  auto p = torch::zeros({3}, torch::requires_grad());
  EXPECT_DOUBLE_EQ(scaler.scale(torch::ones({})).item<double>(), 1024);
  p.mutable_grad() = torch::tensor({1024.0f, 2048.0f, std::numeric_limits<float>::infinity()});
  EXPECT_FALSE(scaler.unscale({p}));
  EXPECT_FALSE(scaler.update());
  EXPECT_DOUBLE_EQ(scaler.current_scale(), 512);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  for (int i = 0; i < 2; ++i) {
    scaler.scale(torch::ones({}));
    p.mutable_grad() = torch::tensor({512.0f, 1024.0f, 0.0f});
    EXPECT_TRUE(scaler.unscale({p}));
    EXPECT_TRUE(torch::equal(p.grad(), torch::tensor({1.0f, 2.0f, 0.0f})));
    EXPECT_TRUE(scaler.update());
  }
  EXPECT_DOUBLE_EQ(scaler.current_scale(), 1024);  // grew after 2 clean steps
  engine::LossScaler restored(o);
  restored.load_state(scaler.state());
  EXPECT_DOUBLE_EQ(restored.current_scale(), 1024);
  EXPECT_EQ(restored.skipped_steps(), 1);
  engine::LossScalerOptions off;
  off.enabled = false;
  engine::LossScaler disabled(off);
  EXPECT_DOUBLE_EQ(disabled.scale(torch::ones({})).item<double>(), 1);
}

TEST(Autocast, GuardEnablesAndRestores) {
  FRAMEFIT_SKIP_UNLESS_CPU_BF16_RUNS();
  const auto before = engine::AutocastState::current();
  {
    engine::AutocastGuard guard(torch::kCPU, engine::Precision::BF16);
    auto conv = torch::nn::Conv2d(3, 4, 3);
    EXPECT_EQ(conv(torch::randn({1, 3, 8, 8})).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(engine::AutocastState::current().cpu_enabled, before.cpu_enabled);
  EXPECT_THROW(engine::AutocastGuard(torch::kCPU, engine::Precision::FP16), c10::Error);
  EXPECT_EQ(engine::parse_precision("bf16"), engine::Precision::BF16);
  EXPECT_THROW(engine::parse_precision("int8"), c10::Error);
}

TEST(TrainingStep, ToolLossIsBinaryCrossEntropyOverAnnotatedEntries) {
  const auto logits = torch::tensor({{2.0, -1.0}, {0.5, 0.0}, {-3.0, 1.5}}, torch::kFloat64);
  const auto targets = torch::tensor({{1.0, 0.0}, {-1.0, -1.0}, {0.0, 1.0}}, torch::kFloat64);
  // By hand: -[y log s(x) + (1 - y) log(1 - s(x))] over the four annotated entries.
  double expected = 0;
  for (const auto& [x, y] :
       std::vector<std::pair<double, double>>{{2, 1}, {-1, 0}, {-3, 0}, {1.5, 1}}) {
    const double s = 1 / (1 + std::exp(-x));
    expected -= y * std::log(s) + (1 - y) * std::log(1 - s);
  }
  EXPECT_NEAR(engine::tool_loss(logits, targets).item<double>(), expected / 4, 1e-12);
  // pos_weight 3 and 0.5: the present entries (x = 2 of tool 0, x = 1.5 of tool 1) weigh so.
  const auto s = [](double x) { return 1 / (1 + std::exp(-x)); };
  const double weighted =
      -3 * std::log(s(2)) - std::log(1 - s(-1)) - std::log(1 - s(-3)) - 0.5 * std::log(s(1.5));
  EXPECT_NEAR(engine::tool_loss(logits, targets, torch::tensor({3.0, 0.5})).item<double>(),
              weighted / 4, 1e-12);
  EXPECT_TRUE(torch::allclose(
      engine::tool_positive_weights(torch::tensor({1, 4, 0}), torch::tensor({5, 5, 5})),
      torch::tensor({4.0F, 0.25F, 1.0F})));
  // Nothing annotated: 0, still differentiable.
  auto x = logits.clone().requires_grad_();
  const auto none = engine::tool_loss(x, torch::full_like(targets, -1));
  EXPECT_EQ(none.item<double>(), 0);
  none.backward();
  EXPECT_EQ(x.grad().abs().sum().item<double>(), 0);
  EXPECT_NE(test_util::error_message([&] {
              engine::tool_loss(logits, targets.slice(0, 0, 2));
            }).find("both be [T,K]"),
            std::string::npos);
  EXPECT_NE(test_util::error_message([&] {
              engine::tool_loss(logits, targets * 2);
            }).find("1 (present), 0 (absent) or -1"),
            std::string::npos);
}

TEST(TrainingStep, ToolHeadGradientsAreExactThroughTheChunkedEncoder) {
  // Phases and tool presence from one encoder: chunked training (recomputed in backward) gives
  // naive training's gradients for encoder, head and tool head alike.
  auto video = make_video(9, 11);
  auto gen = at::detail::createCPUGenerator(5);
  video.tools = torch::randint(-1, 2, {9, 4}, gen, torch::kLong).to(torch::kFloat32);
  std::vector<std::vector<torch::Tensor>> grads;
  for (const int64_t chunk : {0, 4}) {
    engine::StepOptions options;
    options.chunked.chunk = chunk;
    options.chunked.keep = chunk > 0 ? 1 : 0;
    options.tool_weight = 0.7;
    options.chunked.dtype = torch::kFloat64;
    auto s = make_setup(options, torch::kFloat64);
    torch::manual_seed(3);
    torch::nn::Linear tools(512, 4);
    tools->to(torch::kFloat64);
    auto params = s.step->parameters();
    for (auto& p : tools->parameters()) params.push_back(p);
    engine::TrainingStep step(engine::frame_encoder(s.encoder.ptr()), s.head,
                              engine::make_optimizer(params, engine::OptimizerOptions{}), options,
                              memory::Tracker::cpu(), tools.ptr());
    ASSERT_EQ(step.parameters().size(), params.size());
    step.on_gradients_ready = [&](const std::vector<torch::Tensor>& ready) {
      std::vector<torch::Tensor> g;
      for (const auto& p : ready) g.push_back(p.grad().clone());
      grads.push_back(g);
    };
    step.step({video});
    EXPECT_NE(test_util::error_message([&] {
                step.step({make_video(9, 11)});
              }).find("has no tool presence"),
              std::string::npos);
  }
  ASSERT_EQ(grads.size(), 2u);
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_LE((grads[0][i] - grads[1][i]).abs().max().item<double>(), 1e-10) << i;
  }
  EXPECT_GT(grads[0].back().abs().sum().item<double>(), 0);  // the tool head learned something
}
