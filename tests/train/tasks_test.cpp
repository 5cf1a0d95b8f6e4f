// Clip classification and segmentation: the batch step (micro-batches, checkpointing and the
// out-of-memory retry give the gradients of the plain step), configs, and training runs on tiny
// data: planned batch within the budget, validation, checkpoints, exact resume, evaluation.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "test_util.h"

#include "framefit/core/runtime.h"
#include "framefit/data/clips.h"
#include "framefit/data/demo.h"
#include "framefit/data/media.h"
#include "framefit/data/segmentation.h"
#include "framefit/engine/batch_step.h"
#include "framefit/engine/checkpoint.h"
#include "framefit/engine/loss.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/network.h"
#include "framefit/models/resnet.h"
#include "framefit/models/video_resnet.h"
#include "framefit/models/weights.h"
#include "framefit/train/config.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"
#include "framefit/train/trainer.h"
#include "train/tasks/plans.h"

using namespace framefit;

namespace {

// A small 2D classifier without BatchNorm (so micro-batches are exact), float64; with
// `batch_norm`, a BatchNorm layer in place of its first ReLU.
models::Network small_network(bool batch_norm = false) {
  std::vector<models::LayerSpec> layers(7);
  layers[0].type = "conv2d";
  layers[0].out = 6;
  layers[0].kernel = {3};
  layers[0].padding = {1};
  layers[1].type = batch_norm ? "bn" : "relu";
  layers[2].type = "conv2d";
  layers[2].out = 8;
  layers[2].kernel = {3};
  layers[2].padding = {1};
  layers[3].type = "dropout";
  layers[3].p = 0.2;
  layers[4].type = "global_avgpool";
  layers[5].type = "flatten";
  layers[6].type = "linear";
  layers[6].out = 4;
  torch::manual_seed(3);
  auto network = models::Network(models::NetworkOptions(layers, {3, 12, 12}));
  network->to(torch::kDouble);
  return network;
}

struct StepResult {
  std::vector<torch::Tensor> gradients;
  std::vector<torch::Tensor> buffers;  // BatchNorm statistics after the step
  std::vector<std::string> replans;
  int64_t peak_bytes = 0;
};

// One step of `options` under a tracker budget (0: none); SGD with lr 0 keeps the weights.
// `labels`, when given, replace the random ones (drawn all the same, so dropout draws alike).
StepResult run_step(engine::BatchStepOptions options, int64_t budget = 0,
                    const torch::Tensor& labels = {}, bool batch_norm = false) {
  auto network = small_network(batch_norm);
  auto optimizer =
      std::make_shared<torch::optim::SGD>(network->parameters(), torch::optim::SGDOptions(0.0));
  engine::BatchTrainingStep step(engine::chain_network(network.ptr()), optimizer, options,
                                 memory::Tracker::cpu());
  torch::manual_seed(7);
  const auto x = torch::randn({6, 3, 12, 12}, torch::kDouble);
  const auto drawn = torch::randint(0, 4, {6}, torch::kLong);
  const auto y = labels.defined() ? labels : drawn;
  auto& tracker = memory::Tracker::cpu();
  tracker.set_budget(budget);
  engine::BatchStepReport report;
  try {
    report = step.step(x, y);
  } catch (...) {
    tracker.set_budget(0);
    throw;
  }
  tracker.set_budget(0);
  EXPECT_TRUE(report.optimizer_stepped);
  StepResult result;
  for (const auto& p : step.parameters()) result.gradients.push_back(p.grad().clone());
  for (const auto& b : network->buffers()) result.buffers.push_back(b.clone());
  result.replans = report.replans;
  result.peak_bytes = report.peak_bytes;
  return result;
}

double largest_difference(const std::vector<torch::Tensor>& a,
                          const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

}  // namespace

TEST(BatchStep, MicroBatchesAndCheckpointingGiveThePlainGradients) {
  engine::BatchStepOptions plain;
  const auto reference = run_step(plain).gradients;
  engine::BatchStepOptions micro = plain;
  micro.micro_batches = 4;  // 6 samples as 2, 2, 1, 1
  EXPECT_LT(largest_difference(reference, run_step(micro).gradients), 1e-12);
  engine::BatchStepOptions recomputed = plain;
  recomputed.segments =
      engine::recompute_every(engine::chain_network(small_network().ptr()).stage_count(), 1);
  EXPECT_LT(largest_difference(reference, run_step(recomputed).gradients), 1e-12);
}

TEST(BatchStep, OutOfMemoryRetriesWithRecomputeThenMicroBatches) {
  engine::BatchStepOptions plain;
  const auto reference = run_step(plain);
  // A budget below what the plain step needs: the step is retried with less memory, and its
  // gradients are still the plain step's.
  const auto retried = run_step(plain, reference.peak_bytes * 6 / 10);
  ASSERT_FALSE(retried.replans.empty());
  EXPECT_NE(retried.replans.front().find("out of memory"), std::string::npos);
  EXPECT_NE(retried.replans.front().find("every stage recomputed"), std::string::npos)
      << retried.replans.front();
  EXPECT_LT(largest_difference(reference.gradients, retried.gradients), 1e-12);
  // Too small for even one sample with everything recomputed: the error comes through.
  EXPECT_THROW(run_step(plain, 4 * 1024), c10::Error);
}

TEST(BatchStep, OutOfMemoryRetriesWithTheFallbackPlanFirst) {
  engine::BatchStepOptions plain;
  const auto reference = run_step(plain);
  const int64_t stages = engine::chain_network(small_network().ptr()).stage_count();
  engine::BatchStepOptions with_fallback = plain;
  with_fallback.fallback_segments = {engine::ChainSegment{0, stages, true, true}};  // nested
  const auto retried = run_step(with_fallback, reference.peak_bytes * 6 / 10);
  ASSERT_FALSE(retried.replans.empty());
  EXPECT_NE(retried.replans.front().find("the checkpointing plan that holds the least"),
            std::string::npos)
      << retried.replans.front();
  EXPECT_LT(largest_difference(reference.gradients, retried.gradients), 1e-12);
  // A step that already runs its fallback goes on to micro-batches.
  engine::BatchStepOptions at_fallback = with_fallback;
  at_fallback.segments = at_fallback.fallback_segments;
  const auto nested = run_step(at_fallback);
  const auto split = run_step(at_fallback, nested.peak_bytes * 9 / 10);
  ASSERT_FALSE(split.replans.empty());
  EXPECT_NE(split.replans.front().find("micro-batches"), std::string::npos)
      << split.replans.front();
  EXPECT_LT(largest_difference(reference.gradients, split.gradients), 1e-12);
}

TEST(BatchStep, RetryAfterOutOfMemoryLeavesTheStatisticsOfOneStep) {
  // The failed attempt's BatchNorm layer updated its running statistics before memory ran out;
  // the retried step ends as one run with every stage recomputed from the start.
  engine::BatchStepOptions plain;
  engine::BatchStepOptions recomputed = plain;
  recomputed.segments =
      engine::recompute_every(engine::chain_network(small_network(true).ptr()).stage_count(), 1);
  const auto direct = run_step(recomputed, 0, {}, true);
  const auto reference = run_step(plain, 0, {}, true);
  ASSERT_LT(direct.peak_bytes, reference.peak_bytes);
  const auto retried = run_step(plain, (direct.peak_bytes + reference.peak_bytes) / 2, {}, true);
  ASSERT_EQ(retried.replans.size(), 1u);
  ASSERT_NE(retried.replans[0].find("every stage recomputed"), std::string::npos);
  ASSERT_EQ(retried.buffers.size(), 3u);  // running mean, variance, batches tracked
  EXPECT_LT(largest_difference(direct.buffers, retried.buffers), 1e-12);
  EXPECT_LT(largest_difference(direct.gradients, retried.gradients), 1e-12);
}

TEST(BatchStep, LossThatIsNotFiniteLeavesWeightsAndStatisticsAsTheyWere) {
  auto network = small_network(true);
  auto optimizer =
      std::make_shared<torch::optim::SGD>(network->parameters(), torch::optim::SGDOptions(0.1));
  engine::BatchTrainingStep step(engine::chain_network(network.ptr()), optimizer, {},
                                 memory::Tracker::cpu());
  auto state = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& t : network->parameters()) out.push_back(t.detach().clone());
    for (const auto& t : network->buffers()) out.push_back(t.clone());
    return out;
  };
  const auto before = state();
  auto x = torch::randn({4, 3, 12, 12}, torch::kDouble);
  const auto y = torch::tensor({0, 1, 2, 3}, torch::kLong);
  x[2][1][5][5] = std::numeric_limits<double>::infinity();
  const auto skipped = step.step(x, y);
  EXPECT_FALSE(std::isfinite(skipped.loss));
  EXPECT_TRUE(skipped.not_finite_skipped);
  EXPECT_FALSE(skipped.optimizer_stepped);
  EXPECT_EQ(largest_difference(state(), before), 0);
  x[2][1][5][5] = 0;
  const auto trained = step.step(x, y);
  EXPECT_TRUE(std::isfinite(trained.loss));
  EXPECT_TRUE(trained.optimizer_stepped);
  EXPECT_GT(largest_difference(state(), before), 0);
}

TEST(BatchStep, ClassWeightsGiveTheWeightedMeanWhateverTheMicroBatches) {
  engine::BatchStepOptions weighted;
  weighted.class_weights = torch::tensor({0.5, 2.0, 1.0, 3.0}, torch::kDouble);
  const auto gradients = run_step(weighted).gradients;
  // PyTorch's weighted cross-entropy over the whole batch, as run_step draws it.
  auto network = small_network();
  torch::manual_seed(7);
  const auto x = torch::randn({6, 3, 12, 12}, torch::kDouble);
  const auto y = torch::randint(0, 4, {6}, torch::kLong);
  torch::nn::functional::cross_entropy(
      network->forward(x), y,
      torch::nn::functional::CrossEntropyFuncOptions().weight(weighted.class_weights))
      .backward();
  std::vector<torch::Tensor> reference;
  for (const auto& p : network->parameters()) reference.push_back(p.grad());
  EXPECT_LT(largest_difference(reference, gradients), 1e-12);
  engine::BatchStepOptions micro = weighted;
  micro.micro_batches = 4;  // 2, 2, 1, 1 samples: each divided by the whole batch's weight
  EXPECT_LT(largest_difference(reference, run_step(micro).gradients), 1e-12);
  EXPECT_GT(largest_difference(reference, run_step({}).gradients), 1e-6) << "weights must matter";

  auto small = small_network();
  auto optimizer =
      std::make_shared<torch::optim::SGD>(small->parameters(), torch::optim::SGDOptions(0.0));
  engine::BatchTrainingStep step(engine::chain_network(small.ptr()), optimizer, weighted,
                                 memory::Tracker::cpu());
  EXPECT_NE(test_util::error_message([&] {
              step.step(x, torch::tensor({0, 1, 2, 3, 4, 1}, torch::kLong));
            }).find("4 class weights got labels from 0 to 4"),
            std::string::npos);
}

