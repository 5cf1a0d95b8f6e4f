// Configs, metrics, schedules, and training runs on a tiny demo data set: learning, checkpoints,
// exact resume, evaluation, prediction and export.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "test_util.h"

#include "framefit/data/demo.h"
#include "framefit/data/labels.h"
#include "framefit/data/media.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/heads.h"
#include "framefit/models/weights.h"
#include "framefit/plan/planner.h"
#include "framefit/train/config.h"
#include "framefit/train/metrics.h"
#include "framefit/train/schedule.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"
#include "framefit/train/timeline.h"
#include "framefit/train/trainer.h"
#include "train/tasks/plans.h"

using namespace framefit;

TEST(Config, AutoValuesAreTypedWhenLoaded) {
  // "auto" is nullopt (or the enum's auto); a value is held as what it means, and written back
  // as it was given.
  const auto defaults = train::parse_config("", "test");
  EXPECT_FALSE(defaults.train.chunk || defaults.train.keep || defaults.train.batch ||
               defaults.train.eval_batch || defaults.train.precision || defaults.train.best_by ||
               defaults.model.recompute_norm || defaults.model.lean_backward);
  EXPECT_EQ(defaults.train.checkpointing, plan::Recompute::AsNeeded);
  EXPECT_EQ(defaults.model.layout, models::ActivationLayout::Auto);
  EXPECT_EQ(defaults.data.features_layout, data::FeatureLayout::Auto);
  EXPECT_TRUE(defaults.train.cache_features);
  const auto c = train::parse_config(
      "model:\n  recompute_norm: true\n  lean_backward: false\n  layout: channels_last\n"
      "data:\n  features_layout: D,T\ntrain:\n  chunk: 0\n  keep: 2\n  precision: bf16\n"
      "  batch: 6\n  eval_batch: 12\n  best_by: edit\n  checkpointing: all\n"
      "  cache_features: off\n",
      "test");
  EXPECT_EQ(c.train.chunk, 0);  // naive, not auto
  EXPECT_EQ(c.train.keep, 2);
  EXPECT_EQ(c.train.precision, engine::Precision::BF16);
  EXPECT_EQ(c.train.batch, 6);
  EXPECT_EQ(c.train.eval_batch, 12);
  EXPECT_EQ(c.train.best_by, std::optional<std::string>("edit"));
  EXPECT_EQ(c.train.checkpointing, plan::Recompute::EveryStage);
  EXPECT_FALSE(c.train.cache_features);
  EXPECT_EQ(c.model.recompute_norm, true);
  EXPECT_EQ(c.model.lean_backward, false);
  EXPECT_EQ(c.model.layout, models::ActivationLayout::ChannelsLast);
  EXPECT_EQ(c.data.features_layout, data::FeatureLayout::FeaturesFirst);
  const auto yaml = train::to_yaml(c);
  for (const char* line : {"chunk: 0", "precision: bf16", "checkpointing: all",
                           "cache_features: off", "recompute_norm: true", "features_layout: D,T"}) {
    EXPECT_NE(yaml.find(line), std::string::npos) << line << " in\n" << yaml;
  }
  EXPECT_EQ(train::to_yaml(train::parse_config(yaml, "round trip")), yaml);
  EXPECT_NE(train::to_yaml(defaults).find("precision: auto"), std::string::npos);
  EXPECT_NE(test_util::error_message([] {
              train::parse_config("train:\n  precision: fp64\n", "test");
            }).find("train.precision: \"fp64\" is not one of auto | fp32 | bf16 | fp16"),
            std::string::npos);
  EXPECT_NE(test_util::error_message([] {
              train::parse_config("train:\n  checkpointing: some\n", "test");
            }).find("\"some\" is not one of auto | off | all"),
            std::string::npos);
}

TEST(Config, DefaultsFileOverridesAndRoundTrip) {
  const auto c = train::parse_config(
      "model:\n  head: tcn\ndata:\n  classes: [a, b]\n  fps: 2.5\ntrain:\n  budget: 1GiB\n", "test",
      {"train.lr=0.0005", "model.freeze=layer2", "train.chunk=16"});
  EXPECT_EQ(c.model.head, "tcn");
  EXPECT_EQ(c.model.encoder, "resnet18");  // default
  EXPECT_EQ(c.data.classes, (std::vector<std::string>{"a", "b"}));
  EXPECT_DOUBLE_EQ(c.data.fps, 2.5);
  EXPECT_EQ(c.train.budget, int64_t{1} << 30);
  EXPECT_DOUBLE_EQ(c.train.lr, 0.0005);
  EXPECT_EQ(c.model.freeze, "layer2");
  EXPECT_EQ(c.train.chunk, 16);
  const auto again = train::parse_config(train::to_yaml(c), "round trip");
  EXPECT_EQ(train::to_yaml(again), train::to_yaml(c));
  EXPECT_GE(train::config_keys().size(), 40u);

  // What a resumed run is told about: each changed key, old and new value.
  EXPECT_TRUE(train::config_differences(c, again).empty());
  const auto changed =
      train::parse_config(train::to_yaml(c), "changed",
                          {"train.lr=0.003", "data.classes=[a, b, c]", "train.budget=1536MiB"});
  EXPECT_EQ(
      train::config_differences(c, changed),
      (std::vector<std::string>{"data.classes: [a, b] -> [a, b, c]", "train.lr: 0.0005 -> 0.003",
                                "train.budget: 1GiB -> 1536MiB"}));
  // Sizes are written as they are read.
  EXPECT_NE(train::to_yaml(changed).find("budget: 1536MiB\n"), std::string::npos);
}

TEST(Config, BadKeysAndValuesAreNamed) {
  auto error = [](const std::string& yaml, std::vector<std::string> overrides = {}) {
    return test_util::error_message([&] { train::parse_config(yaml, "config f.yaml", overrides); });
  };
  const auto typo = error("train:\n  lrr: 0.1\n");
  EXPECT_NE(typo.find("config f.yaml: unknown key `train.lrr`"), std::string::npos) << typo;
  EXPECT_NE(typo.find("train.lr,"), std::string::npos) << "lists the section's keys: " << typo;
  EXPECT_NE(error("train:\n  lr: fast\n").find("train.lr: expected a number, got \"fast\""),
            std::string::npos);
  EXPECT_NE(
      error("model:\n  head: gru\n").find("model.head: \"gru\" is not one of lstm | tcn | linear"),
      std::string::npos);
  EXPECT_NE(error("train:\n  epochs: 0\n").find("train.epochs: must be at least 1"),
            std::string::npos);
  EXPECT_NE(error("train:\n  lr: 0\n").find("train.lr: must be positive"), std::string::npos);
  EXPECT_NE(error("", {"data.hue=0.6"}).find("data.hue: must be within [0, 0.5] (turns), got 0.6"),
            std::string::npos);
  EXPECT_NE(error("", {"data.rotation=-1"})
                .find("data.rotation: must be within [0, 180] (degrees), got -1"),
            std::string::npos);
  EXPECT_NE(error("", {"train.label_smoothing=1"})
                .find("train.label_smoothing: must be within [0, 1), got 1"),
            std::string::npos);
  EXPECT_NE(error("train:\n  chunk: big\n").find("train.chunk"), std::string::npos);
  // Out of range for int64 (strtoll saturates): refused here, not later as a bare "stoll".
  EXPECT_NE(error("", {"train.keep=99999999999999999999"})
                .find("train.keep: expected auto or a count >= 0"),
            std::string::npos);
  EXPECT_NE(error("train:\n  budget: 12XB\n").find("train.budget"), std::string::npos);
  EXPECT_NE(error("data:\n  classes: a\n").find("data.classes: expected a list"),
            std::string::npos);
  EXPECT_NE(error("train: [1\n").find("not valid YAML: line"), std::string::npos);
  EXPECT_NE(error("", {"train.lrr=1"}).find("--set train.lrr=1: unknown key"), std::string::npos);
  EXPECT_NE(error("", {"train.lr"}).find("expected key=value"), std::string::npos);
  EXPECT_NE(error("", {"device=tpu"}).find("--set device"), std::string::npos);
  EXPECT_NE(
      test_util::error_message([] { train::load_config("/no/such.yaml"); }).find("/no/such.yaml"),
      std::string::npos);
  // Found by feeding the parser broken YAML: each of these used to be taken without a word.
  // yaml-cpp keeps a repeated key, and only one of the two is ever read.
  EXPECT_NE(error("model: {head: lstm}\ntrain: {lr: 0.1}\nmodel: {head: tcn}\n")
                .find("config f.yaml: `model` is given twice (lines 1 and 3); keep one"),
            std::string::npos);
  EXPECT_NE(error("train: {lr: 0.1, lr: 0.2}\n").find("`train.lr` is given twice"),
            std::string::npos);
  EXPECT_NE(error("model: {head: lstm}\n---\nmodel: {head: tcn}\n")
                .find("holds 2 YAML documents (separated by --- lines)"),
            std::string::npos);
  EXPECT_NE(error("train: {lr: .inf}\n").find("train.lr: expected a finite number, got .inf"),
            std::string::npos);
  EXPECT_NE(error("", {"data.rotation=.nan"}).find("data.rotation: expected a finite number"),
            std::string::npos);
  EXPECT_NE(error("data: {classes: [a, b, a]}\n").find("data.classes: \"a\" appears twice"),
            std::string::npos);
  EXPECT_NE(error("model: [1, 2]\n")
                .find("`model` is a section: expected a mapping of its keys (model: {key: value, "
                      "...}), got a list"),
            std::string::npos);
  EXPECT_NE(error("? [a, b]\n: c\n").find("config f.yaml: line 1: a key must be a name"),
            std::string::npos);
}

TEST(Config, PathsStartingWithTildeAreInTheHomeFolder) {
  const std::string home = std::getenv("HOME") ? std::getenv("HOME") : "";
  if (home.empty()) GTEST_SKIP() << "HOME is not set";
  const auto c = train::parse_config(
      "model: {weights: ~/.cache/torch/hub/checkpoints/resnet50-0676ba61.pth}\n"
      "data: {manifest: ~/data/m.csv, images: ~user/images}\n"
      "train: {out_dir: runs/~x}\n",
      "test", {"data.masks=\"~\""});  // quoted: a bare ~ is YAML's null
  EXPECT_EQ(c.model.weights, home + "/.cache/torch/hub/checkpoints/resnet50-0676ba61.pth");
  EXPECT_EQ(c.data.manifest, home + "/data/m.csv");
  EXPECT_EQ(c.data.images, "~user/images");  // another user's folder: left as written
  EXPECT_EQ(c.data.masks, home);
  EXPECT_EQ(c.train.out_dir, "runs/~x");
}

TEST(Config, StepBudgetLeavesTheDecodedDataOnTheCpuAndTheAllocatorsMarginOnCuda) {
  const int64_t budget = int64_t{1} << 30, video = int64_t{300} << 20;
  const auto config = [](const std::string& task, const std::string& device) {
    return train::parse_config("task: " + task + "\ndevice: " + device + "\n", "test");
  };
  // CPU: the frames decoded ahead (here one video larger than the prefetch reserve), and for a
  // batch task the video being cut into samples, share the budget with the step.
  EXPECT_EQ(train::step_budget_bytes(config("phases", "cpu"), budget, video), budget - video);
  EXPECT_EQ(train::step_budget_bytes(config("clips", "cpu"), budget, video), budget - 2 * video);
  EXPECT_EQ(train::step_budget_bytes(config("clips", "cpu"), budget, 0),
            budget - train::prefetch_reserve_bytes(config("clips", "cpu"), budget, 0));
  // CUDA: decoded data is in host memory. A phases plan keeps the chunk planner's own margin; a
  // batch plan leaves a tenth of the budget to the caching allocator's fragmentation.
  EXPECT_EQ(train::step_budget_bytes(config("phases", "cuda"), budget, video), budget);
  const int64_t margin = plan::allocator_margin_bytes(budget, torch::Device("cuda:1"));
  EXPECT_NEAR(static_cast<double>(margin), 0.1 * static_cast<double>(budget), 1.0);
  EXPECT_EQ(train::step_budget_bytes(config("segmentation", "cuda:1"), budget, video),
            budget - margin);
  EXPECT_EQ(plan::allocator_margin_bytes(budget, torch::kCPU), 0);
  // A budget the decoded data alone fills is named, with the bytes it needs.
  EXPECT_NE(test_util::error_message(
                [&] { train::step_budget_bytes(config("phases", "cpu"), video, video); })
                .find("train.budget 300.00 MiB leaves nothing for the training step: decoded data "
                      "takes 300.00 MiB of the budget (the largest video decoded ahead); raise "
                      "train.budget"),
            std::string::npos);
}

TEST(Config, PrefetchReserveHoldsAUnitPerWorkerAndOneWaiting) {
  const auto config = train::parse_config("data:\n  workers: 2\n", "test");
  const int64_t budget = int64_t{1} << 30, mib = int64_t{1} << 20;
  ASSERT_EQ(config.data.prefetch_bytes, 256 * mib);
  EXPECT_EQ(train::prefetch_reserve_bytes(config, budget, 6 * mib), 18 * mib);
  EXPECT_EQ(train::prefetch_reserve_bytes(config, budget, 0), 256 * mib);  // units unknown
  EXPECT_EQ(train::prefetch_reserve_bytes(config, budget, 200 * mib), 256 * mib);
  EXPECT_EQ(train::prefetch_reserve_bytes(config, 400 * mib, 200 * mib), 100 * mib);
}

