#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "framefit/memory/monitor.h"
#include "framefit/memory/tracker.h"

using namespace framefit::memory;

namespace {
// One "training step": phases with temporaries; `leak` keeps one tensor per step alive.
void fake_step(Tracker& tracker, std::vector<torch::Tensor>* leak) {
  {
    auto phase = tracker.phase("encode");
    auto activations = torch::empty({1 << 20}, torch::kUInt8);
    if (leak) leak->push_back(torch::empty({256 << 10}, torch::kUInt8));
  }
  auto phase = tracker.phase("recompute");
  auto grads = torch::empty({2 << 20}, torch::kUInt8);
}
}  // namespace

TEST(TraceRecorder, WritesValidChromeTraceJson) {
  auto& tracker = Tracker::cpu();
  TraceRecorder trace(tracker);
  const int64_t before = tracker.current_bytes();
  trace.mark("step 1");
  fake_step(tracker, nullptr);
  const auto doc = nlohmann::json::parse(trace.json());
  ASSERT_TRUE(doc.contains("traceEvents"));
  std::map<std::string, int> begins, ends;
  int counters = 0, instants = 0;
  int64_t max_bytes = 0;
  for (const auto& e : doc["traceEvents"]) {
    const std::string ph = e["ph"];
    EXPECT_TRUE(e.contains("ts") && e.contains("pid") && e.contains("tid"));
    if (ph == "B") begins[e["name"]]++;
    if (ph == "E") ends[e["name"]]++;
    if (ph == "i") instants++;
    if (ph == "C") {
      counters++;
      if (e["name"] == "peak in phase") max_bytes = std::max<int64_t>(max_bytes, e["args"]["bytes"]);
    }
  }
  EXPECT_EQ(begins["encode"], 1);
  EXPECT_EQ(ends["encode"], 1);
  EXPECT_EQ(begins["recompute"], 1);
  EXPECT_EQ(instants, 1);
  EXPECT_GE(counters, 4);
  EXPECT_GE(max_bytes, before + (2 << 20));  // recompute's 2 MiB of gradients show as its peak
  const auto path = ::testing::TempDir() + "framefit_trace.json";
  trace.write(path);
  std::ifstream file(path);
  EXPECT_NO_THROW(nlohmann::json::parse(file));
}

TEST(LeakDetector, FiresOnAPlantedLeakAndNamesThePhase) {
  auto& tracker = Tracker::cpu();
  LeakDetector detector({/*warmup_steps=*/1, /*window=*/5, /*threshold=*/0.10});
  std::vector<torch::Tensor> leak;
  std::optional<std::string> warning;
  const int64_t base = tracker.current_bytes();
  auto ballast = torch::empty({2 << 20}, torch::kUInt8);  // steady use, so growth is relative
  for (int step = 0; step < 12 && !warning; ++step) {
    tracker.clear_phase_stats();
    fake_step(tracker, &leak);
    warning = detector.record(tracker.current_bytes() - base, tracker.phase_stats());
  }
  ASSERT_TRUE(warning.has_value());
  EXPECT_NE(warning->find("possible memory leak"), std::string::npos) << *warning;
  EXPECT_NE(warning->find("phase 'encode'"), std::string::npos) << *warning;
}

TEST(LeakDetector, GrowthBelowTheFloorIsQuietAndNoPhasesNameNone) {
  LeakDetectorOptions options;
  options.warmup_steps = 0;
  options.window = 3;
  options.min_growth_bytes = 1 << 20;
  LeakDetector detector(options);
  // A tiny model: 50% growth, but 500 KiB.
  EXPECT_FALSE(detector.record(1000 << 10).has_value());
  EXPECT_FALSE(detector.record(1250 << 10).has_value());
  EXPECT_FALSE(detector.record(1500 << 10).has_value());
  // 1.2 MiB over the window (1250 -> 2500 KiB): a leak; the steps gave no phases, so none is
  // named.
  const auto warning = detector.record(2500 << 10);
  ASSERT_TRUE(warning.has_value());
  EXPECT_NE(warning->find("grew"), std::string::npos) << *warning;
  EXPECT_EQ(warning->find("most growth in"), std::string::npos) << *warning;
}

TEST(LeakDetector, QuietOnASteadyRun) {
  auto& tracker = Tracker::cpu();
  LeakDetector detector({1, 5, 0.10});
  const int64_t base = tracker.current_bytes();
  auto ballast = torch::empty({2 << 20}, torch::kUInt8);
  for (int step = 0; step < 20; ++step) {
    tracker.clear_phase_stats();
    fake_step(tracker, nullptr);
    EXPECT_FALSE(detector.record(tracker.current_bytes() - base, tracker.phase_stats()).has_value())
        << "step " << step;
  }
}