TEST(BatchStep, LabelSmoothingAsPyTorchsWhateverTheMicroBatches) {
  // PyTorch's weighted cross-entropy with label smoothing and an ignored label, over the whole
  // batch, against micro-batches each divided by the whole batch's weight.
  const auto labels = torch::tensor({0, 9, 1, 3, 2, 3}, torch::kLong);
  engine::BatchStepOptions options;
  options.ignore_label = 9;
  options.label_smoothing = 0.3;
  options.class_weights = torch::tensor({0.5, 2.0, 1.0, 3.0}, torch::kDouble);
  auto network = small_network();
  torch::manual_seed(7);
  const auto x = torch::randn({6, 3, 12, 12}, torch::kDouble);
  torch::randint(0, 4, {6}, torch::kLong);  // as run_step draws
  torch::nn::functional::cross_entropy(network->forward(x), labels,
                                       torch::nn::functional::CrossEntropyFuncOptions()
                                           .weight(options.class_weights)
                                           .ignore_index(9)
                                           .label_smoothing(0.3))
      .backward();
  std::vector<torch::Tensor> reference;
  for (const auto& p : network->parameters()) reference.push_back(p.grad());
  EXPECT_LT(largest_difference(reference, run_step(options, 0, labels).gradients), 1e-12);
  options.micro_batches = 3;
  EXPECT_LT(largest_difference(reference, run_step(options, 0, labels).gradients), 1e-12);
  options.label_smoothing = 0;
  EXPECT_GT(largest_difference(reference, run_step(options, 0, labels).gradients), 1e-6);
}

TEST(BatchStep, IgnoredLabelsCountInNeitherTheLossNorItsMean) {
  // Labels 9 (a mask's border pixels, say) are left out, as PyTorch's ignore_index leaves them
  // out: of the sum and of the count (or weight) it is divided by, whatever the micro-batches.
  const auto labels = torch::tensor({0, 9, 1, 9, 2, 3}, torch::kLong);
  for (const bool weighted : {false, true}) {
    engine::BatchStepOptions options;
    options.ignore_label = 9;
    auto loss_options = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(9);
    if (weighted) {
      options.class_weights = torch::tensor({0.5, 2.0, 1.0, 3.0}, torch::kDouble);
      loss_options.weight(options.class_weights);
    }
    auto network = small_network();
    torch::manual_seed(7);
    const auto x = torch::randn({6, 3, 12, 12}, torch::kDouble);
    torch::randint(0, 4, {6}, torch::kLong);  // as run_step draws
    torch::nn::functional::cross_entropy(network->forward(x), labels, loss_options).backward();
    std::vector<torch::Tensor> reference;
    for (const auto& p : network->parameters()) reference.push_back(p.grad());
    EXPECT_LT(largest_difference(reference, run_step(options, 0, labels).gradients), 1e-12)
        << (weighted ? "weighted" : "plain");
    engine::BatchStepOptions micro = options;
    micro.micro_batches = 3;  // the first two hold both ignored labels
    EXPECT_LT(largest_difference(reference, run_step(micro, 0, labels).gradients), 1e-12)
        << (weighted ? "weighted" : "plain");
  }
  // Nothing but ignored labels: a loss of 0 and zero gradients, not NaN.
  engine::BatchStepOptions options;
  options.ignore_label = 9;
  for (const auto& g : run_step(options, 0, torch::full({6}, 9, torch::kLong)).gradients) {
    EXPECT_EQ(g.abs().max().item<double>(), 0);
  }
}

TEST(TaskConfig, KeysAndMismatchesAreNamed) {
  const auto c = train::parse_config(
      "task: segmentation\nmodel:\n  width: 8\n  depth: 2\ndata:\n  images: a/{split}/i\n"
      "  masks: a/{split}/m\n  classes: [bg, fg]\ntrain:\n  batch: 4\n  checkpointing: all\n",
      "test");
  EXPECT_EQ(c.task, "segmentation");
  EXPECT_EQ(train::network_kind(c), "unet");
  EXPECT_EQ(c.train.batch, 4);
  const auto again = train::parse_config(train::to_yaml(c), "round trip");
  EXPECT_EQ(train::to_yaml(again), train::to_yaml(c));
  EXPECT_NE(test_util::error_message([] {
              train::parse_config("task: detection\n", "t");
            }).find("task: \"detection\" is not one of phases | clips | segmentation"),
            std::string::npos);
  auto clips = c;
  clips.task = "clips";
  clips.model.network = "unet";
  EXPECT_NE(test_util::error_message([&] {
              train::build_batch_model(clips, {3, 4, 16, 16});
            }).find("use task segmentation"),
            std::string::npos);
  auto segmentation = c;
  segmentation.model.network = "r3d_18";
  EXPECT_NE(test_util::error_message([&] {
              train::build_batch_model(segmentation, {3, 16, 16});
            }).find("use task clips"),
            std::string::npos);
  // A layer list whose output is not one score per class (3 scores for 2 classes).
  auto layers = c;
  layers.task = "clips";
  layers.model.network = "layers";
  layers.model.layers.resize(3);
  layers.model.layers[0].type = "global_avgpool";
  layers.model.layers[1].type = "flatten";
  layers.model.layers[2].type = "linear";
  layers.model.layers[2].out = 3;
  const auto wrong = test_util::error_message([&] {
    train::build_batch_model(layers, {3, 4, 8, 8});
  });
  EXPECT_NE(wrong.find("model.layers: the network's output per sample is 3 but task clips needs 2"),
            std::string::npos)
      << wrong;
  // Mask values: numbers or colours, one per class, round-tripping through the run's config.
  using Values = std::vector<std::vector<int64_t>>;
  const auto with_values = [](const std::string& values) {
    return train::parse_config(
        "task: segmentation\ndata:\n  classes: [bg, fg]\n  mask_values: " + values + "\n", "t");
  };
  EXPECT_EQ(with_values("[0, 255]").data.mask_values, (Values{{0}, {255}}));
  const auto colours = with_values("[[0, 0, 0], [255, 0, 0]]");
  EXPECT_EQ(colours.data.mask_values, (Values{{0, 0, 0}, {255, 0, 0}}));
  EXPECT_EQ(train::parse_config(train::to_yaml(colours), "round trip").data.mask_values,
            colours.data.mask_values);
  for (const auto& [values, error] : std::vector<std::pair<std::string, std::string>>{
           {"[0, [1, 2, 3]]", "mixes numbers and colours"},
           {"[3, 3]", "the same value as class 0"},
           {"[[0, 0, 300], [1, 1, 1]]", "300 is not a colour channel"},
           {"[[0, 0], [1, 1]]", "expected a number or an [R, G, B] colour"},
           {"[-1, 1]", "-1 is not a mask value"}}) {
    EXPECT_NE(test_util::error_message([&] { with_values(values); }).find(error), std::string::npos)
        << values;
  }
  auto three = with_values("[0, 1, 2]");
  const auto findings = train::diagnose_task_settings(three);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_NE(findings[0].problem.find("data.mask_values lists 3 values for 2 classes"),
            std::string::npos);
  // A UNet whose depth does not divide the images.
  auto odd = c;
  odd.model.depth = 3;
  EXPECT_NE(test_util::error_message([&] {
              train::build_batch_model(odd, {3, 20, 20});
            }).find("data.resize"),
            std::string::npos);
}

TEST(TaskConfig, SampleShapeFollowsFromTheDataSettingsWhereTheyFixIt) {
  train::Config c;
  c.task = "clips";
  c.data.clip_length = 8;
  c.data.resize = 72;
  EXPECT_TRUE(train::configured_sample_shape(c).empty());  // no crop: the videos' own aspect
  c.data.crop = 64;
  EXPECT_EQ(train::configured_sample_shape(c), (std::vector<int64_t>{3, 8, 64, 64}));
  c.task = "segmentation";
  EXPECT_EQ(train::configured_sample_shape(c), (std::vector<int64_t>{3, 72, 72}));
  c.data.resize = 0;
  EXPECT_TRUE(train::configured_sample_shape(c).empty());
  c.task = "phases";
  EXPECT_TRUE(train::configured_sample_shape(c).empty());
}

TEST(TaskConfig, DoctorChecksNamedNetworksWithoutAllocating) {
  auto c = train::parse_config(
      "task: segmentation\nmodel:\n  width: 8\n  depth: 3\ndata:\n  classes: [bg, fg]\n"
      "  resize: 20\n",
      "test");
  auto& tracker = memory::Tracker::cpu();
  const int64_t allocations = tracker.allocation_count();
  auto findings = train::diagnose_batch_task(c, 0);
  ASSERT_TRUE(plan::has_errors(findings));
  EXPECT_NE(findings.front().problem.find("data.resize 20 is not a multiple of 8"),
            std::string::npos)
      << findings.front().problem;
  EXPECT_NE(findings.front().fix.find("data.resize to 24"), std::string::npos);
  c.data.resize = 32;
  EXPECT_FALSE(plan::has_errors(train::diagnose_batch_task(c, 0)));
  // R3D-18 has 33 million parameters: with gradients and AdamW state (4 copies) over 500 MiB.
  c.task = "clips";
  c.model.network = "r3d_18";
  c.data.crop = 112;
  int64_t static_bytes = 0;
  findings = train::diagnose_batch_task(c, int64_t{256} << 20, &static_bytes);
  EXPECT_GT(static_bytes, int64_t{500} << 20);
  ASSERT_TRUE(plan::has_errors(findings));
  EXPECT_NE(findings.back().problem.find("not less than train.budget"), std::string::npos)
      << findings.back().problem;
  EXPECT_EQ(tracker.allocation_count(), allocations) << "the doctor must not allocate tensors";
}

TEST(TaskConfig, DoctorReadsATorchScriptNetworksTensorsAndNamesAFileThatDoesNotLoad) {
  auto c = train::parse_config(
      "task: segmentation\nmodel:\n  network: torchscript\ndata:\n  classes: [bg, fg]\n"
      "  resize: 32\ntrain:\n  optimizer: sgd\n",
      "test");
  const std::string path = "/tmp/framefit_doctor_script_" + std::to_string(::getpid()) + ".pt";
  // 1,000,000 float32 weights.
  c.model.script = test_util::write_script_module(path, {{"w", torch::zeros({1000, 1000})}},
                                                  "def forward(self, x):\n    return x\n");
  int64_t static_bytes = 0;
  auto findings = train::diagnose_batch_task(c, int64_t{64} << 20, &static_bytes);
  // Weights, gradients and SGD momentum: three copies.
  EXPECT_EQ(static_bytes, 3 * 4'000'000);
  EXPECT_FALSE(plan::has_errors(findings));
  findings = train::diagnose_batch_task(c, int64_t{8} << 20);
  ASSERT_TRUE(plan::has_errors(findings));
  EXPECT_NE(findings.back().problem.find("1,000,000 parameters"), std::string::npos)
      << findings.back().problem;
  std::remove(path.c_str());
  findings = train::diagnose_batch_task(c, 0);
  ASSERT_TRUE(plan::has_errors(findings));
  EXPECT_NE(findings.back().problem.find(path), std::string::npos) << findings.back().problem;
}