TEST(Config, AProcessBudgetLeavesTheRuntimeItsShareOnTheCpu) {
  const auto config = [](const std::string& text) { return train::parse_config(text, "test"); };
  const int64_t gib = int64_t{1} << 30;
  const auto before = memory::process_memory().untracked_bytes;
  const auto process =
      train::resolve_budget(config("train:\n  budget: 1GiB\n"), memory::Tracker::cpu());
  const auto after = memory::process_memory().untracked_bytes;
  EXPECT_EQ(process.total, gib);
  // What this process holds outside the tracking allocator, and room for what training starts.
  EXPECT_GE(process.runtime, std::min(before, after) + train::kRuntimeGrowthBytes);
  EXPECT_LE(process.runtime, std::max(before, after) + train::kRuntimeGrowthBytes);
  EXPECT_EQ(process.tensors, gib - process.runtime);
  EXPECT_NE(train::describe_budget(process).find("train.budget 1.00 GiB less the runtime's "),
            std::string::npos);
  auto with_data = process;
  with_data.step = process.tensors - 18 * (1 << 20);
  EXPECT_NE(train::describe_step_budget(with_data, 100 << 20)
                .find(" and 18.00 MiB of decoded data); expected RSS about "),
            std::string::npos);
  // The tensors alone, or a CUDA device's memory: all of it.
  const auto tensors = train::resolve_budget(
      config("train:\n  budget: 1GiB\n  budget_covers: tensors\n"), memory::Tracker::cpu());
  EXPECT_EQ(tensors.runtime, 0);
  EXPECT_EQ(tensors.tensors, gib);
  EXPECT_EQ(train::describe_budget(tensors), "train.budget 1.00 GiB");
  // With the step budget and the prefetch reserve for the run's largest decoded unit.
  const auto tensors_config = config("train:\n  budget: 1GiB\n  budget_covers: tensors\n");
  const int64_t unit = int64_t{8} << 20;
  const auto with_unit = train::resolve_budget(tensors_config, memory::Tracker::cpu(), unit);
  EXPECT_EQ(with_unit.prefetch, train::prefetch_reserve_bytes(tensors_config, gib, unit));
  EXPECT_EQ(with_unit.step, train::step_budget_bytes(tensors_config, gib, unit));
  EXPECT_LT(with_unit.step, gib);
  EXPECT_EQ(train::for_largest_unit(tensors_config, with_unit, 0).step,
            train::step_budget_bytes(tensors_config, gib, 0));
  const auto cuda = train::resolve_budget(config("device: cuda\ntrain:\n  budget: 1GiB\n"),
                                          memory::Tracker::cpu());
  EXPECT_EQ(cuda.runtime, 0);
  EXPECT_EQ(cuda.tensors, gib);
  // A budget the process alone fills says so, and what to do.
  const auto error = test_util::error_message(
      [&] { train::resolve_budget(config("train:\n  budget: 16MiB\n"), memory::Tracker::cpu()); });
  EXPECT_NE(error.find("is below what this process holds without tensors"), std::string::npos)
      << error;
  EXPECT_NE(error.find("train.budget_covers: tensors"), std::string::npos) << error;
}

TEST(Config, BackgroundNamesClassesOfAPhasesTask) {
  const auto config = [](const std::string& task, const std::string& background) {
    return train::parse_config("task: " + task + "\ndata:\n  classes: [SIL, cut, pour]\n" +
                                   "  background: " + background + "\n",
                               "test");
  };
  const auto problems = [](const train::Config& c) {
    std::string text;
    for (const auto& f : train::diagnose_label_settings(c)) text += f.problem + "\n";
    return text;
  };
  const auto fine = config("phases", "[SIL]");
  EXPECT_EQ(fine.data.background, std::vector<std::string>{"SIL"});
  EXPECT_EQ(train::parse_config(train::to_yaml(fine), "round trip").data.background,
            fine.data.background);
  EXPECT_EQ(problems(fine), "");
  EXPECT_NE(problems(config("phases", "[SIL, background]"))
                .find("data.background names 'background', which is not a class"),
            std::string::npos);
  EXPECT_NE(problems(config("clips", "[SIL]")).find("task clips has no frame sequences"),
            std::string::npos);
  EXPECT_NE(test_util::error_message([&] {
              config("phases", "SIL");
            }).find("data.background: expected a list"),
            std::string::npos);
}

TEST(Metrics, FromAKnownConfusionMatrix) {
  train::ConfusionMatrix m(3);
  // truth:      0 0 0 1 1 2 2 2
  // prediction: 0 0 1 1 1 2 2 0
  m.add(torch::tensor({0, 0, 1, 1, 1, 2, 2, 0}), torch::tensor({0, 0, 0, 1, 1, 2, 2, 2}));
  const auto r = m.metrics();
  EXPECT_EQ(r.frames, 8);
  EXPECT_DOUBLE_EQ(r.accuracy, 6.0 / 8);
  EXPECT_DOUBLE_EQ(r.precision[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.recall[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.precision[1], 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.recall[1], 1.0);
  EXPECT_DOUBLE_EQ(r.f1[1], 0.8);
  EXPECT_DOUBLE_EQ(r.jaccard[2], 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.macro_recall, (2.0 / 3 + 1.0 + 2.0 / 3) / 3);
  // Rows the truth, columns the prediction.
  EXPECT_EQ(r.confusion, (std::vector<std::vector<int64_t>>{{2, 1, 0}, {0, 2, 0}, {1, 0, 2}}));
  EXPECT_EQ(nlohmann::json::parse(train::to_json(r, {"a", "b", "c"}))["confusion"][2][0], 1);
  // A phase absent from truth and predictions is left out of the averages.
  train::ConfusionMatrix n(3);
  n.add(torch::tensor({0, 1}), torch::tensor({0, 1}));
  EXPECT_TRUE(std::isnan(n.metrics().f1[2]));
  EXPECT_DOUBLE_EQ(n.metrics().macro_f1, 1.0);
  EXPECT_NE(test_util::error_message([&] {
              n.add(torch::tensor({0, 3}), torch::tensor({0, 1}));
            }).find("[0, 3)"),
            std::string::npos);
}

TEST(Metrics, AveragesOverVideos) {
  // Two videos: one all right (3 frames), one half right (4 frames). Video-level figures weigh
  // each video once, whatever its length.
  train::ConfusionMatrix a(2), b(2);
  a.add(torch::tensor({0, 1, 1}), torch::tensor({0, 1, 1}));
  b.add(torch::tensor({0, 0, 1, 0}), torch::tensor({0, 1, 1, 1}));
  const std::vector<train::VideoMetrics> videos = {{"a", a.metrics()}, {"b", b.metrics()}};
  const auto avg = train::average_over_videos(videos);
  EXPECT_EQ(avg.videos, 2);
  EXPECT_DOUBLE_EQ(avg.accuracy_mean, 0.75);
  EXPECT_NEAR(avg.accuracy_std, std::sqrt(2 * 0.25 * 0.25), 1e-12);  // sample std, n - 1 = 1
  EXPECT_DOUBLE_EQ(avg.macro_jaccard_mean,
                   (1.0 + (b.metrics().jaccard[0] + b.metrics().jaccard[1]) / 2) / 2);
  EXPECT_EQ(train::average_over_videos({videos[0]}).accuracy_std, 0);
  EXPECT_EQ(train::average_over_videos({}).videos, 0);
  EXPECT_EQ(avg.tool_videos, 0);  // no tool metrics
}

TEST(Metrics, ToolMapAveragesOverTheVideosThatShowATool) {
  // Video a: tool 0 ranked perfectly (AP 1), tool 1 never present; video b: tool 0 ranked
  // worst (AP 0.5 for [1, 0] scored [0.2, 0.9]) and tool 1 perfectly; video c shows no tool and
  // counts in neither mean nor std.
  const auto scored = [](std::vector<float> probabilities, std::vector<int64_t> targets) {
    train::ToolScorer scorer(2);
    const auto n = static_cast<int64_t>(probabilities.size()) / 2;
    scorer.add(torch::tensor(probabilities).view({n, 2}), torch::tensor(targets).view({n, 2}));
    train::PhaseMetrics m;
    m.tools = scorer.metrics();
    return m;
  };
  const std::vector<train::VideoMetrics> videos = {
      {"a", scored({0.9f, 0.1f, 0.2f, 0.3f}, {1, 0, 0, 0})},
      {"b", scored({0.2f, 0.8f, 0.9f, 0.1f}, {1, 1, 0, 0})},
      {"c", scored({0.5f, 0.5f}, {0, 0})}};
  ASSERT_NEAR(videos[0].metrics.tools->mean_average_precision, 1.0, 1e-12);
  ASSERT_NEAR(videos[1].metrics.tools->mean_average_precision, 0.75, 1e-12);
  ASSERT_TRUE(std::isnan(videos[2].metrics.tools->mean_average_precision));
  const auto avg = train::average_over_videos(videos);
  EXPECT_EQ(avg.tool_videos, 2);
  EXPECT_NEAR(avg.tool_map_mean, 0.875, 1e-12);
  EXPECT_NEAR(avg.tool_map_std, std::sqrt(2 * 0.125 * 0.125), 1e-12);
}

TEST(Metrics, ToolAveragePrecisionAsScikitLearnComputesIt) {
  // scikit-learn's documented example: average_precision_score([0, 0, 1, 1],
  // [0.1, 0.4, 0.35, 0.8]) = 0.8333.
  EXPECT_NEAR(
      train::average_precision(torch::tensor({0.1, 0.4, 0.35, 0.8}), torch::tensor({0, 0, 1, 1})),
      5.0 / 6, 1e-12);
  // Equal scores are one threshold: (0.5 recall at precision 1/2) + (0.5 at 2/3).
  EXPECT_NEAR(train::average_precision(torch::tensor({0.5, 0.5, 0.2}), torch::tensor({1, 0, 1})),
              0.5 * 0.5 + 0.5 * 2.0 / 3, 1e-12);
  EXPECT_TRUE(std::isnan(train::average_precision(torch::tensor({0.5}), torch::tensor({0}))));
  // The scorer leaves out unannotated entries; a tool never present has no AP and no share of
  // the mean.
  train::ToolScorer scorer(3);
  scorer.add(torch::tensor({{0.1, 0.9, 0.3}, {0.4, 0.2, 0.3}}),
             torch::tensor({{0.0, 1.0, 0.0}, {-1.0, -1.0, -1.0}}));
  scorer.add(torch::tensor({{0.35, 0.1, 0.2}, {0.8, 0.7, 0.1}, {0.4, 0.3, 0.6}}),
             torch::tensor({{1.0, 0.0, 0.0}, {1.0, 1.0, 0.0}, {0.0, -1.0, 0.0}}));
  const auto m = scorer.metrics();
  EXPECT_EQ(m.frames, 4);
  EXPECT_NEAR(m.average_precision[0], 5.0 / 6, 1e-12);  // the example above, across videos
  EXPECT_NEAR(m.average_precision[1], 1.0, 1e-12);
  EXPECT_TRUE(std::isnan(m.average_precision[2]));
  EXPECT_EQ(m.present, (std::vector<int64_t>{2, 2, 0}));
  EXPECT_NEAR(m.mean_average_precision, (5.0 / 6 + 1) / 2, 1e-12);
  // At p >= 0.5: tool 0 predicted once (0.8, right) of 2 present; tool 1 twice, both right; tool
  // 2 never present but predicted once (0.6).
  EXPECT_DOUBLE_EQ(m.precision[0], 1.0);
  EXPECT_DOUBLE_EQ(m.recall[0], 0.5);
  EXPECT_DOUBLE_EQ(m.f1[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(m.f1[1], 1.0);
  EXPECT_DOUBLE_EQ(m.precision[2], 0.0);
  EXPECT_TRUE(std::isnan(m.recall[2]));
  EXPECT_DOUBLE_EQ(m.f1[2], 0.0);  // 2 TP / (2 TP + FP + FN) with one false positive
  train::PhaseMetrics phases;
  phases.precision = phases.recall = phases.f1 = phases.jaccard = {0};
  phases.tools = m;
  const auto json = nlohmann::json::parse(train::to_json(phases, {"a"}, {"x", "y", "z"}));
  EXPECT_NEAR(json["tools"]["average_precision"]["x"].get<double>(), 5.0 / 6, 1e-12);
  EXPECT_TRUE(json["tools"]["average_precision"]["z"].is_null());
  EXPECT_EQ(json["tools"]["present_frames"]["y"], 2);
  EXPECT_DOUBLE_EQ(json["tools"]["recall"]["x"].get<double>(), 0.5);
  EXPECT_TRUE(json["tools"]["recall"]["z"].is_null());
  // Read back (a resumed run's best validation from its log), NaN included: the same JSON.
  const auto text = train::to_json(phases, {"a"}, {"x", "y", "z"});
  const auto read = train::metrics_from_json(text, {"a"}, {"x", "y", "z"});
  EXPECT_TRUE(std::isnan(read.tools->average_precision[2]));
  EXPECT_EQ(train::to_json(read, {"a"}, {"x", "y", "z"}), text);
  EXPECT_NE(test_util::error_message([&] {
              train::metrics_from_json(text, {"a"}, {"x", "w"});
            }).find("no \"w\""),
            std::string::npos);
}

TEST(Timeline, RibbonsOfClassColoursOneColumnPerFrame) {
  const auto image =
      train::timeline_image({torch::tensor({0, 1, 1, -1}), torch::tensor({2, 2, 1, 0})});
  ASSERT_EQ(image.sizes(), (std::vector<int64_t>{3, 24 + 4 + 24, 4}));
  const auto pixel = [&](int64_t y, int64_t x) {
    return std::array<uint8_t, 3>{image[0][y][x].item<uint8_t>(), image[1][y][x].item<uint8_t>(),
                                  image[2][y][x].item<uint8_t>()};
  };
  EXPECT_EQ(pixel(0, 0), train::class_color(0));
  EXPECT_EQ(pixel(23, 2), train::class_color(1));
  EXPECT_EQ(pixel(10, 3), (std::array<uint8_t, 3>{220, 220, 220}));  // unlabelled
  EXPECT_EQ(pixel(25, 1), (std::array<uint8_t, 3>{255, 255, 255}));  // the gap
  EXPECT_EQ(pixel(28, 0), train::class_color(2));
  EXPECT_EQ(pixel(51, 3), train::class_color(0));
  EXPECT_EQ(train::class_color(21), train::class_color(1));
  EXPECT_NE(train::class_color(0), train::class_color(1));
  // 5,000 frames in 2,000 columns: column x shows the frame at its centre, (2x + 1) * 5000 / 4000.
  const auto ramp = torch::arange(5000) / 250;  // classes 0..19, 250 frames each
  const auto wide = train::timeline_image({ramp});
  ASSERT_EQ(wide.size(2), 2000);
  for (const int64_t x : {0, 99, 100, 1999}) {
    const int64_t frame = (2 * x + 1) * 5000 / 4000;
    EXPECT_EQ(wide[0][0][x].item<uint8_t>(), train::class_color(frame / 250)[0]) << x;
  }
  EXPECT_NE(test_util::error_message([] {
              train::timeline_image({torch::tensor({0, 1}), torch::tensor({0})});
            }).find("every row must be [2]"),
            std::string::npos);
}

namespace {
// Class ids from runs {id, length}: {{0, 2}, {1, 3}} is 0 0 1 1 1.
torch::Tensor runs(const std::vector<std::pair<int64_t, int64_t>>& pieces) {
  std::vector<int64_t> ids;
  for (const auto& [id, length] : pieces) ids.insert(ids.end(), length, id);
  return torch::tensor(ids);
}
}  // namespace

TEST(Metrics, RelaxedBoundariesAsCholec80sEvaluationScript) {
  using train::RelaxedRules;
  const auto truth = runs({{0, 20}, {1, 20}});
  // A late transition (3 frames of phase 1 still predicted 0, diff -1) is forgiven within the
  // boundary's first frames of phase 1's segment.
  auto late =
      train::relaxed_video_metrics(runs({{0, 23}, {1, 17}}), truth, 3, 10, RelaxedRules::General);
  EXPECT_DOUBLE_EQ(late.accuracy, 1.0);
  EXPECT_DOUBLE_EQ(late.jaccard[0], 1.0);
  EXPECT_DOUBLE_EQ(late.recall[0], 23.0 / 20);  // the script's counts: above 1
  EXPECT_DOUBLE_EQ(late.precision[1], 20.0 / 17);
  EXPECT_TRUE(std::isnan(late.jaccard[2]));  // not in the truth
  EXPECT_DOUBLE_EQ(
      train::relaxed_video_metrics(runs({{0, 23}, {1, 17}}), truth, 3, 2, RelaxedRules::General)
          .accuracy,
      39.0 / 40);  // frames 20 and 21 forgiven, 22 not
  // An early transition (phase 1 predicted 3 frames early, diff +1 at frames 17-19): the
  // script's logical index of the segment's last 10 frames addresses its first 10, so frames
  // 7-9 are "forgiven" (frame 8's wrong id 3 with them) and frames 17-19 stay wrong.
  const auto early = runs({{0, 8}, {3, 1}, {0, 8}, {1, 23}});
  EXPECT_DOUBLE_EQ(
      train::relaxed_video_metrics(early, truth, 4, 10, RelaxedRules::General).accuracy, 37.0 / 40);
  // A boundary as long as the segment lines both up: frames 17-19 forgiven, frame 8 not.
  EXPECT_DOUBLE_EQ(
      train::relaxed_video_metrics(early, truth, 4, 20, RelaxedRules::General).accuracy, 39.0 / 40);
  EXPECT_DOUBLE_EQ(train::relaxed_video_metrics(early, truth, 4, 0, RelaxedRules::General).accuracy,
                   36.0 / 40);  // no boundary: the strict accuracy

  // Cholec80's own rules: CleaningCoagulation (id 5) after GallbladderDissection (id 3), still
  // predicted 3 for 3 frames (diff -2): forgiven for ids 5 and 6 only.
  const auto cholec_truth = runs({{3, 20}, {5, 20}});
  const auto cholec_pred = runs({{3, 23}, {5, 17}});
  EXPECT_DOUBLE_EQ(
      train::relaxed_video_metrics(cholec_pred, cholec_truth, 7, 10, RelaxedRules::Cholec80)
          .accuracy,
      1.0);
  EXPECT_DOUBLE_EQ(
      train::relaxed_video_metrics(cholec_pred, cholec_truth, 7, 10, RelaxedRules::General)
          .accuracy,
      37.0 / 40);
  EXPECT_DOUBLE_EQ(
      train::relaxed_video_metrics(cholec_pred, cholec_truth, 8, 10, RelaxedRules::M2cai16)
          .accuracy,
      37.0 / 40);  // M2CAI16's pairs are ids 4-5 and 6-7
  EXPECT_NE(test_util::error_message([&] {
              train::relaxed_video_metrics(truth, truth, 5, 10, RelaxedRules::Cholec80);
            }).find("Cholec80's 7 phases"),
            std::string::npos);
  EXPECT_EQ(train::parse_relaxed_rules("m2cai16"), RelaxedRules::M2cai16);
  EXPECT_NE(test_util::error_message([] { train::parse_relaxed_rules("cholec"); }).find("general"),
            std::string::npos);

  // The script's summary: per phase the mean over the videos that have it (values clipped to
  // 1), then mean and sample std over the phases; accuracy over the videos.
  auto half = train::relaxed_video_metrics(runs({{0, 2}, {2, 2}}), runs({{0, 4}}), 3, 10,
                                           RelaxedRules::General);
  EXPECT_DOUBLE_EQ(half.accuracy, 0.5);
  late.name = "late", half.name = "half";
  const auto summary = train::summarize_relaxed({late, half});
  EXPECT_EQ(summary.videos, 2);
  EXPECT_DOUBLE_EQ(summary.accuracy_mean, 0.75);
  EXPECT_NEAR(summary.accuracy_std, std::sqrt(2 * 0.25 * 0.25), 1e-12);
  EXPECT_DOUBLE_EQ(summary.recall[0], 0.75);  // min(1.15, 1) and 0.5
  EXPECT_DOUBLE_EQ(summary.recall[1], 1.0);
  EXPECT_TRUE(std::isnan(summary.recall[2]));  // in no video: left out
  EXPECT_DOUBLE_EQ(summary.recall_mean, 0.875);
  EXPECT_NEAR(summary.recall_std, std::sqrt(2 * 0.125 * 0.125), 1e-12);
  EXPECT_DOUBLE_EQ(summary.precision_mean, 1.0);
  EXPECT_DOUBLE_EQ(summary.jaccard_mean, 0.875);
}

TEST(Metrics, SegmentalEditAndF1) {
  const auto labels = [](const std::string& letters) {
    std::vector<int64_t> ids;
    for (char c : letters) ids.push_back(c - 'A');
    return torch::tensor(ids);
  };
  // A boundary off by a frame: the phases in the true order, every segment overlapping its true
  // one by at least 3/4 - segmentally right although 1 frame in 10 is wrong.
  {
    train::SegmentScorer s;
    s.add(labels("AAABBBBBCC"), labels("AAAABBBBCC"));
    const auto m = s.metrics();
    EXPECT_EQ(m.videos, 1);
    EXPECT_DOUBLE_EQ(m.edit, 1.0);
    ASSERT_EQ(m.f1.size(), 3u);
    for (double f : m.f1) EXPECT_DOUBLE_EQ(f, 1.0);
    EXPECT_EQ(m.true_segments, 3);
    EXPECT_EQ(m.predicted_segments, 3);
  }
  // Flicker: predicted A B A B C against true A B C (two extra segments: edit 1 - 2/5). At IoU
  // 0.1 and 0.25 the first A (IoU 1/4) matches; B[1,3) overlaps no true B; A[3,4) is a second
  // match of the same true A: TP 3, FP 2, FN 0. At 0.5 the A match fails too: TP 2, FP 3, FN 1.
  const auto flicker = labels("ABBABBBBCC"), truth = labels("AAAABBBBCC");
  {
    train::SegmentScorer s;
    s.add(flicker, truth);
    const auto m = s.metrics();
    EXPECT_DOUBLE_EQ(m.edit, 0.6);
    EXPECT_DOUBLE_EQ(m.f1[0], 6.0 / 8);
    EXPECT_DOUBLE_EQ(m.f1[1], 6.0 / 8);
    EXPECT_DOUBLE_EQ(m.f1[2], 4.0 / 8);
    EXPECT_EQ(m.predicted_segments, 5);
  }
  // Over videos: edit is averaged, F1 comes from the summed counts (not the mean of the videos'
  // F1: that would be (1 + 0.5) / 2 at 0.5).
  {
    train::SegmentScorer s;
    s.add(truth, truth);
    s.add(flicker, truth);
    const auto m = s.metrics();
    EXPECT_EQ(m.videos, 2);
    EXPECT_DOUBLE_EQ(m.edit, 0.8);
    EXPECT_DOUBLE_EQ(m.f1[2], 10.0 / 14);  // TP 5, FP 3, FN 1
    EXPECT_EQ(m.true_segments, 6);
  }
  // Background segments are left out of both sequences: true _ B _ B (A is background) against
  // predicted B _ B is right; scored with A, the missing first A costs an edit.
  {
    train::SegmentScorer with_background({0}, {0.5});
    with_background.add(labels("BBBBAABB"), labels("AABBAABB"));
    EXPECT_DOUBLE_EQ(with_background.metrics().edit, 1.0);
    EXPECT_DOUBLE_EQ(with_background.metrics().f1[0], 1.0);  // IoU 2/4 and 2/2
    EXPECT_EQ(with_background.metrics().true_segments, 2);
    train::SegmentScorer without({}, {0.5});
    without.add(labels("BBBBAABB"), labels("AABBAABB"));
    EXPECT_DOUBLE_EQ(without.metrics().edit, 0.75);
  }
  train::SegmentScorer s;
  EXPECT_NE(
      test_util::error_message([&] { s.add(labels("AB"), labels("ABC")); }).find("same length"),
      std::string::npos);
  EXPECT_NE(test_util::error_message([] { train::SegmentScorer({}, {0.0}); }).find("(0, 1]"),
            std::string::npos);
  EXPECT_EQ(train::segment_f1_name(0.25), "f1@25");
  // The JSON carries them under "segments", and per-video edits average over videos.
  train::ConfusionMatrix confusion(3);
  confusion.add(flicker, truth);
  auto metrics = confusion.metrics();
  train::SegmentScorer one;
  one.add(flicker, truth);
  metrics.segments = one.metrics();
  const auto json = nlohmann::json::parse(train::to_json(metrics, {"A", "B", "C"}));
  EXPECT_DOUBLE_EQ(json["segments"]["edit"].get<double>(), 0.6);
  EXPECT_DOUBLE_EQ(json["segments"]["f1@50"].get<double>(), 0.5);
  EXPECT_EQ(json["segments"]["true_segments"].get<int64_t>(), 3);
  // Read back with thresholds whose names sort otherwise as text ("f1@5" after "f1@50").
  auto thresholds = metrics;
  train::SegmentScorer other({}, {0.05, 0.5});
  other.add(flicker, truth);
  thresholds.segments = other.metrics();
  const auto text = train::to_json(thresholds, {"A", "B", "C"});
  const auto read = train::metrics_from_json(text, {"A", "B", "C"});
  EXPECT_EQ(read.segments->thresholds, (std::vector<double>{0.05, 0.5}));
  EXPECT_EQ(train::to_json(read, {"A", "B", "C"}), text);
  auto perfect = metrics;
  perfect.segments->edit = 1.0;
  const auto averages = train::average_over_videos({{"a", metrics}, {"b", perfect}});
  EXPECT_DOUBLE_EQ(averages.edit_mean, 0.8);
  EXPECT_NEAR(averages.edit_std, std::sqrt(2 * 0.2 * 0.2), 1e-12);
}

TEST(Schedule, WarmupStepAndCosine) {
  train::Schedule s;
  s.lr = 1.0;
  s.warmup = 4;
  s.kind = "cosine";
  EXPECT_DOUBLE_EQ(train::learning_rate(s, 0, 14), 0.25);
  EXPECT_DOUBLE_EQ(train::learning_rate(s, 3, 14), 1.0);
  EXPECT_DOUBLE_EQ(train::learning_rate(s, 4, 14), 1.0);
  EXPECT_NEAR(train::learning_rate(s, 9, 14), 0.5, 1e-12);
  EXPECT_NEAR(train::learning_rate(s, 14, 14), 0.0, 1e-12);
  s.kind = "step";
  s.step_size = 3;
  s.gamma = 0.5;
  EXPECT_DOUBLE_EQ(train::learning_rate(s, 6, 100), 1.0);
  EXPECT_DOUBLE_EQ(train::learning_rate(s, 7, 100), 0.5);
  EXPECT_DOUBLE_EQ(train::learning_rate(s, 10, 100), 0.25);
  s.kind = "constant";
  EXPECT_DOUBLE_EQ(train::learning_rate(s, 50, 100), 1.0);
}

namespace {

std::vector<torch::Tensor> weights(const train::Model& m) {
  std::vector<torch::Tensor> out;
  for (auto& [name, t] : train::export_state_dict(m)) out.push_back(t.clone());
  return out;
}

bool identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

// Videos of per-frame features for a head alone (MS-TCN, TeCNO): 6 per frame, phases a, b, c
// in thirds, each phase raising its own feature dimension. Training on features reads no video,
// so it runs in every build, the GPU check's (no FFmpeg) included.
struct FeatureVideo {
  std::string name, split;
  torch::Tensor features, labels;  // [T,6] float32, [T]
};

void write_phase_labels(const std::string& path, const torch::Tensor& labels) {
  std::ofstream out(path);
  out << "Frame\tPhase\n";
  for (int64_t t = 0; t < labels.size(0); ++t)
    out << t << "\t" << static_cast<char>('a' + labels[t].item<int64_t>()) << "\n";
}

// Five videos, the last for validation: dir/NAME.txt (labels), dir/NAME.pt (features) and
// dir/manifest.csv listing them.
std::vector<FeatureVideo> write_feature_videos(const std::string& dir) {
  std::filesystem::create_directories(dir);
  torch::manual_seed(7);
  std::vector<FeatureVideo> videos;
  std::string manifest = "name,labels,split,features\n";
  for (int v = 0; v < 5; ++v) {
    const int64_t frames = 30 + 7 * v;
    const auto labels = torch::div(torch::arange(frames) * 3, frames, "floor");
    auto features = torch::randn({frames, 6}) * 0.5;
    features.index_put_({torch::arange(frames), labels},
                        features.index({torch::arange(frames), labels}) + 2);
    FeatureVideo video{"v" + std::to_string(v), v < 4 ? "train" : "val", features, labels};
    write_phase_labels(dir + "/" + video.name + ".txt", labels);
    models::write_tensor(features, dir + "/" + video.name + ".pt");
    manifest += video.name + "," + video.name + ".txt," + video.split + "," + video.name + ".pt\n";
    videos.push_back(std::move(video));
  }
  std::ofstream(dir + "/manifest.csv") << manifest;
  return videos;
}

}  // namespace

TEST(Training, ResumedRunOnFeaturesEndsWithTheUninterruptedWeightsOnEveryDevice) {
  // The TCN head's dropout draws from the run's device: on CUDA from the device's generator,
  // which step checkpoints keep beside the CPU's. Uninterrupted: 5 steps; interrupted after
  // step 2, then resumed to 5 with every generator scrambled, as a new process would start.
  const std::string dir = "/tmp/framefit_resume_features_" + std::to_string(::getpid());
  test_util::remove_tree(dir);
  write_feature_videos(dir);
  const std::string manifest = dir + "/manifest.csv";
  std::vector<std::string> devices = {"cpu"};
  if (torch::cuda::is_available()) devices.push_back("cuda");
  for (const auto& device : devices) {
    SCOPED_TRACE(device);
    const auto config = [&](const std::string& run, int64_t max_steps) {
      return train::parse_config(
          "device: " + device +
              "\n"
              "model: {encoder: features, head: tcn, tcn_stages: 2, tcn_layers: 3}\n"
              "data: {manifest: " +
              manifest +
              ", classes: [a, b, c]}\n"
              "train: {lr: 0.01, schedule: constant, checkpoint_every: 1, max_steps: " +
              std::to_string(max_steps) + ", out_dir: " + dir + "/" + device + "_" + run + "}\n",
          "test");
    };
    const auto step_5 = [&](const std::string& run) {
      return weights(
          train::load_model(dir + "/" + device + "_" + run + "/checkpoints/step_00000005.pt"));
    };
    train::train(config("whole", 5));
    train::train(config("parts", 2));
    torch::manual_seed(12345);  // the CPU's generator and every CUDA device's
    EXPECT_EQ(train::train(config("parts", 5), "auto").steps, 5);
    const auto uninterrupted = step_5("whole"), resumed = step_5("parts");
    if (device == "cpu") {
      EXPECT_TRUE(identical(uninterrupted, resumed));
    } else {
      // cuDNN may sum a convolution's weight gradient in another order from run to run; other
      // dropout masks would change the weights by far more than this.
      ASSERT_EQ(uninterrupted.size(), resumed.size());
      for (size_t i = 0; i < resumed.size(); ++i)
        EXPECT_TRUE(torch::allclose(uninterrupted[i], resumed[i], 1e-5, 1e-7)) << i;
      std::cout << "CUDA resume bit-identical: " << identical(uninterrupted, resumed) << "\n";
    }
  }
  test_util::remove_tree(dir);
}

#ifdef FRAMEFIT_WITH_FFMPEG
namespace {

// A tiny demo data set written once per process (ctest runs the tests of this file in parallel
// processes) and removed at exit.
struct TinyDemo {
  std::string dir = "/tmp/framefit_train_test_demo_" + std::to_string(::getpid());
  ~TinyDemo() { test_util::remove_tree(dir); }
};

const std::string& tiny_demo() {
  static const TinyDemo demo;
  static const std::string dir = [] {
    test_util::make_tiny_demo(demo.dir, 30, 60);
    return demo.dir;
  }();
  return dir;
}

train::Config tiny_config(const std::string& name) {
  const std::string out_dir = name + "_" + std::to_string(::getpid());
  train::Config c;
  c.model.groups = 8;
  c.data.manifest = tiny_demo() + "/manifest.csv";
  for (const auto& n : data::demo_classes().names()) c.data.classes.push_back(n);
  c.data.fps = 12.5;
  c.data.workers = 2;
  c.train.epochs = 2;
  c.train.lr = 1e-3;
  c.train.schedule = "cosine";
  c.train.warmup_steps = 1;
  c.train.precision = engine::Precision::FP32;
  c.train.chunk = 8;
  c.train.keep = 1;
  c.train.budget = int64_t{2} << 30;
  c.train.budget_covers = "tensors";  // the tests below size budgets in tensor bytes
  c.train.out_dir = out_dir;
  test_util::remove_tree(out_dir);
  return c;
}

}  // namespace

TEST(Training, RunsLogsCheckpointsEvaluatesPredictsAndExports) {
  auto config = tiny_config("/tmp/framefit_train_test_run");
  std::vector<train::Event> events;
  const auto result = train::train(config, "", [&](const train::Event& e) { events.push_back(e); });
  EXPECT_EQ(result.steps, 6);  // 3 videos x 2 epochs
  EXPECT_TRUE(result.validated);
  int steps = 0, epochs = 0;
  for (const auto& e : events) {
    steps += e.kind == train::Event::Kind::Step;
    epochs += e.kind == train::Event::Kind::Epoch;
    if (e.kind == train::Event::Kind::Step) EXPECT_TRUE(std::isfinite(e.loss));
  }
  EXPECT_EQ(steps, 6);
  EXPECT_EQ(epochs, 2);
  // log.jsonl: one line per step and per epoch.
  std::ifstream log(config.train.out_dir + "/log.jsonl");
  int lines = 0;
  for (std::string line; std::getline(log, line);) ++lines;
  EXPECT_EQ(lines, 8);
  // keep_last 2 step checkpoints and best.pt; no temporary files left.
  struct stat info {};
  EXPECT_EQ(::stat((config.train.out_dir + "/best.pt").c_str(), &info), 0);
  EXPECT_EQ(::stat((config.train.out_dir + "/checkpoints/step_00000006.pt").c_str(), &info), 0);
  EXPECT_EQ(::stat((config.train.out_dir + "/checkpoints/step_00000003.pt").c_str(), &info), 0);
  EXPECT_NE(::stat((config.train.out_dir + "/checkpoints/step_00000006.pt.tmp").c_str(), &info), 0);

  // A run whose folder another framefit train holds is refused, naming that process; once it
  // ends, the folder is free again.
  {
    const test_util::HeldRunLock running(config.train.out_dir, "4242");
    ASSERT_TRUE(running.held());
    EXPECT_NE(test_util::error_message([&] { train::train(config, "auto"); })
                  .find("train.out_dir " + config.train.out_dir +
                        " is in use by another framefit train (process 4242): wait for it to end, "
                        "or choose another train.out_dir"),
              std::string::npos);
  }
  EXPECT_TRUE(test_util::HeldRunLock(config.train.out_dir, "4242").held());

  // Starting again in the same folder without --resume is refused.
  EXPECT_NE(test_util::error_message([&] { train::train(config); }).find("--resume"),
            std::string::npos);

  // The checkpoint stores the module: it loads without the file.
  std::remove(config.model.script.c_str());
  auto model = train::load_model(config.train.out_dir + "/checkpoints/step_00000006.pt");
#if FRAMEFIT_WITH_LIBZIP
  // A damaged copy is refused (LibTorch's reader would have loaded it with a wrong weight).
  {
    auto bytes = test_util::read_bytes(config.train.out_dir + "/checkpoints/step_00000006.pt");
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 1);
    const auto damaged = config.train.out_dir + "/damaged.pt";
    test_util::write_bytes(damaged, bytes);
    const auto message = test_util::error_message([&] { train::load_model(damaged); });
    EXPECT_NE(message.find("checkpoint " + damaged + " is damaged: its entry "), std::string::npos)
        << message;
    EXPECT_NE(message.find(": CRC error"), std::string::npos) << message;
  }
#endif
  const auto test_set = train::make_dataset(model.config, "test", false);
  ASSERT_EQ(test_set.size(), 1);
  const auto metrics = train::evaluate(model, test_set);
  EXPECT_EQ(metrics.frames, test_set.frames(0));
  // framefit eval's path: the checkpoint's task scores it the same, and writes each video's
  // predictions (CSV, one row per frame) and ribbon, and its relaxed-boundary scores.
  {
    train::EvaluationRequest request;
    request.checkpoint = config.train.out_dir + "/checkpoints/step_00000006.pt";
    request.predictions_folder = config.train.out_dir + "/predictions";
    request.relaxed_rules = "general";
    const auto evaluation = train::evaluate_checkpoint(request);
    EXPECT_EQ(evaluation.split, "test");
    EXPECT_EQ(evaluation.metrics.frames, metrics.frames);
    EXPECT_DOUBLE_EQ(evaluation.metrics.accuracy, metrics.accuracy);
    ASSERT_EQ(evaluation.per_video.size(), 1u);
    ASSERT_EQ(evaluation.relaxed.size(), 1u);
    const auto& name = test_set.entry(0).name;
    EXPECT_EQ(evaluation.relaxed[0].name, name);
    std::ifstream csv(request.predictions_folder + "/" + name + ".csv");
    std::string line;
    ASSERT_TRUE(std::getline(csv, line));
    EXPECT_EQ(line, "frame,time_seconds,phase,confidence,truth");
    int64_t rows = 0;
    while (std::getline(csv, line)) ++rows;
    EXPECT_EQ(rows, test_set.frames(0));
    EXPECT_TRUE(std::filesystem::exists(request.predictions_folder + "/" + name + ".png"));
  }
  // Per video, over the three training videos: names in order, frames adding up, and the
  // frame-weighted mean of their accuracies is the accuracy over all frames.
  {
    const auto three = train::make_dataset(model.config, "train", false);
    std::vector<train::VideoMetrics> per_video;
    const auto all = train::evaluate(model, three, {}, &per_video);
    ASSERT_EQ(per_video.size(), 3u);
    int64_t frames = 0;
    double correct = 0, accuracy_sum = 0;
    for (size_t i = 0; i < per_video.size(); ++i) {
      EXPECT_EQ(per_video[i].name, three.entry(static_cast<int64_t>(i)).name);
      frames += per_video[i].metrics.frames;
      correct += per_video[i].metrics.accuracy * static_cast<double>(per_video[i].metrics.frames);
      accuracy_sum += per_video[i].metrics.accuracy;
    }
    EXPECT_EQ(frames, all.frames);
    EXPECT_NEAR(correct / static_cast<double>(frames), all.accuracy, 1e-12);
    EXPECT_NEAR(train::average_over_videos(per_video).accuracy_mean, accuracy_sum / 3, 1e-12);
    // Segmental scores: the videos' edits average to the split's, their segments add up.
    ASSERT_TRUE(all.segments.has_value());
    EXPECT_EQ(all.segments->videos, 3);
    double edits = 0;
    int64_t segments = 0;
    for (const auto& v : per_video) {
      ASSERT_TRUE(v.metrics.segments.has_value());
      edits += v.metrics.segments->edit;
      segments += v.metrics.segments->true_segments;
    }
    EXPECT_NEAR(all.segments->edit, edits / 3, 1e-12);
    EXPECT_EQ(all.segments->true_segments, segments);
  }
  const auto video = test_set.load(0);
  const auto prediction = train::predict(model, video.frames);
  EXPECT_EQ(prediction.labels.size(0), video.frames.size(0));
  EXPECT_NEAR(prediction.probabilities.sum(-1).mean().item<double>(), 1.0, 1e-5);
  const double accuracy =
      prediction.labels.eq(video.labels).to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(accuracy, metrics.accuracy, 1e-12);
  // Inference that runs out of memory halves its chunk and goes on: on a long video, a budget
  // between the peaks at chunks of 4 frames and of the whole video gives the same prediction.
  {
    auto& tracker = memory::Tracker::cpu();
    auto sizes = video.frames.sizes().vec();
    sizes[0] = 256;
    const auto long_video = torch::randint(0, 256, sizes, torch::kUInt8);
    const auto peak_at = [&](int64_t chunk) {
      model.chunk = chunk;
      auto window = tracker.mark();
      train::predict(model, long_video);
      return window.peak_bytes() - window.entry_bytes();
    };
    const int64_t small = peak_at(4), whole = peak_at(256);
    ASSERT_GT(whole, 2 * small);
    const auto expected = train::predict(model, long_video);
    std::vector<std::string> warnings;
    train::Prediction halved;
    {
      memory::ScopedBudget budget(tracker, tracker.current_bytes() + (small + whole) / 2);
      halved = train::predict(model, long_video, [&](const train::Event& e) {
        if (e.kind == train::Event::Kind::Warning) warnings.push_back(e.message);
      });
    }
    ASSERT_FALSE(warnings.empty());
    EXPECT_EQ(warnings[0],
              "inference ran out of memory at chunks of 256 frames; continuing with "
              "chunks of 128");
    EXPECT_LT(model.chunk, 256);
    EXPECT_TRUE(torch::equal(halved.labels, expected.labels));
    EXPECT_TRUE(torch::allclose(halved.probabilities, expected.probabilities, 1e-4, 1e-6));
  }

  const auto state = train::export_state_dict(model);
  EXPECT_EQ(state.front().first, "encoder.conv1.weight");
  EXPECT_EQ(state.back().first.rfind("head.", 0), 0u);
  test_util::remove_tree(config.train.out_dir);
}

TEST(Training, AccumulationBeyondTheVideosIsPlannedForTheVideosThereAre) {
  // train.accumulate 50 over a handful of training videos: each step takes them all, and the
  // plan holds that many in memory, not 50 videos of the longest length.
  auto c = tiny_config("/tmp/framefit_accumulate_plan");
  c.train.chunk = c.train.keep = std::nullopt;  // planned
  c.train.accumulate = 50;
  const auto plan = train::plan_phases(c, memory::Tracker::cpu());
  ASSERT_TRUE(plan.fits);
  EXPECT_LT(plan.videos, 50);
  EXPECT_EQ(plan.settings.videos_per_call, plan.videos);
  c.train.accumulate = 1;
  EXPECT_EQ(train::plan_phases(c, memory::Tracker::cpu()).settings.videos_per_call, 1);
}

TEST(Training, DivergedRunStopsWithACheckpointAndSaysWhatToChange) {
  // AdamW moves every weight by about lr: at 1e37 the second step's activations overflow and its
  // loss is NaN, as are the two after it (their updates skipped): the run ends there.
  auto c = tiny_config("/tmp/framefit_diverged");
  c.train.lr = 1e37;
  c.train.validate = false;
  int64_t warnings = 0;
  const auto message = test_util::error_message([&] {
    train::train(c, "", [&](const train::Event& e) {
      warnings += e.kind == train::Event::Kind::Warning &&
                  e.message.find(": the loss is NaN: the update was skipped") != std::string::npos;
    });
  });
  EXPECT_EQ(warnings, 3);
  const auto checkpoint = c.train.out_dir + "/checkpoints/step_00000004.pt";
  EXPECT_NE(message.find("training diverged"), std::string::npos) << message;
  EXPECT_NE(message.find(checkpoint + " holds the weights the last finite step left"),
            std::string::npos)
      << message;
  EXPECT_TRUE(std::filesystem::exists(checkpoint));
  test_util::remove_tree(c.train.out_dir);
}

// `framefit doctor --config` on a phases config, with the budget resolved as the CLI does.
std::vector<plan::Finding> doctor_phases(const train::Config& config,
                                         std::string* summary = nullptr) {
  return train::diagnose_phases(config, train::resolve_budget(config, memory::Tracker::cpu()),
                                summary);
}

TEST(Training, DoctorReportsEveryBadVideoOfEverySplitWithoutTraining) {
  auto config = tiny_config("/tmp/framefit_doctor");
  std::string summary;
  EXPECT_FALSE(plan::has_errors(doctor_phases(config, &summary)));
  EXPECT_NE(summary.find("3 training videos, the longest "), std::string::npos) << summary;

  // A misspelt split: the error lists the splits the manifest has.
  auto misspelt = config;
  misspelt.data.train_split = "trian";
  const auto typo = doctor_phases(misspelt);
  ASSERT_EQ(typo.size(), 1u);
  EXPECT_NE(typo[0].problem.find("no videos in split \"trian\" of " + config.data.manifest +
                                 "; its splits are \"test\" (1 video), \"train\" (3 videos), "
                                 "\"val\" (1 video)"),
            std::string::npos)
      << typo[0].problem;

  // A copy of the manifest where a training video's annotation lacks its last line and the
  // validation video is missing: both reported, where training stops at the first.
  const std::string dir = config.train.out_dir + "_data";
  test_util::remove_tree(dir);
  ::mkdir(dir.c_str(), 0755);
  auto entries = data::read_manifest(config.data.manifest);
  ASSERT_EQ(entries.size(), 5u);
  std::ifstream in(entries[1].labels);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::ofstream short_labels(dir + "/short.txt");
  for (size_t i = 0; i + 1 < lines.size(); ++i) short_labels << lines[i] << "\n";
  short_labels.close();
  entries[1].labels = dir + "/short.txt";
  ASSERT_EQ(entries[3].split, "val");
  entries[3].video = dir + "/missing.mp4";
  data::write_manifest(dir + "/manifest.csv", entries);
  config.data.manifest = dir + "/manifest.csv";
  const auto findings = doctor_phases(config);
  std::vector<std::string> errors;
  for (const auto& f : findings) {
    if (f.severity == plan::Finding::Severity::Error) errors.push_back(f.problem);
  }
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find("short.txt has " + std::to_string(lines.size() - 2) + " frames but"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("missing.mp4: cannot open"), std::string::npos) << errors[1];
  EXPECT_THROW(train::train(config), c10::Error);
  test_util::remove_tree(dir);
  test_util::remove_tree(config.train.out_dir);
}

TEST(Training, VideoFileIsPredictedAPieceAtATimeAsTheWholeVideoIs) {
  // Two videos of 64x64 frames at 25 fps, sampled at 12.5: 30 and 300 frames. predict_file
  // decodes and encodes 8 frames at a time: the predictions of the decoded whole video, and a
  // peak that grows with the features, not with the frames (uint8, 12 KiB each).
  auto config = tiny_config("/tmp/framefit_predict_file");
  auto model = train::build_model(config);
  model.chunk = 8;
  std::filesystem::create_directories(config.train.out_dir);
  const auto write = [&](const std::string& name, int64_t frames) {
    const auto path = config.train.out_dir + "/" + name;
    data::VideoWriter writer(path, 64, 64, 25);
    const auto ramp = torch::arange(64, torch::kLong).view({1, 1, 64}).expand({3, 64, 64});
    const auto channel = torch::tensor({0, 85, 170}, torch::kLong).view({3, 1, 1});
    for (int64_t t = 0; t < frames; ++t)
      writer.write(((ramp * 3 + channel + 5 * t) % 256).to(torch::kUInt8).contiguous());
    writer.finish();
    return path;
  };
  const auto short_video = write("short.mp4", 60), long_video = write("long.mp4", 600);

  const auto whole = data::decode_video(short_video, 0, train::data_options(config, false));
  const auto expected = train::predict(model, whole.frames);
  data::DecodedVideo decoded;
  const auto streamed = train::predict_file(model, short_video, 0, {}, &decoded);
  EXPECT_FALSE(decoded.frames.defined());
  EXPECT_EQ(decoded.source_frames, whole.source_frames);
  EXPECT_EQ(decoded.source_seconds, whole.source_seconds);
  EXPECT_TRUE(torch::equal(streamed.labels, expected.labels));
  EXPECT_TRUE(torch::allclose(streamed.probabilities, expected.probabilities, 1e-5, 1e-6));

  auto& tracker = memory::Tracker::cpu();
  const auto peak_of = [&](const std::string& path, int64_t* frames) {
    auto window = tracker.mark();
    *frames = train::predict_file(model, path, 0).labels.numel();
    return window.peak_bytes() - window.entry_bytes();
  };
  int64_t short_frames = 0, long_frames = 0;
  const int64_t short_peak = peak_of(short_video, &short_frames);
  const int64_t long_peak = peak_of(long_video, &long_frames);
  ASSERT_EQ(short_frames, 30);
  ASSERT_EQ(long_frames, 300);
  const int64_t frame_bytes = 3 * 64 * 64;
  EXPECT_LT(long_peak - short_peak, (long_frames - short_frames) * frame_bytes / 2)
      << "peaks " << short_peak << " and " << long_peak;
  test_util::remove_tree(config.train.out_dir);
}

TEST(Training, EvaluationDecodesAVideoLargerThanThePrefetchReserveAPieceAtATime) {
  // With data.prefetch_bytes below every video's frames, each is decoded and encoded a piece at a
  // time instead of whole: the same predictions and metrics.
  auto config = tiny_config("/tmp/framefit_eval_pieces");
  auto model = train::build_model(config);
  model.chunk = 8;
  const auto dataset = train::make_dataset(config, "train", false);
  const auto evaluate = [&](int64_t prefetch_bytes, std::vector<train::Prediction>& predictions) {
    model.config.data.prefetch_bytes = prefetch_bytes;
    return train::evaluate(model, dataset, {}, nullptr,
                           [&](int64_t, const train::Prediction& p) { predictions.push_back(p); });
  };
  std::vector<train::Prediction> whole, pieces;
  const auto expected = evaluate(int64_t{1} << 30, whole);
  const auto streamed = evaluate(1, pieces);
  ASSERT_EQ(pieces.size(), whole.size());
  for (size_t v = 0; v < whole.size(); ++v) {
    EXPECT_TRUE(torch::equal(pieces[v].labels, whole[v].labels)) << "video " << v;
    EXPECT_TRUE(torch::allclose(pieces[v].probabilities, whole[v].probabilities, 1e-5, 1e-6));
  }
  EXPECT_DOUBLE_EQ(streamed.accuracy, expected.accuracy);
  EXPECT_EQ(streamed.frames, expected.frames);
}

TEST(Training, ResumedRunEndsWithIdenticalWeights) {
  // Uninterrupted: 5 steps. Interrupted: stopped after step 2 (checkpoint every step), then
  // resumed to 5. Augmentation, data order, dropout (TCN) and the optimizer state must all agree.
  auto base = tiny_config("/tmp/framefit_resume_a");
  base.model.head = "tcn";
  base.data.augment = true;
  base.data.resize = 40;
  base.data.crop = 32;
  base.train.max_steps = 5;
  base.train.schedule = "constant";  // the interrupted run's max_steps must not change the lr
  base.train.checkpoint_every = 1;
  train::train(base);
  const auto uninterrupted =
      weights(train::load_model(base.train.out_dir + "/checkpoints/step_00000005.pt"));

  auto first = tiny_config("/tmp/framefit_resume_b");
  first.model.head = "tcn";
  first.data.augment = true;
  first.data.resize = 40;
  first.data.crop = 32;
  first.train.schedule = "constant";
  first.train.checkpoint_every = 1;
  first.train.max_steps = 2;
  train::train(first);
  auto rest = first;
  rest.train.max_steps = 5;
  // Another process would start from scratch: scramble the global generator first.
  torch::manual_seed(12345);
  const auto result = train::train(rest, "auto");
  EXPECT_EQ(result.steps, 5);
  const auto resumed =
      weights(train::load_model(first.train.out_dir + "/checkpoints/step_00000005.pt"));
  EXPECT_TRUE(identical(uninterrupted, resumed));

  // The log reads as one run: steps 1..5 once each.
  std::ifstream log(first.train.out_dir + "/log.jsonl");
  int step_lines = 0;
  for (std::string line; std::getline(log, line);)
    step_lines += line.find("\"type\":\"step\"") != std::string::npos;
  EXPECT_EQ(step_lines, 5);
  test_util::remove_tree(base.train.out_dir);
  test_util::remove_tree(first.train.out_dir);
}
TEST(Training, UnderAProcessBudgetTheResidentMemoryStaysWithinIt) {
  // On the CPU train.budget is what a memory limit sees: the steps' resident peak (VmHWM from the
  // first step on) stays within it, the runtime's own memory included, and the plan says what to
  // expect. The budget leaves the step little beside ResNet-18's weights, gradients and Adam's
  // moments (chunk 1 alone is predicted at 294 MiB): planned in the whole budget, or with the
  // allocator's cache at twice it, the resident memory would pass it.
  if (!memory::reset_rss_peak()) GTEST_SKIP() << "/proc/self/clear_refs cannot be written here";
  auto config = tiny_config("/tmp/framefit_process_budget");
  config.data.resize = 128;
  config.train.chunk = std::nullopt;
  config.train.keep = std::nullopt;
  config.train.max_steps = 3;
  config.train.budget_covers = "process";
  const int64_t runtime = memory::process_memory().untracked_bytes + train::kRuntimeGrowthBytes;
  config.train.budget = runtime + (int64_t{448} << 20);
  std::vector<std::string> notes;
  train::train(config, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) notes.push_back(e.message);
  });
  const auto plan = std::find_if(notes.begin(), notes.end(), [](const std::string& n) {
    return n.rfind("plan: ", 0) == 0;
  });
  ASSERT_NE(plan, notes.end()) << c10::Join("\n", notes);
  EXPECT_NE(plan->find("less the runtime's "), std::string::npos) << *plan;
  EXPECT_NE(plan->find("expected RSS about "), std::string::npos) << *plan;
  std::ifstream log(config.train.out_dir + "/log.jsonl");
  int steps = 0;
  for (std::string line; std::getline(log, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record["type"] != "step") continue;
    ++steps;
    EXPECT_LE(record["rss_peak_bytes"].get<int64_t>(), config.train.budget)
        << "step " << record["step"] << " of " << *plan;
    // The tensors and the allocator's cache: within the tensors' share.
    EXPECT_LE(record["held_bytes"].get<int64_t>(), config.train.budget - train::kRuntimeGrowthBytes);
  }
  EXPECT_EQ(steps, 3);
  test_util::remove_tree(config.train.out_dir);
}

TEST(Training, TaskPlanRecordsThePhasesPlanAndSaysItInLines) {
  // What `plan --config` prints and a script (or the Python module) reads: the plan as planned.
  auto config = tiny_config("/tmp/framefit_task_plan");
  config.train.chunk = std::nullopt;
  config.train.keep = std::nullopt;
  const auto planned = train::plan_phases(config, memory::Tracker::cpu());
  ASSERT_TRUE(planned.fits && planned.planned);
  const auto run = train::task_for(config).plan(config, memory::Tracker::cpu(), {});
  EXPECT_TRUE(run.fits);
  EXPECT_EQ(run.record.at("fits"), true);
  EXPECT_EQ(run.record.at("planned"), true);
  EXPECT_EQ(run.record.at("settings").at("chunk"),
            planned.settings.naive() ? 0 : planned.settings.chunk);
  EXPECT_EQ(run.record.at("settings").at("keep"), planned.settings.keep);
  EXPECT_EQ(run.record.at("predicted_peak_bytes"), planned.breakdown.peak_bytes);
  EXPECT_EQ(run.record.at("breakdown").at("activations"), planned.breakdown.activations);
  EXPECT_EQ(run.record.at("step_budget_bytes"), planned.budget.step);
  EXPECT_EQ(run.record.at("videos"), planned.videos);
  ASSERT_GE(run.lines.size(), 3u);
  EXPECT_EQ(run.lines[0].rfind("framefit plan: resnet18 + ", 0), 0u) << run.lines[0];
  EXPECT_EQ(run.lines[1], "  " + plan::describe(planned.settings));
  EXPECT_TRUE(run.table.empty());
  // Settings the budget cannot hold: not fitting, with the advice in the record and the lines.
  auto tight = config;
  tight.train.budget = 4 << 20;
  tight.train.budget_covers = "tensors";
  const auto refused = train::task_for(tight).plan(tight, memory::Tracker::cpu(), {});
  EXPECT_FALSE(refused.fits);
  EXPECT_EQ(refused.record.at("fits"), false);
  EXPECT_FALSE(refused.record.at("advice").get<std::string>().empty());
  EXPECT_EQ(refused.lines.back().rfind("  does not fit: ", 0), 0u) << refused.lines.back();
}

TEST(Training, ResumedUnderAnotherBudgetKeepsTheSettingsThatFitAndReplansThoseThatDoNot) {
  // The run's plan under 2 GiB, and a budget it does not fit: there the planner chooses other
  // settings (the same calibrated costs choose the same fastest settings wherever they fit).
  auto config = tiny_config("/tmp/framefit_resume_budget");
  config.data.resize = 128;  // activations that outweigh the weights and Adam's moments
  config.train.chunk = std::nullopt;
  config.train.keep = std::nullopt;
  config.train.max_steps = 2;
  config.train.checkpoint_every = 1;
  const auto planned = train::plan_phases(config, memory::Tracker::cpu());
  ASSERT_TRUE(planned.fits);
  const std::string first_settings = plan::describe(planned.settings);
  auto smaller = config;
  std::optional<train::PhasePlan> replan;
  // A fifth less each time: halving stepped from where the whole video fits to where nothing
  // does once the prefetch reserve shrank to the decoded videos it holds.
  for (int64_t budget = config.train.budget * 4 / 5; budget > (1 << 20) && !replan;
       budget = budget * 4 / 5) {
    smaller.train.budget = budget;
    auto p = train::plan_phases(smaller, memory::Tracker::cpu());
    if (p.fits && plan::describe(p.settings) != first_settings) replan = p;
  }
  ASSERT_TRUE(replan) << "no budget below 2 GiB changes " << first_settings;
  train::train(config);

  const auto resume = [](train::Config c, int64_t max_steps, std::vector<std::string>& notes) {
    c.train.max_steps = max_steps;
    notes.clear();
    return train::train(c, "auto", [&](const train::Event& e) {
      if (e.kind != train::Event::Kind::Step) notes.push_back(e.message);
    });
  };
  const auto find = [](const std::vector<std::string>& notes, const std::string& text) {
    return std::any_of(notes.begin(), notes.end(),
                       [&](const std::string& n) { return n.find(text) != std::string::npos; });
  };
  // A larger budget: the checkpoint's settings fit it and stay.
  std::vector<std::string> notes;
  auto larger = config;
  larger.train.budget = config.train.budget * 2;
  EXPECT_EQ(resume(larger, 3, notes).steps, 3);
  EXPECT_TRUE(find(notes, "train.budget changed from 2.00 GiB to 4.00 GiB: the checkpoint's " +
                              first_settings + " is predicted to need"))
      << c10::Join("\n", notes);
  EXPECT_TRUE(find(notes, "; kept, so the run goes on as it would have"));
  // The smaller one: re-planned before the first step, which then does not run out of memory.
  EXPECT_EQ(resume(smaller, 4, notes).steps, 4);
  EXPECT_TRUE(find(notes, "re-planned to " + plan::describe(replan->settings)))
      << c10::Join("\n", notes);
  EXPECT_FALSE(find(notes, "out of memory")) << c10::Join("\n", notes);
  EXPECT_TRUE(find(
      notes, "settings: " + plan::describe(replan->settings) + " (re-planned for the new budget)"));
  // Its checkpoints carry the new settings on: resumed again under the same budget, nothing
  // is said about budgets.
  EXPECT_EQ(resume(smaller, 5, notes).steps, 5);
  EXPECT_FALSE(find(notes, "train.budget changed")) << c10::Join("\n", notes);
  EXPECT_TRUE(
      find(notes, "settings: " + plan::describe(replan->settings) + " (from the checkpoint)"))
      << c10::Join("\n", notes);
  test_util::remove_tree(config.train.out_dir);
}

TEST(Training, BatchNormRecomputationIsPlannedWhereOnlyItFitsAndKeptOnResume) {
  auto config = tiny_config("/tmp/framefit_recompute_norm");
  config.model.norm = "bn";
  config.data.resize = 128;  // activations that outweigh the weights and Adam's moments
  config.train.chunk = std::nullopt;
  config.train.keep = std::nullopt;
  config.train.max_steps = 2;
  config.train.checkpoint_every = 1;
  const auto fits = [&](int64_t budget) {
    auto c = config;
    c.train.budget = budget;
    return train::plan_phases(c, memory::Tracker::cpu()).fits;
  };
  // The smallest budget anything fits, to 64 KiB: only the recomputed blocks fit there.
  int64_t too_small = int64_t{32} << 20, enough = config.train.budget;
  ASSERT_TRUE(fits(enough));
  ASSERT_FALSE(fits(too_small));
  while (enough - too_small > (int64_t{64} << 10)) {
    const int64_t middle = too_small + (enough - too_small) / 2;
    (fits(middle) ? enough : too_small) = middle;
  }
  config.train.budget = enough;
  const auto least = train::plan_phases(config, memory::Tracker::cpu());
  ASSERT_TRUE(least.fits);
  EXPECT_TRUE(least.settings.recompute_norm) << plan::describe(least.settings);
  auto plain = config;
  plain.model.recompute_norm = false;
  EXPECT_FALSE(train::plan_phases(plain, memory::Tracker::cpu()).fits);
  // A roomy budget: chunks large enough that it is not worth its time.
  auto roomy = config;
  roomy.train.budget = int64_t{8} << 30;
  EXPECT_FALSE(train::plan_phases(roomy, memory::Tracker::cpu()).settings.recompute_norm);

  std::vector<std::string> notes;
  const auto run = [&](train::Config c, int64_t max_steps, const std::string& resume) {
    c.train.max_steps = max_steps;
    notes.clear();
    return train::train(c, resume, [&](const train::Event& e) {
      if (e.kind != train::Event::Kind::Step) notes.push_back(e.message);
    });
  };
  const auto said = [&](const std::string& text) {
    return std::any_of(notes.begin(), notes.end(),
                       [&](const std::string& n) { return n.find(text) != std::string::npos; });
  };
  const std::string settings = plan::describe(least.settings);
  EXPECT_EQ(run(config, 2, "").steps, 2);
  EXPECT_TRUE(said("plan: " + settings + ", predicted peak")) << c10::Join("\n", notes);
  EXPECT_TRUE(said("BatchNorm recomputed: without it nothing fits (needs at least "))
      << c10::Join("\n", notes);
  EXPECT_FALSE(said("out of memory")) << c10::Join("\n", notes);
  // The checkpoint keeps the choice: a resumed run goes on with it, not planned again.
  EXPECT_EQ(run(config, 3, "auto").steps, 3);
  EXPECT_TRUE(said("settings: " + settings + " (from the checkpoint)")) << c10::Join("\n", notes);
  test_util::remove_tree(config.train.out_dir);
}

namespace {
std::vector<nlohmann::json> epoch_records(const std::string& out_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream log(out_dir + "/log.jsonl");
  for (std::string line; std::getline(log, line);) {
    auto record = nlohmann::json::parse(line);
    if (record["type"] == "epoch") out.push_back(record);
  }
  return out;
}
}  // namespace

TEST(Training, FrozenEncoderFeaturesAreCachedAndTrainTheHeadAsRecomputedOnes) {
  // An encoder frozen through layer4 trains nothing: from the second epoch on, the head trains
  // on the features its first steps kept, and ends with the weights of recomputing them.
  const auto frozen = [](const std::string& name, bool cache) {
    auto c = tiny_config(name);
    c.model.freeze = "layer4";
    c.data.augment = false;
    c.train.epochs = 3;
    c.train.cache_features = cache;  // auto | off
    c.train.schedule = "constant";  // the stopped run's max_steps must not change the lr
    return c;
  };
  const auto cached = frozen("/tmp/framefit_feature_cache_on", true);
  std::vector<std::string> infos;
  train::train(cached, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
  });
  const auto count = [&](const std::string& text) {
    return std::count_if(infos.begin(), infos.end(),
                         [&](const std::string& m) { return m.find(text) != std::string::npos; });
  };
  EXPECT_EQ(count("videos' features from the feature cache"), 2);  // epochs 2 and 3
  EXPECT_EQ(count("epoch 2: 3 of 3 videos' features from the feature cache"), 1);
  EXPECT_TRUE(std::filesystem::exists(cached.train.out_dir + "/feature_cache/0.pt"));

  const auto recomputed = frozen("/tmp/framefit_feature_cache_off", false);
  train::train(recomputed);
  const auto last = "/checkpoints/step_00000009.pt";
  EXPECT_TRUE(identical(weights(train::load_model(cached.train.out_dir + last)),
                        weights(train::load_model(recomputed.train.out_dir + last))));
  EXPECT_FALSE(std::filesystem::exists(recomputed.train.out_dir + "/feature_cache"));
  // Validation ran the head on its kept features from epoch 2 on: the same metrics.
  EXPECT_TRUE(std::filesystem::exists(cached.train.out_dir + "/feature_cache/validation/0.pt"));
  const auto cached_epochs = epoch_records(cached.train.out_dir);
  const auto recomputed_epochs = epoch_records(recomputed.train.out_dir);
  ASSERT_EQ(cached_epochs.size(), 3u);
  ASSERT_EQ(recomputed_epochs.size(), 3u);
  for (size_t e = 0; e < 3; ++e) EXPECT_EQ(cached_epochs[e]["val"], recomputed_epochs[e]["val"]);

  // A run stopped in epoch 2 resumes on the cached features to the same weights; a damaged file
  // is computed again.
  auto stopped = frozen("/tmp/framefit_feature_cache_resume", true);
  stopped.train.max_steps = 5;
  train::train(stopped);
  std::ofstream(stopped.train.out_dir + "/feature_cache/1.pt") << "damaged";
  auto rest = stopped;
  rest.train.max_steps = 0;
  train::train(rest, "auto");
  EXPECT_TRUE(identical(weights(train::load_model(cached.train.out_dir + last)),
                        weights(train::load_model(stopped.train.out_dir + last))));
  // The cache is kept by position in the data set, so a video file that changed since (here only
  // its time) starts it afresh; one that did not keeps it.
  auto changed = frozen("/tmp/framefit_feature_cache_changed", true);
  changed.train.max_steps = 4;
  train::train(changed);
  const auto sentinel = changed.train.out_dir + "/feature_cache/sentinel";
  std::ofstream(sentinel) << "kept";
  changed.train.max_steps = 5;
  train::train(changed, "auto");
  EXPECT_TRUE(std::filesystem::exists(sentinel));
  const auto video = data::read_manifest(changed.data.manifest).at(0).video;
  const auto time = std::filesystem::last_write_time(video);
  std::filesystem::last_write_time(video, time + std::chrono::hours(1));
  changed.train.max_steps = 6;
  train::train(changed, "auto");
  std::filesystem::last_write_time(video, time);
  EXPECT_FALSE(std::filesystem::exists(sentinel));
  test_util::remove_tree(changed.train.out_dir);

  // With augmentation each epoch's frames differ: nothing is cached.
  auto augmented = frozen("/tmp/framefit_feature_cache_augmented", true);
  augmented.data.augment = true;
  augmented.train.epochs = 1;
  train::train(augmented);
  EXPECT_FALSE(std::filesystem::exists(augmented.train.out_dir + "/feature_cache"));
  for (const auto& dir : {cached.train.out_dir, recomputed.train.out_dir, stopped.train.out_dir,
                          augmented.train.out_dir}) {
    test_util::remove_tree(dir);
  }
}