#ifdef FRAMEFIT_WITH_FFMPEG
namespace {

struct TinyData {
  std::string dir = "/tmp/framefit_tasks_test_" + std::to_string(::getpid());
  TinyData() {
    test_util::make_tiny_demo(dir, 40, 70);
    data::SegmentationDemoOptions s;
    s.train_images = 10;
    s.val_images = 4;
    s.test_images = 3;
    s.size = 32;
    data::make_segmentation_demo(dir + "/segmentation", s);
  }
  ~TinyData() { test_util::remove_tree(dir); }
};

const std::string& tiny_data() {
  static const TinyData data;
  return data.dir;
}

train::Config clips_config(const std::string& name) {
  train::Config c;
  c.task = "clips";
  c.model.network = "layers";
  c.model.layers.resize(8);
  c.model.layers[0].type = "conv3d";
  c.model.layers[0].out = 8;
  c.model.layers[0].kernel = {3};
  c.model.layers[0].padding = {1};
  c.model.layers[1].type = "bn";
  c.model.layers[2].type = "relu";
  c.model.layers[3].type = "maxpool";
  c.model.layers[3].kernel = {2};
  c.model.layers[4].type = "dropout";
  c.model.layers[4].p = 0.1;
  c.model.layers[5].type = "global_avgpool";
  c.model.layers[6].type = "flatten";
  c.model.layers[7].type = "linear";
  c.model.layers[7].out = 5;
  c.data.manifest = tiny_data() + "/manifest.csv";
  for (const auto& n : data::demo_classes().names()) c.data.classes.push_back(n);
  c.data.fps = 12.5;
  c.data.resize = 20;
  c.data.crop = 16;
  c.data.clip_length = 4;
  c.data.clip_stride = 3;
  c.train.epochs = 2;
  c.train.schedule = "constant";
  c.train.precision = engine::Precision::FP32;
  c.train.batch = 5;
  c.train.checkpointing = plan::Recompute::Nothing;
  c.train.budget_covers = "tensors";  // these tests' budgets are tensor bytes, MiB and less
  c.train.out_dir = name + "_" + std::to_string(::getpid());
  test_util::remove_tree(c.train.out_dir);
  return c;
}

train::Config segmentation_config(const std::string& name) {
  train::Config c;
  c.task = "segmentation";
  c.model.width = 8;
  c.model.depth = 2;
  c.model.norm = "bn";
  c.data.images = tiny_data() + "/segmentation/{split}/images";
  c.data.masks = tiny_data() + "/segmentation/{split}/masks";
  for (const auto& n : data::segmentation_demo_classes().names()) c.data.classes.push_back(n);
  c.train.epochs = 2;
  c.train.lr = 3e-3;
  c.train.precision = engine::Precision::FP32;
  c.train.budget_covers = "tensors";
  c.train.out_dir = name + "_" + std::to_string(::getpid());
  test_util::remove_tree(c.train.out_dir);
  return c;
}

// A number of each record of `type` in a run's log.jsonl, in order (read without a JSON
// library: GPU machines' test builds have none).
std::vector<double> log_values(const std::string& out_dir, const std::string& type,
                               const std::string& key) {
  std::ifstream log(out_dir + "/log.jsonl");
  std::vector<double> values;
  const std::string field = "\"" + key + "\":";
  for (std::string line; std::getline(log, line);) {
    const auto at = line.find(field);
    if (line.find("\"type\":\"" + type + "\"") == std::string::npos || at == std::string::npos)
      continue;
    values.push_back(std::stod(line.substr(at + field.size())));
  }
  return values;
}

// The tracked peaks of a run's steps.
std::vector<int64_t> step_peaks(const std::string& out_dir) {
  std::vector<int64_t> peaks;
  for (const double peak : log_values(out_dir, "step", "peak_bytes"))
    peaks.push_back(static_cast<int64_t>(peak));
  return peaks;
}

std::vector<torch::Tensor> checkpoint_weights(const std::string& path) {
  std::vector<torch::Tensor> out;
  const auto model = train::load_batch_model(path);
  for (const auto& t : model.network.module->parameters()) out.push_back(t.clone());
  for (const auto& t : model.network.module->buffers()) out.push_back(t.clone());
  return out;
}

// Trains `base` uninterrupted, then in `interrupted_dir` stopped after `stop_after` steps and
// resumed (as another process would: its own random seed), and expects the resumed run's last
// checkpoint to equal the uninterrupted one's. Returns the uninterrupted run's result; the
// resumed run's warnings go to `warnings` when given.
train::TrainResult expect_exact_resume(const train::Config& base,
                                       const std::string& interrupted_dir, int64_t stop_after,
                                       std::vector<std::string>* warnings = nullptr) {
  const auto full = train::train(base);
  EXPECT_GT(full.steps, stop_after);  // steps left for the resumed run
  char last[32];
  std::snprintf(last, sizeof(last), "/step_%08lld.pt", static_cast<long long>(full.steps));
  const auto uninterrupted = checkpoint_weights(base.train.out_dir + "/checkpoints" + last);
  auto first = base;
  first.train.out_dir = interrupted_dir;
  first.train.max_steps = stop_after;
  train::train(first);
  auto rest = first;
  rest.train.max_steps = 0;
  torch::manual_seed(12345);  // as another process would start
  const auto resumed = train::train(rest, "auto", [&](const train::Event& e) {
    if (warnings && e.kind == train::Event::Kind::Warning) warnings->push_back(e.message);
  });
  EXPECT_EQ(resumed.steps, full.steps);
  const auto weights = checkpoint_weights(first.train.out_dir + "/checkpoints" + last);
  EXPECT_EQ(weights.size(), uninterrupted.size());
  for (size_t i = 0; i < std::min(weights.size(), uninterrupted.size()); ++i)
    EXPECT_TRUE(torch::equal(weights[i], uninterrupted[i])) << i;
  return full;
}

}  // namespace

TEST(ModelWeights, StartTheEncoderOrVideoNetworkFromAStateDictUnderAnyPrefix) {
  const auto path = [](const std::string& name) {
    return "/tmp/framefit_model_weights_" + std::to_string(::getpid()) + "_" + name;
  };
  // A module's state_dict with every key under `prefix`, written to path(file).
  const auto save_under = [&](const torch::nn::Module& module, const std::string& prefix,
                              const std::string& file) {
    models::StateDict state;
    for (auto& [name, tensor] : models::state_dict(module))
      state.emplace_back(prefix + name, tensor);
    models::write_state_dict(state, path(file));
  };
  // Phases: an ImageNet ResNet-18 saved from DistributedDataParallel ("module." keys, fc too).
  models::ResNet imagenet(models::ResNetOptions(18).num_classes(1000));
  save_under(*imagenet, "module.", "ddp.pt");
  auto phases = train::parse_config(
      "model: {encoder: resnet18, norm: bn, head: linear}\n"
      "data: {classes: [a, b]}\n",
      "test");
  phases.model.weights = path("ddp.pt");
  auto model = train::build_model(phases);
  EXPECT_TRUE(torch::equal(model.encoder->conv1->weight, imagenet->conv1->weight));
  EXPECT_TRUE(torch::equal(model.encoder->layer4[1]->as<models::ResidualBlock>()->bn2->weight,
                           imagenet->layer4[1]->as<models::ResidualBlock>()->bn2->weight));
  // A prefix the file does not have is named with the file.
  phases.model.weights_prefix = "backbone.";
  const auto message = test_util::error_message([&] { train::build_model(phases); });
  EXPECT_NE(message.find("model.weights " + path("ddp.pt")), std::string::npos) << message;
  EXPECT_NE(message.find("no key of the file starts with \"backbone.\""), std::string::npos);

  // Clips: torchvision's R3D-18 under "model." - all but the classifier, which is for these
  // classes.
  models::VideoResNet kinetics(models::VideoResNetOptions("r3d_18").num_classes(400));
  save_under(*kinetics, "model.", "r3d.pt");
  auto clips = train::parse_config(
      "task: clips\nmodel: {network: r3d_18}\n"
      "data: {classes: [a, b, c]}\n",
      "test");
  clips.model.weights = path("r3d.pt");
  const auto video = train::build_batch_model(clips, {3, 4, 32, 32});
  const auto loaded = models::state_dict(*video.network.module);
  const auto original = models::state_dict(*kinetics);
  ASSERT_EQ(loaded.size(), original.size());
  for (size_t i = 0; i < loaded.size(); ++i) {
    const bool classifier = loaded[i].first.rfind("fc.", 0) == 0;
    EXPECT_EQ(torch::equal(loaded[i].second, original[i].second), !classifier) << loaded[i].first;
  }
  std::remove(path("ddp.pt").c_str());
  std::remove(path("r3d.pt").c_str());
}

TEST(ClipTraining, ResumedRunEndsWithIdenticalWeights) {
  // Uninterrupted: every step. Interrupted after step 3 (mid-epoch, mid-video), then resumed:
  // the clip order, crops and flips, dropout and BatchNorm statistics must all agree; with
  // accumulated batches too (an optimizer step of two batches of 2).
  for (const int64_t accumulate : {1, 2}) {
    SCOPED_TRACE("accumulate " + std::to_string(accumulate));
    auto base = clips_config("/tmp/framefit_clips_a");
    base.train.checkpoint_every = 1;
    base.train.accumulate = accumulate;
    if (accumulate > 1) base.train.batch = 2;
    // Emptied by clips_config.
    const auto interrupted_dir = clips_config("/tmp/framefit_clips_b").train.out_dir;
    std::vector<std::string> warnings;
    const auto full = expect_exact_resume(base, interrupted_dir, 3, &warnings);
    // The one key changed for the rest of the run is named.
    EXPECT_EQ(warnings, (std::vector<std::string>{
                            "the config differs from the checkpoint's; training goes on with the "
                            "new values: train.max_steps: 3 -> 0"}));

    if (accumulate == 1) {
      // Evaluation counts clips: the validation video's clips, all of them.
      auto model = train::load_batch_model(base.train.out_dir + "/best.pt");
      const auto metrics = train::evaluate_batch(model, "val");
      EXPECT_GT(metrics.frames, 0);
      EXPECT_NEAR(metrics.accuracy, full.best.accuracy, 1e-12);
      // Prediction cuts a video's clips as evaluation does and gives the same classes: over the
      // validation videos, the same number of clips and the same accuracy.
      const auto videos = train::make_dataset(model.config, "val", false);
      data::ClipOptions clip;
      clip.length = model.config.data.clip_length;
      clip.stride = model.config.data.clip_stride;
      int64_t clips = 0, correct = 0;
      for (int64_t v = 0; v < videos.size(); ++v) {
        const auto video = videos.load(v);
        const auto truth = data::cut_clips(video, clip);
        const auto predicted = train::predict_clips(model, video.frames);
        EXPECT_EQ(predicted.starts, truth.starts);
        ASSERT_EQ(predicted.labels.numel(), truth.labels.numel());
        EXPECT_TRUE((predicted.confidence > 0).all().item<bool>());
        EXPECT_TRUE((predicted.confidence <= 1).all().item<bool>());
        clips += truth.labels.numel();
        correct += predicted.labels.eq(truth.labels).sum().item<int64_t>();
      }
      EXPECT_EQ(clips, metrics.frames);
      EXPECT_NEAR(static_cast<double>(correct) / static_cast<double>(clips), metrics.accuracy,
                  1e-12);
      EXPECT_NE(test_util::error_message([&] {
                  train::predict_clips(model, videos.load(0).frames.narrow(0, 0, 3));
                }).find("fewer than one clip of 4"),
                std::string::npos);
      EXPECT_NE(test_util::error_message([&] {
                  train::predict_clips(model, torch::zeros({8, 3, 20, 20}, torch::kUInt8));
                }).find("trained on clips of 16x16 frames"),
                std::string::npos);
      EXPECT_NE(test_util::error_message([&] {
                  train::load_model(base.train.out_dir + "/best.pt");
                }).find("is a clips checkpoint"),
                std::string::npos);
    }
    test_util::remove_tree(base.train.out_dir);
    test_util::remove_tree(interrupted_dir);
  }
}

TEST(ClipTraining, ResumedUnderAnotherBudgetHoldsItsBatchAndRecomputesWhereItMust) {
  // A run planned without recomputation, resumed under a budget its batch of 5 needs
  // recomputation for, then under a larger one again.
  auto config = clips_config("/tmp/framefit_clips_resume_budget");
  // Four stages of full-size activations, so that recomputing some of them matters.
  auto& layers = config.model.layers;
  layers.erase(layers.begin() + 3);  // the max pool
  const std::vector<models::LayerSpec> block(layers.begin(), layers.begin() + 3);
  for (int i = 0; i < 2; ++i) layers.insert(layers.begin() + 3, block.begin(), block.end());
  config.train.checkpointing = plan::Recompute::AsNeeded;
  config.train.budget = 256 << 20;
  config.train.max_steps = 2;
  config.train.checkpoint_every = 1;
  const auto recomputed_stages = [](const train::BatchTaskPlan& p) {
    const auto r = engine::recomputed(p.segments);
    return std::count(r.begin(), r.end(), true);
  };
  ASSERT_EQ(recomputed_stages(train::plan_batch_task(config, memory::Tracker::cpu())), 0);
  // A budget between the least that holds batch 5 in one piece with recomputation and the least
  // that holds it without, wherever the kernels' sizes put the two: bisected, not guessed
  // (halving stepped over the gap on an AVX2 CPU).
  auto smaller = config;
  const auto least_budget = [&](bool plain) {
    const auto holds = [&](int64_t budget) {
      smaller.train.budget = budget;
      train::BatchTaskPlan p;
      try {
        p = train::plan_batch_task(smaller, memory::Tracker::cpu());
      } catch (const c10::Error&) {  // the doctor's: not even the parameters fit
        return false;
      }
      return p.batch == 5 && p.micro_batches == 1 && p.predicted_peak_bytes <= p.budget.step &&
             (!plain || recomputed_stages(p) == 0);
    };
    int64_t fits = config.train.budget, fails = 64 << 10;
    EXPECT_TRUE(holds(fits));
    EXPECT_FALSE(holds(fails));
    while (fits - fails > (16 << 10)) {
      const int64_t middle = fails + (fits - fails) / 2;
      (holds(middle) ? fits : fails) = middle;
    }
    return fits;
  };
  const int64_t least = least_budget(false), least_plain = least_budget(true);
  ASSERT_LT(least, least_plain) << "recomputation saves nothing at batch 5";
  smaller.train.budget = least + (least_plain - least) / 2;
  const std::optional<train::BatchTaskPlan> replan =
      train::plan_batch_task(smaller, memory::Tracker::cpu());
  ASSERT_TRUE(replan->batch == 5 && replan->micro_batches == 1 && recomputed_stages(*replan) > 0)
      << memory::format_bytes(smaller.train.budget) << ": " << replan->describe();
  train::train(config);

  std::vector<std::string> notes;
  const auto resume = [&](train::Config c, int64_t max_steps) {
    c.train.max_steps = max_steps;
    notes.clear();
    return train::train(c, "auto", [&](const train::Event& e) {
      if (e.kind != train::Event::Kind::Step) notes.push_back(e.message);
    });
  };
  const auto said = [&](const std::string& text) {
    return std::any_of(notes.begin(), notes.end(),
                       [&](const std::string& n) { return n.find(text) != std::string::npos; });
  };
  EXPECT_EQ(resume(smaller, 3).steps, 3);
  const std::string replanned =
      c10::str("re-planned to batch 5, ", recomputed_stages(*replan), " of ",
               engine::recomputed(replan->segments).size(), " stages recomputed (predicted ");
  EXPECT_TRUE(said("train.budget changed from 256.00 MiB to " +
                   memory::format_bytes(smaller.train.budget) +
                   ": the checkpoint's batch 5, 0 of "))
      << c10::Join("\n", notes);
  EXPECT_TRUE(said(replanned)) << c10::Join("\n", notes);
  EXPECT_FALSE(said("out of memory")) << c10::Join("\n", notes);
  // Back to a larger budget: the recomputing settings fit it too, and stay.
  EXPECT_EQ(resume(config, 4).steps, 4);
  EXPECT_TRUE(said(c10::str("the checkpoint's batch 5, ", recomputed_stages(*replan), " of ")))
      << c10::Join("\n", notes);
  EXPECT_TRUE(said("; kept, so the run goes on as it would have")) << c10::Join("\n", notes);
  test_util::remove_tree(config.train.out_dir);
}

TEST(ClipTraining, TaskPlanRecordsTheBatchPlanAndItsTable) {
  auto config = clips_config("/tmp/framefit_clips_task_plan");
  config.train.checkpointing = plan::Recompute::AsNeeded;
  config.train.batch = std::nullopt;
  config.train.budget = 8 << 20;
  config.data.prefetch_bytes = 512 << 10;
  const auto planned = train::plan_batch_task(config, memory::Tracker::cpu());
  ASSERT_GT(planned.batch, 0);
  const auto run = train::task_for(config).plan(config, memory::Tracker::cpu(), {});
  EXPECT_TRUE(run.fits);
  EXPECT_EQ(run.record.at("batch"), planned.batch);
  EXPECT_EQ(run.record.at("predicted_peak_bytes"), planned.predicted_peak_bytes);
  EXPECT_EQ(run.record.at("step_budget_bytes"), planned.budget.step);
  EXPECT_EQ(run.record.at("eval_batch"), planned.eval_batch);
  ASSERT_EQ(run.record.at("table").size(), planned.table.size());
  EXPECT_EQ(run.record.at("table").at(0).at("batch"), planned.table.at(0).batch);
  EXPECT_EQ(run.lines.at(0), planned.describe());
  // A heading, the column names and one line per batch size.
  EXPECT_EQ(run.table.size(), planned.table.size() + 2);
}

TEST(ClipTraining, TimeSlicingIsPlannedWhereCheckpointingIsAndResumesExactly) {
  // seeds/001's kind of network (no norm after its convolution): sliced along time
  // (models/network.h) with train.checkpointing all, and auto unless a fixed batch needs no
  // recomputation; never with off. Evaluation from the checkpoint runs sliced as planned.
  auto config = clips_config("/tmp/framefit_clips_slices");
  config.model.layers.erase(config.model.layers.begin() + 1);  // the BatchNorm
  config.train.checkpointing = plan::Recompute::AsNeeded;
  config.train.batch = std::nullopt;
  config.train.budget = 8 << 20;
  config.data.prefetch_bytes = 512 << 10;
  const auto planned = train::plan_batch_task(config, memory::Tracker::cpu());
  EXPECT_EQ(planned.time_slices, models::kTimeSlices);
  EXPECT_FALSE(planned.recompute_norm);
  EXPECT_NE(planned.describe().find(", 8 time slices"), std::string::npos) << planned.describe();
  auto roomy = config;
  roomy.train.budget = 512 << 20;
  roomy.train.batch = 2;
  EXPECT_EQ(train::plan_batch_task(roomy, memory::Tracker::cpu()).time_slices, 0);
  roomy.train.checkpointing = plan::Recompute::EveryStage;
  EXPECT_EQ(train::plan_batch_task(roomy, memory::Tracker::cpu()).time_slices, models::kTimeSlices);
  auto off = config;
  off.train.checkpointing = plan::Recompute::Nothing;
  EXPECT_EQ(train::plan_batch_task(off, memory::Tracker::cpu()).time_slices, 0);

  // A run sliced throughout (the budget's batch would leave too few steps to stop in).
  config = roomy;
  config.train.checkpoint_every = 1;
  const auto interrupted_dir = clips_config("/tmp/framefit_clips_slices_b").train.out_dir;
  expect_exact_resume(config, interrupted_dir, 3);
  auto model = train::load_batch_model(config.train.out_dir + "/best.pt");
  const auto* network = dynamic_cast<models::NetworkImpl*>(model.network.module.get());
  ASSERT_NE(network, nullptr);
  EXPECT_EQ(network->time_slices(), models::kTimeSlices);
  test_util::remove_tree(config.train.out_dir);
  test_util::remove_tree(interrupted_dir);
}

TEST(ClipTraining, VideoFileIsPredictedAPieceAtATimeAsItsDecodedFrames) {
  // Clips that overlap, touch and leave gaps, cut from the video as it is decoded in batches of
  // 3 clips: the clips, classes and confidences of the whole decoded video.
  auto config = clips_config("/tmp/framefit_clips_predict_file");
  auto model = train::build_batch_model(config, {3, 4, 16, 16});
  model.batch = 3;
  const auto videos = train::make_dataset(config, "train", false);
  for (const int64_t stride : {1, 3, 4, 6}) {
    model.config.data.clip_stride = stride;
    for (int64_t v = 0; v < videos.size(); ++v) {
      SCOPED_TRACE(c10::str("stride ", stride, ", video ", v));
      const auto expected = train::predict_clips(model, videos.load(v).frames);
      data::DecodedVideo decoded;
      const auto streamed =
          train::predict_clips_file(model, videos.entry(v).video, 0, {}, &decoded);
      EXPECT_EQ(streamed.starts, expected.starts);
      EXPECT_TRUE(torch::equal(streamed.labels, expected.labels));
      EXPECT_TRUE(torch::allclose(streamed.confidence, expected.confidence, 1e-5, 1e-6));
      EXPECT_EQ(static_cast<int64_t>(decoded.source_frames.size()), videos.frames(v));
    }
  }
  // A video shorter than one clip: the error predict_clips gives.
  model.input[1] = videos.frames(0) + 1;
  const auto message =
      test_util::error_message([&] { train::predict_clips_file(model, videos.entry(0).video, 0); });
  EXPECT_NE(message.find(c10::str("fewer than one clip of ", videos.frames(0) + 1)),
            std::string::npos)
      << message;
  test_util::remove_tree(config.train.out_dir);
}