TEST(Training, HeadTrainsOnPrecomputedFeaturesInEitherLayout) {
  // Two-stage training (MS-TCN, TeCNO): features computed before, one file per video; the head
  // alone trains on them. Phases a, b, c in thirds; a phase shows in its own feature dimension.
  const std::string dir = "/tmp/framefit_features_training";
  test_util::remove_tree(dir);
  std::filesystem::create_directories(dir + "/runs");
  // manifest.csv: [T,D] float32 files. dt.csv: MS-TCN's [D,T], float64. half.csv: rows 0, 2, 4,
  // ... written out, with their labels.
  std::string features_first = "name,labels,split,features\n";
  std::string halved = features_first;
  for (const auto& v : write_feature_videos(dir)) {
    const int64_t frames = v.features.size(0);
    models::write_tensor(v.features.t().to(torch::kFloat64), dir + "/" + v.name + "_dt.pt");
    models::write_tensor(v.features.slice(0, 0, frames, 2).contiguous(),
                         dir + "/" + v.name + "_half.pt");
    write_phase_labels(dir + "/" + v.name + "_half.txt", v.labels.slice(0, 0, frames, 2));
    features_first += v.name + "," + v.name + ".txt," + v.split + "," + v.name + "_dt.pt\n";
    halved += v.name + "," + v.name + "_half.txt," + v.split + "," + v.name + "_half.pt\n";
  }
  std::ofstream(dir + "/half.csv") << halved;
  std::ofstream(dir + "/dt.csv") << features_first;
  const auto config = [&](const std::string& manifest) {
    // MS-TCN's offline head, smaller: three non-causal stages of four layers.
    return train::parse_config(
        "model: {encoder: features, head: tcn, tcn_stages: 3, tcn_layers: 4, causal: false}\n"
        "data: {manifest: " +
            dir + "/" + manifest +
            ", classes: [a, b, c]}\n"
            "train: {epochs: 12, lr: 0.01, out_dir: " +
            dir + "/runs/" + manifest + "}\n",
        "test");
  };
  std::vector<std::string> infos;
  const auto result = train::train(config("manifest.csv"), "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
  });
  EXPECT_GT(result.best.accuracy, 0.9);  // chance: a third
  EXPECT_NE(std::find(infos.begin(), infos.end(),
                      "settings: the head alone on precomputed features (6 per frame), float32, "
                      "whole videos"),
            infos.end());
  auto model = train::load_model(result.best_checkpoint);
  EXPECT_EQ(model.feature_dim, 6);
  EXPECT_EQ(model.config.model.feature_dim, 6);  // taken from the data, stored with the run
  const auto tcn = std::dynamic_pointer_cast<models::TCNHeadImpl>(model.head);
  ASSERT_TRUE(tcn);
  EXPECT_EQ(tcn->options().stages(), 3);
  EXPECT_FALSE(tcn->options().causal());
  for (const auto& [name, tensor] : train::export_state_dict(model))
    EXPECT_EQ(name.rfind("head.", 0), 0u) << name;
  // Evaluation and prediction from a file agree.
  const auto val = train::make_dataset(model.config, "val", false);
  torch::Tensor evaluated;
  const auto metrics = train::evaluate(
      model, val, {}, nullptr, [&](int64_t, const train::Prediction& p) { evaluated = p.labels; });
  EXPECT_DOUBLE_EQ(metrics.accuracy, result.best.accuracy);
  const auto predicted = train::predict_features(model, models::read_tensor(dir + "/v4.pt"));
  EXPECT_TRUE(torch::equal(predicted.labels, evaluated));
  EXPECT_NE(test_util::error_message([&] {
              train::predict(model, torch::zeros({2, 3, 8, 8}, torch::kUInt8));
            }).find("reads precomputed features, not frames"),
            std::string::npos);

  // MS-TCN's layout ([D,T], float64 here) trains the same weights.
  const auto transposed = train::train(config("dt.csv"));
  EXPECT_TRUE(identical(weights(model), weights(train::load_model(transposed.best_checkpoint))));
  // data.features_stride 2 (MS-TCN's sample_rate) trains on rows 0, 2, 4, ... and their labels:
  // the weights of training on files holding only those rows.
  auto strided = config("manifest.csv");
  strided.data.features_stride = 2;
  strided.train.out_dir = dir + "/runs/strided";
  const auto every_other = train::train(strided);
  const auto written_out = train::train(config("half.csv"));
  EXPECT_TRUE(identical(weights(train::load_model(every_other.best_checkpoint)),
                        weights(train::load_model(written_out.best_checkpoint))));
  EXPECT_DOUBLE_EQ(every_other.best.accuracy, written_out.best.accuracy);
  // Settings for an encoder are refused.
  auto with_weights = config("manifest.csv");
  with_weights.model.weights = "resnet18.pt";
  with_weights.train.out_dir = dir + "/runs/refused";
  EXPECT_NE(test_util::error_message([&] {
              train::train(with_weights);
            }).find("model.weights and model.freeze are for an encoder"),
            std::string::npos);
  auto clips = config("manifest.csv");
  clips.task = "clips";
  const auto findings = train::diagnose_label_settings(clips);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_NE(findings[0].problem.find("model.encoder features trains a temporal head"),
            std::string::npos);
  test_util::remove_tree(dir);
}