TEST(ClipTraining, StopRequestEndsAtAStepBoundaryAndResumesExactly) {
  // Stopped mid-epoch (step 2) and at the end of the first epoch (after its validation): the
  // stopped run writes the checkpoint it ends with where none is due, and resuming it ends with
  // the uninterrupted run's weights.
  auto base = clips_config("/tmp/framefit_clips_stop_a");
  const auto full = train::train(base);
  const auto uninterrupted = checkpoint_weights(full.last_checkpoint);
  int64_t steps_per_epoch = 0;
  {
    std::ifstream log(base.train.out_dir + "/log.jsonl");
    for (std::string line; std::getline(log, line);) {
      if (line.find("\"type\":\"epoch\"") != std::string::npos) break;
      if (line.find("\"type\":\"step\"") != std::string::npos) ++steps_per_epoch;
    }
  }
  ASSERT_GT(steps_per_epoch, 2);
  ASSERT_EQ(full.steps, 2 * steps_per_epoch);
  // (stop after step, train.checkpoint_every): at the epoch's end with a step count that writes
  // no checkpoint there, the stop writes one that starts the next epoch.
  const std::vector<std::pair<int64_t, int64_t>> cases = {
      {2, 0}, {steps_per_epoch, 0}, {steps_per_epoch, steps_per_epoch + 1}};
  for (const auto& [stop_after, checkpoint_every] : cases) {
    SCOPED_TRACE(c10::str("stop after step ", stop_after, ", checkpoint_every ", checkpoint_every));
    auto config = clips_config("/tmp/framefit_clips_stop_b");
    config.train.checkpoint_every = checkpoint_every;
    int64_t steps = 0, epochs = 0;
    const auto stopped = train::train(
        config, "",
        [&](const train::Event& e) {
          steps += e.kind == train::Event::Kind::Step;
          epochs += e.kind == train::Event::Kind::Epoch;
        },
        [&] { return steps >= stop_after; });
    EXPECT_TRUE(stopped.stopped);
    EXPECT_EQ(stopped.steps, stop_after);
    EXPECT_EQ(epochs, stop_after == steps_per_epoch ? 1 : 0);  // the epoch ended first
    ASSERT_FALSE(stopped.last_checkpoint.empty());
    const auto resumed = train::train(config, "auto");
    EXPECT_FALSE(resumed.stopped);
    EXPECT_EQ(resumed.steps, full.steps);
    const auto weights = checkpoint_weights(resumed.last_checkpoint);
    ASSERT_EQ(weights.size(), uninterrupted.size());
    for (size_t i = 0; i < weights.size(); ++i)
      EXPECT_TRUE(torch::equal(weights[i], uninterrupted[i]));
    test_util::remove_tree(config.train.out_dir);
  }
  test_util::remove_tree(base.train.out_dir);
}

TEST(ClipTraining, AccumulatedBatchesTrainAsOneBatchOfTheirSamples) {
  // Without BatchNorm, two accumulated batches of 2 give the gradients of one batch of 4: the
  // same steps, the same weights (up to float32 summation order), class weights included.
  auto one = clips_config("/tmp/framefit_clips_accumulate_a");
  one.model.layers[1].type = "relu";
  one.train.optimizer = "sgd";
  one.train.lr = 0.05;
  one.train.epochs = 1;
  one.train.batch = 4;
  one.train.class_weights = true;
  std::vector<std::string> infos;
  const auto a = train::train(one, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
  });
  bool logged = false;
  for (const auto& m : infos)
    logged = logged || m.rfind("class weights (inverse frequency over the training clips)", 0) == 0;
  EXPECT_TRUE(logged);
  auto two = clips_config("/tmp/framefit_clips_accumulate_b");
  two.model.layers = one.model.layers;
  two.train.optimizer = one.train.optimizer;
  two.train.lr = one.train.lr;
  two.train.epochs = 1;
  two.train.batch = 2;
  two.train.accumulate = 2;
  two.train.class_weights = true;
  const auto b = train::train(two);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_GE(a.steps, 3);
  const auto wa = checkpoint_weights(a.last_checkpoint);
  const auto wb = checkpoint_weights(b.last_checkpoint);
  ASSERT_EQ(wa.size(), wb.size());
  for (size_t i = 0; i < wa.size(); ++i)
    EXPECT_TRUE(torch::allclose(wa[i], wb[i], 1e-4, 1e-6)) << "tensor " << i;
  // ... in the memory of one batch of 2: each step's peak below the batch of 4's.
  const auto peaks_a = step_peaks(one.train.out_dir), peaks_b = step_peaks(two.train.out_dir);
  ASSERT_EQ(peaks_a.size(), peaks_b.size());
  EXPECT_LT(*std::max_element(peaks_b.begin(), peaks_b.end()),
            *std::max_element(peaks_a.begin(), peaks_a.end()));
  // Smoothing is for frame sequences: an error, not silently ignored.
  auto smoothed = clips_config("/tmp/framefit_clips_accumulate_c");
  smoothed.train.smoothing = 0.15;
  EXPECT_NE(test_util::error_message([&] { train::train(smoothed); }).find("train.smoothing 0.15"),
            std::string::npos);
  EXPECT_TRUE(plan::has_errors(train::diagnose_batch_task(smoothed, 0)));
  auto no_eval_batch = clips_config("/tmp/framefit_clips_accumulate_d");
  no_eval_batch.train.eval_batch = 0;
  EXPECT_NE(test_util::error_message([&] {
              train::train(no_eval_batch);
            }).find("train.eval_batch 0: evaluation needs at least one sample per batch"),
            std::string::npos);
  for (const auto* c : {&one, &two, &smoothed, &no_eval_batch})
    test_util::remove_tree(c->train.out_dir);
}

TEST(ClipTraining, LearningRateFollowsTheSamplesPerStepWhenLrBatchIsSet) {
  // seeds/004: a batch that changes (planned for another budget, or with accumulation) without
  // rescaling the learning rate changes what training does. train.lr_batch names the samples per
  // step train.lr was set for; here 3 x 2 accumulated = 6 samples per step against 4.
  for (const std::string scaling : {"linear", "sqrt"}) {
    auto c = clips_config("/tmp/framefit_clips_lr_batch");
    c.train.batch = 3;
    c.train.accumulate = 2;
    c.train.max_steps = 2;
    c.train.lr = 0.02;
    c.train.lr_batch = 4;
    c.train.lr_scaling = scaling;
    std::vector<std::string> infos;
    train::train(c, "", [&](const train::Event& e) {
      if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
    });
    const double expected = scaling == "linear" ? 0.02 * 6 / 4 : 0.02 * std::sqrt(6.0 / 4);
    const auto lrs = log_values(c.train.out_dir, "step", "lr");
    ASSERT_EQ(lrs.size(), 2u);
    for (const double lr : lrs) EXPECT_NEAR(lr, expected, 1e-12) << scaling;
    bool told = false;
    for (const auto& m : infos)
      told = told || m.find(
                         "train.lr 0.02 is for 4 samples per step, train.lr_batch; 6 per step "
                         "here, scaled " +
                         scaling) != std::string::npos;
    EXPECT_TRUE(told) << scaling;
    test_util::remove_tree(c.train.out_dir);
  }
  // Without it the rate is train.lr whatever the batch.
  auto plain = clips_config("/tmp/framefit_clips_lr_plain");
  plain.train.max_steps = 1;
  plain.train.lr = 0.02;
  train::train(plain);
  EXPECT_EQ(log_values(plain.train.out_dir, "step", "lr"), std::vector<double>{0.02});
  test_util::remove_tree(plain.train.out_dir);
}

TEST(ClipTraining, Bfloat16RunsThroughEveryLayerType) {
  // bf16 autocast hands pooling and norms the convolutions' bf16 outputs. LibTorch 1.13 has no
  // CPU bf16 kernel for 3d max pooling, and its GroupNorm wants the parameters' dtype: a clip
  // network with maxpool, or with gn, failed on its first step.
  for (const bool group_norm : {false, true}) {
    auto c = clips_config("/tmp/framefit_clips_bf16");
    if (group_norm) {
      c.model.layers[1].type = "gn";
      c.model.layers[1].groups = 4;
      c.model.layers[3].type = "avgpool";
    }
    c.train.precision = engine::Precision::BF16;
    c.train.epochs = 1;
    if (cpu_bf16().kernels == Bf16Kernels::Unavailable) {
      // Asked for where no bf16 convolution runs (oneDNN capped at AVX2): refused, saying why.
      try {
        train::train(c);
        ADD_FAILURE() << "bf16 training ran where " << cpu_bf16().reason;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("cannot run here"), std::string::npos) << e.what();
      }
      test_util::remove_tree(c.train.out_dir);
      GTEST_SKIP() << "no bf16 kernels to run through: " << cpu_bf16().reason;
    }
    const auto result = train::train(c);
    EXPECT_GE(result.steps, 1);
    EXPECT_EQ(static_cast<int64_t>(step_peaks(c.train.out_dir).size()), result.steps);
    test_util::remove_tree(c.train.out_dir);
  }
}

TEST(ClipTraining, RunEndedBeforeItsFirstValidationLeavesItsLastWeightsAsBest) {
  // train.max_steps within the first epoch: no validation ran, so nothing chose a best.pt, and
  // eval or export of the run's best.pt found no file.
  auto c = clips_config("/tmp/framefit_clips_no_validation");
  c.train.max_steps = 1;
  std::vector<std::string> infos;
  const auto result = train::train(c, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
  });
  ASSERT_EQ(result.steps, 1);
  ASSERT_TRUE(std::filesystem::exists(result.best_checkpoint));
  const auto best = checkpoint_weights(result.best_checkpoint);
  const auto last = checkpoint_weights(result.last_checkpoint);
  ASSERT_EQ(best.size(), last.size());
  for (size_t i = 0; i < best.size(); ++i) EXPECT_TRUE(torch::equal(best[i], last[i])) << i;
  EXPECT_NE(std::find_if(infos.begin(), infos.end(),
                         [](const std::string& m) {
                           return m.find("before a validation chose a best") != std::string::npos;
                         }),
            infos.end());
  // Resumed and ended again before any validation: best.pt follows the last weights.
  c.train.max_steps = 2;
  const auto again = train::train(c, "auto");
  ASSERT_EQ(again.steps, 2);
  const auto best2 = checkpoint_weights(again.best_checkpoint);
  const auto last2 = checkpoint_weights(again.last_checkpoint);
  for (size_t i = 0; i < best2.size(); ++i) EXPECT_TRUE(torch::equal(best2[i], last2[i])) << i;
  test_util::remove_tree(c.train.out_dir);
}

namespace {

// Demo videos (MP4 only) of size x size pixels, `train` for training and one for validation,
// in a new folder named after `prefix`, as `c`'s data (resized and cropped to their size).
std::string use_square_videos(train::Config& c, const std::string& prefix, int64_t train,
                              int64_t min_frames, int64_t max_frames, int64_t size) {
  const std::string dir = prefix + "_" + std::to_string(::getpid());
  data::DemoOptions demo;
  demo.train_videos = train;
  demo.val_videos = 1;
  demo.test_videos = 0;
  demo.min_frames = min_frames;
  demo.max_frames = max_frames;
  demo.width = demo.height = size;
  demo.frame_folders = false;
  data::make_demo(dir, demo);
  c.data.manifest = dir + "/manifest.csv";
  c.data.resize = size;
  c.data.crop = size;
  return dir;
}

}  // namespace

TEST(ClipTraining, DecodedVideosHeldAheadStayWithinTheBudgetsPrefetchReserve) {
  // A budget whose quarter is below data.prefetch_bytes: the loader holds what the plan leaves it
  // (the budget less the step budget), not data.prefetch_bytes. It held up to 256 MiB of decoded
  // videos beside the planned step, and a 24 MiB run of configs/demo_clips.yaml ran out of memory.
  // 8 videos of about 2 MiB each decoded (64 x 64): 16 MiB if all are ahead.
  auto c = clips_config("/tmp/framefit_clips_reserve");
  const auto dir = use_square_videos(c, "/tmp/framefit_reserve_data", 8, 300, 360, 64);
  c.train.batch = 2;
  c.train.max_steps = 40;
  c.train.budget = 16 << 20;  // a 4 MiB prefetch reserve
  ASSERT_GT(c.data.prefetch_bytes, c.train.budget);
  const auto result = train::train(c, "");
  EXPECT_EQ(result.steps, 40);
  for (const auto peak : step_peaks(c.train.out_dir)) EXPECT_LE(peak, c.train.budget);
  test_util::remove_tree(c.train.out_dir);
  test_util::remove_tree(dir);
}

TEST(ClipTraining, DecodedVideosBesideThePlannedStepStayWithinTheBudget) {
  // Videos larger than the prefetch reserve: one is decoded ahead alone while training cuts
  // clips from another, and a batch may span two. The plan leaves room for both; the planned
  // step filled the budget less the reserve, and the videos beside it ran out of memory.
  // About 4.4 MiB each decoded at 32 x 32: more than the 4 MiB reserve.
  auto c = clips_config("/tmp/framefit_clips_unit_reserve");
  const auto dir = use_square_videos(c, "/tmp/framefit_unit_reserve_data", 3, 1500, 1600, 32);
  c.data.fps = 0;
  c.data.clip_length = 8;
  c.data.clip_stride = 8;
  c.train.batch = std::nullopt;
  c.train.epochs = 1;
  c.train.budget = 16 << 20;
  std::vector<std::string> warnings;
  const auto result = train::train(c, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Warning) warnings.push_back(e.message);
  });
  EXPECT_GT(result.steps, 20);
  EXPECT_TRUE(warnings.empty()) << warnings.front();
  EXPECT_EQ(result.skipped_videos, 0);
  for (const auto peak : step_peaks(c.train.out_dir)) EXPECT_LE(peak, c.train.budget);
  test_util::remove_tree(c.train.out_dir);
  test_util::remove_tree(dir);
}

TEST(ClipTraining, TimeSpentGettingDataIsLoggedAndADataBoundRunIsToldWhatToChange) {
  // Pooling and a linear layer (nothing to compute) on clips of every frame of 192 x 192 videos
  // through one decoding worker: nearly all of the loop's time goes to decoding.
  auto c = clips_config("/tmp/framefit_clips_data_bound");
  const auto dir = use_square_videos(c, "/tmp/framefit_data_bound_data", 3, 400, 450, 192);
  c.model.layers.erase(c.model.layers.begin(), c.model.layers.begin() + 5);
  c.data.fps = 0;
  c.data.workers = 1;
  c.data.augment = true;  // and slow augmentations, done by the worker
  c.data.rotation = 10;
  c.data.hue = 0.1;
  c.data.clip_length = 8;
  c.data.clip_stride = 8;
  c.train.batch = 16;
  c.train.validate = false;
  std::vector<double> fractions;
  std::vector<std::string> warnings;
  const auto result = train::train(c, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Epoch) fractions.push_back(e.data_fraction);
    if (e.kind == train::Event::Kind::Warning) warnings.push_back(e.message);
  });
  ASSERT_EQ(fractions.size(), 2u);
  for (const double f : fractions) EXPECT_GT(f, 0.5);
  // Said once, naming what to change. Nothing else: the decoded videos held ahead (about 45 MiB each,
  // of different lengths) are not taken for a leak (memory::PipelineThreadScope).
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("epoch 1: "), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("went to getting data"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("data.workers (now 1;"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("colour jitter and rotation"), std::string::npos) << warnings[0];
  // The log: each step's time getting its batch, summed in its epoch's record.
  const auto step_data = log_values(c.train.out_dir, "step", "data_seconds");
  const auto step_epochs = log_values(c.train.out_dir, "step", "epoch");
  const auto epoch_data = log_values(c.train.out_dir, "epoch", "data_seconds");
  ASSERT_EQ(epoch_data.size(), 2u);
  ASSERT_EQ(step_data.size(), static_cast<size_t>(result.steps));
  double sums[2] = {0, 0};
  for (size_t i = 0; i < step_data.size(); ++i) {
    EXPECT_GE(step_data[i], 0);
    sums[static_cast<int>(step_epochs[i]) - 1] += step_data[i];
  }
  for (int e = 0; e < 2; ++e) {
    EXPECT_NEAR(sums[e], epoch_data[e], 1e-6 * epoch_data[e]);
    EXPECT_GE(epoch_data[e], 1.0);
  }
  test_util::remove_tree(c.train.out_dir);
  test_util::remove_tree(dir);
}

TEST(ClipTraining, WeightsLargerThanTheBudgetAreNamedBeforeTheNetworkIsBuilt) {
  // A 324 MiB convolution weight under a 64 MiB budget: building the planner's probe network
  // allocated it and ended in an out-of-memory error (the system's, when it was larger still).
  auto c = clips_config("/tmp/framefit_clips_huge_weight");
  c.train.budget = 64 << 20;
  c.model.layers[0].out = 1 << 20;
  c.model.layers.erase(c.model.layers.begin() + 1);  // no BatchNorm
  auto& tracker = memory::Tracker::cpu();
  tracker.reset_peak();
  const auto before = tracker.peak_bytes();
  const auto message = test_util::error_message([&] { train::train(c, "", {}); });
  EXPECT_NE(message.find("conv3d0.weight alone is 324.00 MiB (84,934,656 float32 values), more "
                         "than the whole budget of 64.00 MiB"),
            std::string::npos)
      << message;
  EXPECT_LT(tracker.peak_bytes(), before + (64 << 20)) << "the weight was allocated";
  // A clips run's folder is locked as a phases run's is (Training.RunsLogsCheckpoints...).
  {
    const test_util::HeldRunLock running(c.train.out_dir, "4343");
    ASSERT_TRUE(running.held());
    EXPECT_NE(test_util::error_message([&] {
                train::train(c, "", {});
              }).find("is in use by another framefit train (process 4343)"),
              std::string::npos);
  }
  // Parameters that fit one by one, but not with their gradients and Adam's state.
  c.model.layers[0].out = 100000;
  const auto state = test_util::error_message([&] { train::train(c, "", {}); });
  EXPECT_NE(state.find("with their gradients and adamw state take"), std::string::npos) << state;
  EXPECT_NE(state.find("not less than the budget of 64.00 MiB"), std::string::npos) << state;
  test_util::remove_tree(c.train.out_dir);
}

TEST(ClipTraining, BudgetAboveWhatTheSystemHasIsWarnedOf) {
  auto c = clips_config("/tmp/framefit_clips_big_budget");
  const auto warnings_of = [&c] {
    std::vector<std::string> warnings;
    train::plan_batch_task(c, memory::Tracker::cpu(), [&](const train::Event& e) {
      if (e.kind == train::Event::Kind::Warning) warnings.push_back(e.message);
    });
    return warnings;
  };
  c.train.budget = int64_t{1} << 50;  // planned for, as the user's word, but not without a word
  const auto warnings = warnings_of();
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings[0].find("train.budget 1024.00 TiB is more than the system's available "
                             "memory ("),
            std::string::npos)
      << warnings[0];
  EXPECT_NE(warnings[0].find("swap or be stopped by the system"), std::string::npos);
  c.train.budget = 64 << 20;
  for (const auto& w : warnings_of()) EXPECT_EQ(w.find("train.budget"), std::string::npos) << w;
  test_util::remove_tree(c.train.out_dir);
}

TEST(ClipTraining, CheckpointThatCannotBeWrittenIsAnErrorNotACrash) {
  // A disk full when a checkpoint is written: LibTorch's archive writer used to abort the
  // process ("terminate called", exit 134) and leave a partial temporary file behind.
  auto c = clips_config("/tmp/framefit_clips_full_disk");
  c.train.max_steps = 2;
  c.train.checkpoint_every = 1;
  c.train.validate = false;
  std::string message;
  {
    test_util::FileSizeLimit limit(4 << 10);  // config.yaml and log.jsonl fit, checkpoints do not
    message = test_util::error_message([&] { train::train(c, "", {}); });
  }
  const auto checkpoint = c.train.out_dir + "/checkpoints/step_00000001.pt";
  EXPECT_NE(message.find("writing '" + checkpoint + "' failed: File too large"), std::string::npos)
      << message;
  EXPECT_NE(message.find("resume with --resume auto"), std::string::npos) << message;
  EXPECT_FALSE(std::ifstream(checkpoint + ".tmp").good());
  EXPECT_FALSE(std::ifstream(checkpoint).good());
  test_util::remove_tree(c.train.out_dir);
}

TEST(ClipTraining, TensorsKeptAcrossStepsAreReportedAsALeak) {
  // A progress callback that keeps 2 MiB per step (as code keeping each step's loss with its
  // graph would): the bytes training keeps between steps grow, and the run says so, once per
  // window of steps. Without it the same run is quiet.
  for (const bool keep : {false, true}) {
    auto c = clips_config("/tmp/framefit_clips_leak");
    c.train.batch = 2;
    c.train.epochs = 100;
    c.train.max_steps = 16;
    c.train.validate = false;
    std::vector<torch::Tensor> kept;
    std::vector<std::string> leaks;
    train::train(c, "", [&](const train::Event& e) {
      if (e.kind == train::Event::Kind::Step && keep) kept.push_back(torch::zeros({1 << 19}));
      if (e.kind == train::Event::Kind::Warning &&
          e.message.find("possible memory leak") != std::string::npos)
        leaks.push_back(e.message);
    });
    if (keep) {
      ASSERT_EQ(leaks.size(), 1u);
      EXPECT_NE(leaks[0].find("grew"), std::string::npos) << leaks[0];
    } else {
      EXPECT_TRUE(leaks.empty()) << leaks[0];
    }
    test_util::remove_tree(c.train.out_dir);
  }
}