TEST(Training, ExtractedFeaturesGiveTheHeadThePredictionsOfTheWholeModel) {
  // Stage one writes every split's features with the labels of the sampled frames; a features
  // model holding the same head then predicts exactly what the whole model predicts.
  auto config = tiny_config("/tmp/framefit_extract_features");
  auto model = train::build_model(config);
  const auto dir = config.train.out_dir + "/features";
  std::vector<std::string> infos;
  const auto manifest = train::extract_features(model, dir, [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
  });
  EXPECT_EQ(manifest, dir + "/manifest.csv");
  const auto entries = data::read_manifest(manifest);
  ASSERT_EQ(entries.size(), 5u);  // train 3, val 1, test 1
  EXPECT_EQ(infos.size(), 5u);
  EXPECT_EQ(entries[4].split, "test");
  EXPECT_DOUBLE_EQ(entries[0].fps, 12.5);

  auto features_config = config;
  features_config.model.encoder = "features";
  features_config.model.feature_dim = model.feature_dim;
  features_config.data.manifest = manifest;
  auto features_model = train::build_model(features_config);
  {
    torch::NoGradGuard no_grad;
    const auto from = model.head->parameters(), to = features_model.head->parameters();
    ASSERT_EQ(from.size(), to.size());
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  for (const auto& split : {"val", "test"}) {
    const auto videos = train::make_dataset(config, split, false);
    const auto rows = train::make_dataset(features_config, split, false);
    ASSERT_EQ(rows.size(), 1);
    EXPECT_TRUE(torch::equal(rows.labels(0), videos.labels(0)));  // the sampled frames' labels
    torch::Tensor whole, head;
    const auto a =
        train::evaluate(model, videos, {}, nullptr,
                        [&](int64_t, const train::Prediction& p) { whole = p.probabilities; });
    const auto b =
        train::evaluate(features_model, rows, {}, nullptr,
                        [&](int64_t, const train::Prediction& p) { head = p.probabilities; });
    EXPECT_TRUE(torch::equal(whole, head)) << split;
    EXPECT_EQ(a.confusion, b.confusion) << split;
  }
  EXPECT_NE(test_util::error_message([&] {
              train::extract_features(features_model, dir + "2");
            }).find("has no encoder to extract features with"),
            std::string::npos);
  // Into the data set's own folder: its manifest.csv would be replaced by the features' (it was,
  // and the next read of the data set found features files and no videos). Refused, unwritten.
  const auto data_dir = config.train.out_dir + "/data";
  std::filesystem::create_directories(data_dir);
  data::write_manifest(data_dir + "/manifest.csv", data::read_manifest(config.data.manifest));
  const auto before = test_util::read_lines(data_dir + "/manifest.csv");
  model.config.data.manifest = data_dir + "/manifest.csv";
  const auto over = test_util::error_message([&] { train::extract_features(model, data_dir); });
  EXPECT_NE(over.find("extract would write " + data_dir +
                      "/manifest.csv over the data set's manifest"),
            std::string::npos)
      << over;
  EXPECT_EQ(test_util::read_lines(data_dir + "/manifest.csv"), before);
  test_util::remove_tree(config.train.out_dir);
}

TEST(Training, OnlinePredictionsAreThoseOfTheWholeVideoSoFar) {
  // Frames arrive in pieces of uneven sizes; each piece's predictions equal those predict() gives
  // the whole video, for every causal head (the TCN with a receptive field shorter than the video,
  // so its history is cut).
  auto config = tiny_config("/tmp/framefit_online");
  config.model.encoder = "features";
  config.model.feature_dim = 16;
  torch::manual_seed(3);
  const auto features = torch::randn({300, 16});
  const std::vector<int64_t> pieces = {1, 7, 50, 2, 100, 140};
  for (const std::string kind : {"linear", "lstm", "tcn"}) {
    config.model.head = kind;
    auto model = train::build_model(config);
    if (kind == "tcn") {
      model.head =
          models::TCNHead(models::TCNHeadOptions(16, model.classes.size()).layers(3)).ptr();
      ASSERT_EQ(std::dynamic_pointer_cast<models::TCNHeadImpl>(model.head)->receptive_field(), 29);
    }
    const auto whole = train::predict_features(model, features);
    train::OnlinePredictor online(model);
    for (int round = 0; round < 2; ++round) {  // reset starts a new video
      std::vector<torch::Tensor> parts;
      int64_t at = 0;
      for (const int64_t n : pieces) {
        parts.push_back(online.push_features(features.slice(0, at, at + n)).probabilities);
        at += n;
      }
      EXPECT_EQ(online.frames(), 300);
      EXPECT_TRUE(torch::allclose(torch::cat(parts), whole.probabilities, 1e-4, 1e-6))
          << kind << ": " << (torch::cat(parts) - whole.probabilities).abs().max().item<double>();
      online.reset();
    }
  }
  // Heads that read later frames cannot predict online.
  auto model = train::build_model(config);
  model.head = models::TCNHead(models::TCNHeadOptions(16, 5).causal(false)).ptr();
  EXPECT_NE(test_util::error_message([&] { train::OnlinePredictor{model}; }).find("not causal"),
            std::string::npos);
  model.head = models::LSTMHead(models::LSTMHeadOptions(16, 5).bidirectional(true)).ptr();
  EXPECT_NE(test_util::error_message([&] { train::OnlinePredictor{model}; }).find("bidirectional"),
            std::string::npos);

  // From frames: the encoder per piece, the head's state carried.
  auto video_model = train::build_model(tiny_config("/tmp/framefit_online_frames"));
  const auto frames = torch::randint(0, 256, {24, 3, 32, 32}, torch::kUInt8);
  const auto whole = train::predict(video_model, frames);
  train::OnlinePredictor online(video_model);
  const auto first = online.push(frames.slice(0, 0, 10)).probabilities;
  const auto rest = online.push(frames.slice(0, 10)).probabilities;
  EXPECT_TRUE(torch::allclose(torch::cat({first, rest}), whole.probabilities, 1e-4, 1e-6));
}

TEST(Training, TrainBestByPicksTheBestCheckpointAndPatienceEndsTheRun) {
  // By the edit score: an epoch is best exactly when its validation edit beats every earlier
  // one's, and best.pt holds that epoch's weights (its evaluation gives that edit).
  auto config = tiny_config("/tmp/framefit_best_by");
  config.train.epochs = 3;
  config.train.best_by = "edit";
  train::train(config);
  double best = -1;
  for (const auto& r : epoch_records(config.train.out_dir)) {
    const double edit = r["val"]["segments"]["edit"].get<double>();
    EXPECT_EQ(r["best"].get<bool>(), edit > best) << r.dump();
    best = std::max(best, edit);
  }
  const auto best_pt = config.train.out_dir + "/best.pt";
  auto model = train::load_model(best_pt);
  const auto val_set = train::make_dataset(model.config, "val", false);
  EXPECT_DOUBLE_EQ(train::evaluate(model, val_set).segments->edit, best);
  // eval and predict may change data and run settings, not the trained model: a BatchNorm
  // model found GroupNorm's weights of the same shapes and ran.
  const auto renormed = test_util::error_message([&] {
    train::load_model(best_pt, {"model.norm=bn", "data.fps=5"});
  });
  EXPECT_NE(renormed.find("checkpoint " + best_pt +
                          " holds a trained model, which --set cannot "
                          "change: model.norm: group_norm -> bn (of the model keys, only"),
            std::string::npos)
      << renormed;
  EXPECT_EQ(
      train::load_model(best_pt, {"model.layout=channels_last", "data.fps=5"}).config.data.fps, 5);
  // A device this machine does not have (a model trained on a GPU, read without one): LibTorch
  // said "PyTorch is not linked with support for cuda devices".
  const auto elsewhere =
      test_util::error_message([&] { train::load_model(best_pt, {"device=cuda:99"}); });
  EXPECT_NE(elsewhere.find("device cuda:99 cannot be used: "), std::string::npos) << elsewhere;
  EXPECT_NE(elsewhere.find("; add --set device=cpu"), std::string::npos) << elsewhere;
  // A run resumed with another LSTM width: LibTorch's load resized the weights to the stored
  // ones (Tensor::set_), so the run went on with the checkpoint's width without a word.
  auto narrower = config;
  narrower.model.head_settings.lstm_hidden = 17;
  narrower.train.epochs = 4;
  const auto resized = test_util::error_message([&] { train::train(narrower, "auto"); });
  EXPECT_NE(resized.find(": its `head.lstm.weight_ih_l0` is ["), std::string::npos) << resized;
  EXPECT_NE(resized.find("where the model built from the config this run resumes with has [68, "),
            std::string::npos)
      << resized;
  test_util::remove_tree(config.train.out_dir);

  // A learning rate so small that no float32 weight changes: every epoch validates alike, so
  // only the first is best ...
  config.train.lr = 1e-30;
  config.train.epochs = 2;
  config.train.best_by = "macro_f1";
  train::train(config);
  // ... and a run resumed to choose by macro Jaccard (never above macro F1: J = F / (2 - F) per
  // phase) would never find a better epoch against the stored best F1. That score is of another
  // metric, so the resumed run starts its comparison afresh: its first validation is best.
  auto resumed = config;
  resumed.train.epochs = 3;
  resumed.train.best_by = "macro_jaccard";
  train::train(resumed, "auto");
  std::vector<bool> flags;
  for (const auto& r : epoch_records(config.train.out_dir)) flags.push_back(r["best"].get<bool>());
  EXPECT_EQ(flags, (std::vector<bool>{true, false, true}));
  test_util::remove_tree(config.train.out_dir);

  // Patience 2: with validation that never improves after epoch 1, the run ends after epoch 3
  // of 5 - and a resumed run remembers the two stale epochs: it stops after one more.
  auto patient = config;
  patient.train.out_dir += "_patience";
  test_util::remove_tree(patient.train.out_dir);
  patient.train.epochs = 5;
  patient.train.patience = 2;
  patient.train.best_by = "accuracy";
  std::vector<std::string> notes;
  const auto early = train::train(patient, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) notes.push_back(e.message);
  });
  EXPECT_TRUE(early.stopped_early);
  EXPECT_FALSE(early.stopped);
  EXPECT_EQ(early.steps, 9);
  EXPECT_EQ(epoch_records(patient.train.out_dir).size(), 3u);
  EXPECT_NE(std::find_if(notes.begin(), notes.end(),
                         [](const std::string& m) {
                           return m.find(
                                      "stopping early: validation accuracy has not improved "
                                      "for 2 epochs (train.patience 2)") != std::string::npos;
                         }),
            notes.end());
  const auto again = train::train(patient, "auto");
  EXPECT_TRUE(again.stopped_early);
  EXPECT_EQ(again.steps, 12);
  EXPECT_EQ(epoch_records(patient.train.out_dir).size(), 4u);
  test_util::remove_tree(patient.train.out_dir);
  test_util::remove_tree(config.train.out_dir);

  // Segmental metrics need frame sequences; a metric_value that is not there is named.
  auto clips = train::parse_config("task: clips\ndata:\n  classes: [a, b]\n", "test");
  clips.train.best_by = "f1@50";
  const auto findings = train::diagnose_label_settings(clips);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_NE(findings[0].problem.find("train.best_by f1@50 scores segments"), std::string::npos);
  EXPECT_NE(test_util::error_message([] {
              train::metric_value(train::PhaseMetrics{}, "edit");
            }).find("task phases"),
            std::string::npos);
  EXPECT_EQ(train::best_metric(clips), "f1@50");
  clips.train.best_by = std::nullopt;
  EXPECT_EQ(train::best_metric(clips), "accuracy");
}