TEST(ClipTraining, DivergedRunStopsAndCheckpointsTheWeightsBeforeItsNaNSteps) {
  // AdamW moves every weight by about lr: at 1e37 the first step's weights make the second
  // step's activations overflow, and the loss is NaN from then on. Three such steps in a row end
  // the run; their updates were skipped, so the checkpoint it writes has the first step's
  // weights and BatchNorm statistics (already far off: the message says so).
  auto c = clips_config("/tmp/framefit_clips_diverged");
  c.train.lr = 1e37;
  c.train.checkpoint_every = 1;
  c.train.keep_last = 10;
  c.train.validate = false;
  std::vector<std::string> warnings;
  const auto message = test_util::error_message([&] {
    train::train(c, "", [&](const train::Event& e) {
      if (e.kind == train::Event::Kind::Warning) warnings.push_back(e.message);
    });
  });
  EXPECT_NE(message.find("training diverged: the loss was not finite (NaN or infinite) in 3 steps "
                         "in a row"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("lower train.lr (now 1e+37), set train.clip_grad_norm"), std::string::npos)
      << message;
  const auto last = c.train.out_dir + "/checkpoints/step_00000004.pt";
  EXPECT_NE(message.find(last + " holds the weights the last finite step left"), std::string::npos)
      << message;
  ASSERT_EQ(warnings.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(warnings[i].rfind("step " + std::to_string(i + 2) + ": the loss is ", 0), 0)
        << warnings[i];
  }
  // The log marks the skipped updates (the loss is null: JSON has no NaN).
  std::ifstream log(c.train.out_dir + "/log.jsonl");
  int skipped = 0;
  for (std::string line; std::getline(log, line);) {
    skipped += line.find("\"loss\":null") != std::string::npos &&
               line.find("\"skipped_optimizer_step\":true") != std::string::npos;
  }
  EXPECT_EQ(skipped, 3);
  const auto after_first = checkpoint_weights(c.train.out_dir + "/checkpoints/step_00000001.pt");
  const auto kept = checkpoint_weights(last);
  ASSERT_EQ(kept.size(), after_first.size());
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_TRUE(torch::equal(kept[i], after_first[i])) << i;
  test_util::remove_tree(c.train.out_dir);
}

TEST(ClipTraining, PlannerTakesTheLeanConvolutionBackwardOnlyForTwiceTheBatch) {
  // R3D-18 on 4 x 32 x 32 clips: layer2 to layer4 have at most 2x4x4 output positions, where
  // oneDNN's backward holds weight-sized buffers (layer4's weights are 27 MiB each) and the lean
  // backward (models/conv3d.h) does not; oneDNN's is the faster.
  auto config = clips_config("/tmp/framefit_clips_lean");
  config.model.network = "r3d_18";
  config.model.layers.clear();
  config.data.resize = 32;
  config.data.crop = 32;
  config.train.batch = std::nullopt;
  config.train.optimizer = "sgd";  // no moments: the static part is the weights and gradients
  config.data.prefetch_bytes = 8 << 20;
  std::vector<train::BatchTaskPlan> plans;
  for (const auto& [lean, budget] : std::vector<std::pair<std::optional<bool>, int64_t>>{
           {std::nullopt, 2ll << 30}, {std::nullopt, 640ll << 20}, {false, 640ll << 20}}) {
    config.model.lean_backward = lean;
    config.train.budget = budget;
    plans.push_back(train::plan_batch_task(config, memory::Tracker::cpu()));
  }
  // Every training clip fits either way: oneDNN's backward, the faster.
  EXPECT_EQ(plans[0].batch, plans[0].samples);
  EXPECT_FALSE(plans[0].lean_backward);
  // A tighter budget: the lean backward fits a larger batch than oneDNN's ...
  EXPECT_TRUE(plans[1].lean_backward);
  EXPECT_NE(plans[1].describe().find("lean convolution backward"), std::string::npos);
  EXPECT_FALSE(plans[2].lean_backward);
  EXPECT_GT(plans[1].batch, plans[2].batch);
  // ... and trains within it (that batch fixed: nothing to plan again).
  config.model.lean_backward = std::nullopt;
  config.train.batch = plans[1].batch;
  config.train.max_steps = 2;
  const auto result = train::train(config);
  EXPECT_EQ(result.steps, 2);
  for (const auto peak : step_peaks(config.train.out_dir)) EXPECT_LE(peak, 640ll << 20);
  test_util::remove_tree(config.train.out_dir);
}

TEST(SegmentationTraining, PatienceEndsTheRunAndItsCountSurvivesAResume) {
  // No learning (a rate too small to move a float32 weight) and no batch statistics: every
  // validation alike, so with patience 2 the run ends after epoch 3 of 6. Resumed, it carries
  // the two stale epochs and ends after epoch 4 (counting afresh would run to epoch 5).
  auto config = segmentation_config("/tmp/framefit_segmentation_patience");
  config.model.norm = "group_norm";
  config.model.groups = 4;
  config.train.lr = 1e-30;
  config.train.epochs = 6;
  config.train.patience = 2;
  const auto first = train::train(config);
  EXPECT_TRUE(first.stopped_early);
  const auto epochs = [&] {
    std::ifstream log(config.train.out_dir + "/log.jsonl");
    int64_t n = 0;
    for (std::string line; std::getline(log, line);)
      n += line.find("\"type\":\"epoch\"") != std::string::npos;
    return n;
  };
  EXPECT_EQ(epochs(), 3);
  const auto resumed = train::train(config, "auto");
  EXPECT_TRUE(resumed.stopped_early);
  EXPECT_EQ(epochs(), 4);
  // Its best epoch came before the resume: reported from the log (it was reported as none).
  ASSERT_TRUE(resumed.validated);
  EXPECT_EQ(train::to_json(resumed.best, config.data.classes),
            train::to_json(first.best, config.data.classes));
  // A run of another task resumed from this checkpoint is refused before any data is read (it
  // failed on a missing tensor's name).
  auto phases = config;
  phases.task = "phases";
  phases.train.out_dir = config.train.out_dir + "_phases";
  const auto other =
      test_util::error_message([&] { train::train(phases, config.train.out_dir + "/best.pt"); });
  EXPECT_NE(other.find("a checkpoint of task segmentation, and this config is for task phases"),
            std::string::npos)
      << other;
  // best.pt has no optimizer state to go on with (LibTorch said "No such serialized submodule").
  const auto weights_only =
      test_util::error_message([&] { train::train(config, config.train.out_dir + "/best.pt"); });
  EXPECT_NE(weights_only.find("holds the weights alone, as best.pt does; resume from a step "
                              "checkpoint"),
            std::string::npos)
      << weights_only;
  test_util::remove_tree(phases.train.out_dir);
  test_util::remove_tree(config.train.out_dir);
}

TEST(SegmentationTraining, IgnoredMaskPixelsCountInNeitherTheLossNorTheMetrics) {
  // The tiny data set's masks with a 2-pixel frame of 255, as Pascal VOC marks object borders.
  auto config = segmentation_config("/tmp/framefit_segmentation_ignore");
  const std::string root = config.train.out_dir + "_data";
  test_util::remove_tree(root);
  for (const std::string split : {"train", "val"}) {
    const auto from = tiny_data() + "/segmentation/" + split;
    std::filesystem::create_directories(root + "/" + split + "/masks");
    std::filesystem::copy(from + "/images", root + "/" + split + "/images");
    for (const auto& mask : data::list_images(from + "/masks")) {
      auto ids = data::read_label_image(mask);
      auto framed = torch::full_like(ids, 255);
      framed.slice(0, 2, -2).slice(1, 2, -2).copy_(ids.slice(0, 2, -2).slice(1, 2, -2));
      data::write_image(root + "/" + split + "/masks/" + mask.substr(mask.rfind('/') + 1),
                        framed.to(torch::kUInt8).unsqueeze(0).repeat({3, 1, 1}));
    }
  }
  config.data.images = root + "/{split}/images";
  config.data.masks = root + "/{split}/masks";
  config.train.epochs = 1;
  config.train.batch = 4;
  config.train.class_weights = true;  // class counts leave the frame out too
  EXPECT_NE(test_util::error_message([&] { train::train(config); })
                .find("has class id 255 but there are 3 classes (ids 0..2); if 255 marks pixels "
                      "to leave out (object borders, unlabelled), set data.ignore_id: 255"),
            std::string::npos);
  test_util::remove_tree(config.train.out_dir);
  config.data.ignore_id = 255;
  const auto result = train::train(config);
  ASSERT_TRUE(result.validated);
  EXPECT_EQ(result.best.frames, 4 * 28 * 28);  // 4 validation masks, each 28 x 28 inside
  // eval and predict do not rebuild the trained model another way.
  const auto wider = test_util::error_message(
      [&] { train::load_batch_model(result.best_checkpoint, {"model.width=16"}); });
  EXPECT_NE(wider.find("holds a trained model, which --set cannot change: model.width: 8 -> 16"),
            std::string::npos)
      << wider;
  EXPECT_NE(test_util::error_message([&] {
              train::load_batch_model(result.best_checkpoint, {"task=clips"});
            }).find("task: segmentation -> clips"),
            std::string::npos);
  // Evaluation's metrics are those of the predicted masks over the counted pixels alone.
  auto model = train::load_batch_model(result.best_checkpoint);
  const auto val_images = data::list_images(root + "/val/images");
  const auto masks = train::predict_masks(model, val_images);
  train::ConfusionMatrix confusion(model.classes.size());
  for (size_t i = 0; i < val_images.size(); ++i) {
    const auto name = val_images[i].substr(val_images[i].rfind('/') + 1);
    const auto truth = data::read_label_image(root + "/val/masks/" + name).flatten();
    const auto counted = truth.ne(255);
    confusion.add(masks[i].flatten().masked_select(counted), truth.masked_select(counted));
  }
  const auto expected = confusion.metrics();
  EXPECT_EQ(expected.frames, 4 * 28 * 28);
  EXPECT_NEAR(expected.macro_jaccard, result.best.macro_jaccard, 1e-12);
  EXPECT_NEAR(expected.accuracy, result.best.accuracy, 1e-12);
  test_util::remove_tree(config.train.out_dir);

  // An ignore id that is a class's, or one for a task without masks, is refused up front.
  config.data.ignore_id = 1;
  EXPECT_NE(test_util::error_message([&] {
              train::train(config);
            }).find("data.ignore_id 1 is the id of class"),
            std::string::npos);
  test_util::remove_tree(config.train.out_dir);
  test_util::remove_tree(root);
}

TEST(SegmentationTraining, PlansTheBatchWithinTheBudgetAndLearns) {
  auto config = segmentation_config("/tmp/framefit_segmentation");
  config.train.epochs = 30;
  config.train.budget = 4 << 20;  // small enough that the planner chooses the batch
  config.data.prefetch_bytes = 512 << 10;
  std::vector<std::string> infos, warnings;
  const auto result = train::train(config, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
    if (e.kind == train::Event::Kind::Warning) warnings.push_back(e.message);
  });
  std::string plan;
  for (const auto& m : infos)
    if (m.rfind("plan: batch", 0) == 0) plan = m;
  ASSERT_FALSE(plan.empty());
  // The budget binds: fewer than all 10 images per batch, some stages recomputed.
  EXPECT_EQ(plan.find("batch 10,"), std::string::npos) << plan;
  EXPECT_EQ(plan.find(" 0 of "), std::string::npos) << plan;
  // No step needed a retry, and every step's measured peak stayed in the budget.
  EXPECT_TRUE(warnings.empty()) << warnings.front();
  const auto peaks = step_peaks(config.train.out_dir);
  for (const auto peak : peaks) EXPECT_LE(peak, config.train.budget);
  EXPECT_EQ(static_cast<int64_t>(peaks.size()), result.steps);
  ASSERT_TRUE(result.validated);
  // Per pixel: 4 validation images of 32 x 32; better than calling everything background.
  EXPECT_EQ(result.best.frames, 4 * 32 * 32);
  EXPECT_GT(result.best.macro_jaccard, 0.3);
  // Validation's batch was planned on its own (eval mode, no grad) within the same budget: more
  // than a training batch; the checkpoint keeps it.
  const auto eval_at = plan.find("; evaluation batch ");
  ASSERT_NE(eval_at, std::string::npos) << plan;
  const int64_t eval_batch = std::stoll(plan.substr(eval_at + 19));
  EXPECT_GT(eval_batch, std::stoll(plan.substr(12))) << plan;
  auto model = train::load_batch_model(result.best_checkpoint);
  EXPECT_EQ(model.batch, eval_batch);
  const auto again = train::evaluate_batch(model, "val");
  EXPECT_NEAR(again.macro_jaccard, result.best.macro_jaccard, 1e-12);
  // framefit eval's path scores it the same; per-frame options are refused, naming the task.
  train::EvaluationRequest request;
  request.checkpoint = result.best_checkpoint;
  request.split = "val";
  const auto evaluation = train::evaluate_checkpoint(request);
  EXPECT_EQ(evaluation.metrics.frames, again.frames);
  EXPECT_NEAR(evaluation.metrics.macro_jaccard, again.macro_jaccard, 1e-12);
  EXPECT_TRUE(evaluation.per_video.empty());
  request.relaxed_rules = "general";
  const auto refused = test_util::error_message([&] { train::evaluate_checkpoint(request); });
  EXPECT_NE(refused.find("this one is for task segmentation"), std::string::npos) << refused;

  // Predicted masks are evaluation's classes: over the validation images, the same mean IoU. An
  // image of another size is read at the network's size and its mask comes back at its own.
  const auto val_images = data::list_images(tiny_data() + "/segmentation/val/images");
  ASSERT_EQ(val_images.size(), 4u);
  const auto masks = train::predict_masks(model, val_images);
  train::ConfusionMatrix confusion(model.classes.size());
  for (size_t i = 0; i < val_images.size(); ++i) {
    const auto name = val_images[i].substr(val_images[i].rfind('/') + 1);
    auto truth = torch::empty({3, 32, 32}, torch::kUInt8);
    data::read_image(tiny_data() + "/segmentation/val/masks/" + name, truth);
    confusion.add(masks[i].flatten(), truth[0].to(torch::kLong).flatten());
  }
  EXPECT_NEAR(confusion.metrics().macro_jaccard, result.best.macro_jaccard, 1e-12);
  auto wide = torch::empty({3, 40, 56}, torch::kUInt8);
  data::read_image(val_images[0], wide);
  const std::string wide_path = config.train.out_dir + "/wide.png";
  data::write_image(wide_path, wide);
  const auto wide_mask = train::predict_masks(model, {wide_path});
  ASSERT_EQ(wide_mask.size(), 1u);
  EXPECT_EQ(wide_mask[0].sizes(), (std::vector<int64_t>{40, 56}));
  auto at_network_size = torch::empty({1, 3, 32, 32}, torch::kUInt8);
  data::read_image(wide_path, at_network_size[0]);
  const auto classes = train::predict_batch(model, at_network_size).argmax(1)[0];
  EXPECT_TRUE(wide_mask[0].equal(data::resize_labels(classes, 40, 56)));

  // Evaluation that runs out of memory splits the batch and goes on: a budget between the peaks
  // of batches of 1 and of 4 gives the same metrics, with a warning, in batches of 2.
  auto& tracker = memory::Tracker::cpu();
  const auto peak_at = [&](int64_t batch) {
    model.batch = batch;
    auto window = tracker.mark();
    train::evaluate_batch(model, "val");
    return window.peak_bytes() - window.entry_bytes();
  };
  const int64_t one = peak_at(1), four = peak_at(4);
  ASSERT_GT(four, one + (256 << 10));
  std::vector<std::string> split_warnings;
  train::PhaseMetrics split;
  {
    memory::ScopedBudget budget(tracker, tracker.current_bytes() + (one + four) / 2);
    split = train::evaluate_batch(model, "val", [&](const train::Event& e) {
      if (e.kind == train::Event::Kind::Warning) split_warnings.push_back(e.message);
    });
  }
  ASSERT_EQ(split_warnings.size(), 1u);
  EXPECT_EQ(split_warnings[0],
            "evaluation ran out of memory at a batch of 4; continuing with batches of 2");
  EXPECT_EQ(model.batch, 2);
  EXPECT_NEAR(split.macro_jaccard, result.best.macro_jaccard, 1e-12);
  test_util::remove_tree(config.train.out_dir);
}

TEST(SegmentationTraining, BatchNormIsRecomputedWhereCheckpointingIsAndResumesExactly) {
  // models/norm_relu_conv.h: with train.checkpointing all, and auto unless a fixed batch needs
  // no recomputation; never with off.
  auto config = segmentation_config("/tmp/framefit_segmentation_norm");
  config.train.budget = 4 << 20;
  config.data.prefetch_bytes = 512 << 10;
  const auto planned =
      train::plan_batch_task(config, memory::Tracker::cpu());  // auto: the largest batch
  EXPECT_TRUE(planned.recompute_norm);
  EXPECT_NE(planned.describe().find(", BatchNorm recomputed"), std::string::npos)
      << planned.describe();
  auto roomy = config;
  roomy.train.budget = 512 << 20;
  roomy.train.batch = 2;
  const auto fits = train::plan_batch_task(roomy, memory::Tracker::cpu());
  const auto flags = engine::recomputed(fits.segments);
  EXPECT_EQ(std::count(flags.begin(), flags.end(), true), 0);
  EXPECT_FALSE(fits.recompute_norm);
  roomy.train.checkpointing = plan::Recompute::EveryStage;
  EXPECT_TRUE(train::plan_batch_task(roomy, memory::Tracker::cpu()).recompute_norm);
  config.train.checkpointing = plan::Recompute::Nothing;
  EXPECT_FALSE(train::plan_batch_task(config, memory::Tracker::cpu()).recompute_norm);

  // A run with it, interrupted after step 3 and resumed, ends with the uninterrupted run's
  // weights and BatchNorm statistics.
  config.train.checkpointing = plan::Recompute::AsNeeded;
  config.train.schedule = "constant";  // cosine spans train.max_steps, which stops the first part
  config.train.epochs = 2;
  config.train.checkpoint_every = 1;
  const auto interrupted_dir =
      segmentation_config("/tmp/framefit_segmentation_norm_b").train.out_dir;
  expect_exact_resume(config, interrupted_dir, 3);
  test_util::remove_tree(config.train.out_dir);
  test_util::remove_tree(interrupted_dir);
}

TEST(SegmentationTraining, FixedBatchOverTheBudgetIsPlannedAsMicroBatches) {
  // The budget in which the planner chose fewer than 10 images per batch (test above), with a
  // fixed train.batch beyond the 10 training images: capped at them, and run as the fewest
  // micro-batches that fit, planned before the first step instead of found by running out.
  auto config = segmentation_config("/tmp/framefit_segmentation_micro");
  config.train.epochs = 1;
  config.train.budget = 4 << 20;
  config.data.prefetch_bytes = 512 << 10;
  config.train.batch = 1000;
  const auto plan = train::plan_batch_task(config, memory::Tracker::cpu());
  EXPECT_EQ(plan.batch, 10);
  EXPECT_EQ(plan.samples, 10);
  EXPECT_GT(plan.micro_batches, 1);
  EXPECT_TRUE(plan.recompute_norm);  // a fixed batch that needs recomputation
  EXPECT_LE(plan.predicted_peak_bytes, plan.budget.step);
  EXPECT_NE(plan.describe().find(c10::str("batch 10 in ", plan.micro_batches, " micro-batches")),
            std::string::npos)
      << plan.describe();
  std::vector<std::string> warnings;
  const auto result = train::train(config, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Warning) warnings.push_back(e.message);
  });
  EXPECT_EQ(result.steps, 1);
  EXPECT_TRUE(warnings.empty()) << warnings.front();  // no step ran out of memory
  for (const auto peak : step_peaks(config.train.out_dir)) EXPECT_LE(peak, config.train.budget);
  test_util::remove_tree(config.train.out_dir);
}

TEST(SegmentationTraining, TorchScriptNetworkTrainsAndItsCheckpointLoadsWithoutTheFile) {
  auto config = segmentation_config("/tmp/framefit_segmentation_script");
  config.model.network = "torchscript";
  torch::manual_seed(5);
  config.model.script = test_util::write_script_module(
      config.train.out_dir + ".pt",
      {{"w1", torch::randn({8, 3, 3, 3}) * 0.3}, {"w2", torch::randn({3, 8, 1, 1}) * 0.3}},
      R"(
def forward(self, x):
    return torch.conv2d(torch.relu(torch.conv2d(x, self.w1, None, [1, 1], [1, 1])), self.w2)
)");
  config.train.batch = 4;
  config.train.eval_batch = 3;  // a count is taken as given, and kept with the checkpoints
  config.train.class_weights = true;
  std::string weights_line;
  const auto result = train::train(config, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info && e.message.rfind("class weights", 0) == 0)
      weights_line = e.message;
  });
  ASSERT_TRUE(result.validated);
  // Class weights from the training masks' pixels: the background, most pixels, weighs least.
  data::SegmentationOptions options;
  options.classes = static_cast<int64_t>(config.data.classes.size());
  const data::SegmentationDataset masks(tiny_data() + "/segmentation/train/images",
                                        tiny_data() + "/segmentation/train/masks", options);
  auto counts = torch::zeros({options.classes}, torch::kLong);
  for (int64_t i = 0; i < masks.size(); ++i)
    counts += torch::bincount(masks.mask(i).flatten(), {}, options.classes);
  const auto weights = engine::inverse_frequency_weights(counts);
  EXPECT_LT(weights[0].item<double>(), 1.0);
  char expected[64];
  std::snprintf(expected, sizeof(expected), "%s %.3g, %s %.3g", config.data.classes[0].c_str(),
                weights[0].item<double>(), config.data.classes[1].c_str(),
                weights[1].item<double>());
  EXPECT_NE(weights_line.find(std::string("over the training pixels): ") + expected),
            std::string::npos)
      << weights_line << " vs " << expected;
  std::remove(config.model.script.c_str());
  auto model = train::load_batch_model(result.best_checkpoint);
  EXPECT_EQ(model.batch, 3);
  const auto again = train::evaluate_batch(model, "val");
  EXPECT_NEAR(again.macro_jaccard, result.best.macro_jaccard, 1e-12);
  test_util::remove_tree(config.train.out_dir);
}
#endif