namespace {
// A per-frame encoder: conv, ReLU, global mean, linear to 16 features.
std::string write_tiny_script_encoder(const std::string& path) {
  torch::manual_seed(3);
  return test_util::write_script_module(path,
                                        {{"conv_weight", torch::randn({8, 3, 3, 3}) * 0.2},
                                         {"conv_bias", torch::zeros({8})},
                                         {"fc_weight", torch::randn({16, 8}) * 0.3},
                                         {"fc_bias", torch::zeros({16})}},
                                        R"(
def forward(self, x):
    h = torch.relu(torch.conv2d(x, self.conv_weight, self.conv_bias, [2, 2], [1, 1]))
    return torch.linear(h.mean([2, 3]), self.fc_weight, self.fc_bias)
)");
}
}  // namespace

TEST(Training, TorchScriptEncoderTrainsThroughThePlannedChunkedEngine) {
  auto config = tiny_config("/tmp/framefit_train_test_script");
  config.model.encoder = "torchscript";
  config.model.script = write_tiny_script_encoder(config.train.out_dir + ".pt");
  config.model.head = "linear";
  config.train.chunk = std::nullopt;  // planned: the encoder is calibrated on a copy of the file
  config.train.keep = std::nullopt;
  config.train.budget = int64_t{256} << 20;
  const auto start = train::export_state_dict(train::build_model(config));
  std::vector<std::string> infos;
  const auto result = train::train(config, "", [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Info) infos.push_back(e.message);
  });
  EXPECT_EQ(result.steps, 6);
  auto said = [&](const std::string& text) {
    for (const auto& m : infos)
      if (m.find(text) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(said("calibrating the TorchScript encoder"));
  EXPECT_TRUE(said("plan: "));

  // The checkpoint stores the module: it loads without the file.
  std::remove(config.model.script.c_str());
  auto model = train::load_model(config.train.out_dir + "/checkpoints/step_00000006.pt");
  EXPECT_EQ(model.feature_dim, 16);
  ASSERT_TRUE(model.script != nullptr);
  EXPECT_TRUE(model.encoder.is_empty());
  // Trained: the encoder's weights moved from the file's, and export uses the script's names.
  const auto trained = train::export_state_dict(model);
  ASSERT_EQ(trained.size(), start.size());
  EXPECT_EQ(trained.front().first, "encoder.conv_weight");
  EXPECT_FALSE(torch::allclose(trained.front().second, start.front().second));
  const auto test_set = train::make_dataset(model.config, "test", false);
  const auto metrics = train::evaluate(model, test_set);
  EXPECT_EQ(metrics.frames, test_set.frames(0));

  // What applies to ResNet encoders only is refused, naming the key.
  auto bad = config;
  bad.model.weights = "resnet18.pt";
  EXPECT_NE(test_util::error_message([&] { train::build_model(bad); }).find("model.weights"),
            std::string::npos);
  bad = config;
  bad.model.script.clear();
  EXPECT_NE(test_util::error_message([&] { train::build_model(bad); }).find("model.script"),
            std::string::npos);
  test_util::remove_tree(config.train.out_dir);
}

namespace {
// The tiny demo's manifest with a tool file per video, written to `dir`: every 5th source frame
// annotated, A present in phases 0-1, B in phases 3 and later, Scissors never.
std::string manifest_with_tools(const std::string& dir) {
  test_util::remove_tree(dir);
  std::filesystem::create_directories(dir);
  auto entries = data::read_manifest(tiny_demo() + "/manifest.csv");
  const auto classes = data::demo_classes();
  for (auto& entry : entries) {
    const auto labels = data::read_phase_annotations(entry.labels, classes);
    entry.tools = dir + "/" + entry.name + "-tool.txt";
    std::ofstream out(entry.tools);
    out << "Frame\tScissors\tA\tB\n";
    for (size_t f = 0; f < labels.size(); f += 5) {
      out << f << "\t0\t" << (labels[f] <= 1) << '\t' << (labels[f] >= 3) << '\n';
    }
  }
  data::write_manifest(dir + "/manifest.csv", entries);
  return dir + "/manifest.csv";
}
}  // namespace

TEST(Training, ToolPresenceTrainsWithThePhasesAndIsScoredSavedAndResumed) {
  auto config = tiny_config("/tmp/framefit_tools_run");
  config.data.manifest = manifest_with_tools(config.train.out_dir + "_data");
  config.data.tools = {"A", "B", "Scissors"};
  config.train.tool_weight = 2;
  // Sampled at 12.5 of 25 fps (source frames 0, 2, 4, ...): rows 0, 5, 10, ... are annotated.
  const auto val = train::make_dataset(config, "val", false);
  const auto tools = val.tools(0);
  ASSERT_EQ(tools.sizes(), (std::vector<int64_t>{val.frames(0), 3}));
  for (int64_t k = 0; k < tools.size(0); ++k) {
    EXPECT_EQ(tools[k][0].item<float>() >= 0, k % 5 == 0) << k;
  }
  const int64_t annotated = (val.frames(0) + 4) / 5;

  const auto result = train::train(config);
  ASSERT_TRUE(result.validated);
  ASSERT_TRUE(result.best.tools.has_value());
  EXPECT_EQ(result.best.tools->frames, annotated);
  EXPECT_TRUE(std::isnan(result.best.tools->average_precision[2]));  // Scissors: never present
  const auto records = epoch_records(config.train.out_dir);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_TRUE(records[1]["val"]["tools"]["average_precision"].contains("B"));

  auto model = train::load_model(result.best_checkpoint);
  ASSERT_TRUE(model.tools);
  const auto state = train::export_state_dict(model);
  const auto weight = std::find_if(state.begin(), state.end(),
                                   [](const auto& kv) { return kv.first == "tools.weight"; });
  ASSERT_NE(weight, state.end());
  EXPECT_EQ(weight->second.sizes(), (std::vector<int64_t>{3, 512}));
  // Evaluation scores the tools from the predictions it makes.
  const auto test = train::make_dataset(config, "test", false);
  torch::Tensor probabilities;
  const auto metrics = train::evaluate(
      model, test, {}, nullptr,
      [&](int64_t, const train::Prediction& p) { probabilities = p.tool_probabilities; });
  ASSERT_TRUE(metrics.tools.has_value());
  ASSERT_EQ(probabilities.sizes(), (std::vector<int64_t>{test.frames(0), 3}));
  train::ToolScorer scorer(3);
  scorer.add(probabilities, test.tools(0));
  EXPECT_DOUBLE_EQ(scorer.metrics().average_precision[0], metrics.tools->average_precision[0]);
  // Online prediction gives the same tool probabilities, piece by piece.
  train::OnlinePredictor online(model);
  const auto frames = test.load(0).frames;
  std::vector<torch::Tensor> pieces;
  for (int64_t at = 0; at < frames.size(0); at += 7) {
    pieces.push_back(online.push(frames.slice(0, at, at + 7)).tool_probabilities);
  }
  EXPECT_TRUE(torch::allclose(torch::cat(pieces), probabilities, 1e-4, 1e-5));

  // Resumed after step 2 of 4, the tool head ends as the uninterrupted run's.
  auto whole = config;
  whole.train.out_dir += "_whole";
  test_util::remove_tree(whole.train.out_dir);
  whole.train.max_steps = 4;
  whole.train.validate = false;
  train::train(whole);
  auto first = whole;
  first.train.out_dir += "_resumed";
  test_util::remove_tree(first.train.out_dir);
  first.train.max_steps = 2;
  train::train(first);
  auto rest = first;
  rest.train.max_steps = 4;
  train::train(rest, "auto");
  EXPECT_TRUE(identical(weights(train::load_model(whole.train.out_dir + "/best.pt")),
                        weights(train::load_model(first.train.out_dir + "/best.pt"))));

  // Stage one writes each video's tool presence with its features; a features run reads them.
  const auto dir = config.train.out_dir + "/features";
  // A file where the folder goes is named at once: mkdir's EEXIST let it pass until the first
  // video's features had been computed and could not be written.
  EXPECT_NE(
      test_util::error_message([&] {
        train::extract_features(model, result.best_checkpoint);
      }).find("cannot create directory " + result.best_checkpoint + ": a file of that name exists"),
      std::string::npos);
  const auto manifest = train::extract_features(model, dir);
  auto features_config = config;
  features_config.model.encoder = "features";
  features_config.model.feature_dim = model.feature_dim;
  features_config.data.manifest = manifest;
  const auto rows = train::make_dataset(features_config, "val", false);
  EXPECT_TRUE(torch::equal(rows.tools(0), tools));
  features_config.train.out_dir += "_features";
  test_util::remove_tree(features_config.train.out_dir);
  const auto head_only = train::train(features_config);
  ASSERT_TRUE(head_only.best.tools.has_value());
  EXPECT_EQ(head_only.best.tools->frames, annotated);

  // best.pt by tool mAP: the epoch whose validation mAP is highest. With class weights, each
  // tool's present frames weigh absent / present (Scissors, never present: 1).
  auto by_map = config;
  by_map.train.best_by = "tool_map";
  by_map.train.class_weights = true;
  by_map.train.out_dir += "_by_map";
  test_util::remove_tree(by_map.train.out_dir);
  std::string tool_weights;
  const auto by_map_result = train::train(by_map, "", [&](const train::Event& e) {
    if (e.message.rfind("tool weights", 0) == 0) tool_weights = e.message;
  });
  EXPECT_NE(tool_weights.find(", Scissors 1"), std::string::npos) << tool_weights;
  double highest = -1;
  for (const auto& record : epoch_records(by_map.train.out_dir)) {
    highest = std::max(highest, record["val"]["tools"]["mean_average_precision"].get<double>());
  }
  EXPECT_DOUBLE_EQ(by_map_result.best.tools->mean_average_precision, highest);
  test_util::remove_tree(by_map.train.out_dir);
  auto no_tools = config;
  no_tools.data.tools.clear();
  no_tools.train.best_by = "tool_map";
  EXPECT_NE(test_util::error_message([&] {
              train::train(no_tools);
            }).find("tool_map scores tool presence, which nothing learns"),
            std::string::npos);

  // The doctor names every video whose tool file is missing or bad, before training.
  auto entries = data::read_manifest(config.data.manifest);
  entries[0].tools = config.train.out_dir + "_data/missing-tool.txt";
  std::ofstream(config.train.out_dir + "_data/bad-tool.txt") << "Frame\tA\tB\tScissors\n0\t1\tyes\t0\n";
  entries[3].tools = config.train.out_dir + "_data/bad-tool.txt";
  data::write_manifest(config.train.out_dir + "_data/bad.csv", entries);
  auto bad = config;
  bad.data.manifest = config.train.out_dir + "_data/bad.csv";
  std::vector<std::string> errors;
  for (const auto& f : doctor_phases(bad)) {
    if (f.severity == plan::Finding::Severity::Error) errors.push_back(f.problem);
  }
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find("missing-tool.txt: cannot open"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("bad-tool.txt:2: tool B is \"yes\""), std::string::npos) << errors[1];

  // Tools are for phases, named once.
  auto twice = config;
  twice.data.tools = {"A", "A"};
  EXPECT_NE(test_util::error_message([&] { train::train(twice); }).find("names 'A' twice"),
            std::string::npos);
  for (const auto& d : {config.train.out_dir, config.train.out_dir + "_data", whole.train.out_dir,
                        first.train.out_dir, features_config.train.out_dir}) {
    test_util::remove_tree(d);
  }
}
#endif  // FRAMEFIT_WITH_FFMPEG
