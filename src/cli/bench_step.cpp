// framefit bench-step: one warm-up and one measured training step on random data.
#include <fmt/core.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <optional>
#include <sstream>

#include "commands.h"
#include "framefit/core/runtime.h"
#include "framefit/engine/step.h"
#include "framefit/memory/monitor.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"
#include "framefit/plan/doctor.h"
#include "framefit/plan/planner.h"

namespace framefit::cli {

namespace {

struct BenchModel {
  models::ResNet encoder{nullptr};
  std::shared_ptr<models::TemporalHead> head;
  std::unique_ptr<engine::TrainingStep> step;
};

// The step's settings: from the flags, or from the planner where they are auto.
struct Settings {
  int64_t chunk = 0;
  int64_t keep = 1;
  bool cache_frozen = false;
  engine::Precision precision = engine::Precision::FP32;
  bool recompute_norm = false;  // the encoder's BatchNorm and ReLU (--recompute-norm, or planned)
};

// Autocast lowers float32 operations only: a float64 model would run in float64 throughout.
void check_autocast_dtype(const Args& args, engine::Precision precision) {
  TORCH_CHECK(args.text("dtype") != "float64" || precision == engine::Precision::FP32,
              "--precision ", engine::to_string(precision),
              " autocasts a float32 model; --dtype float64 runs in float64 throughout: use "
              "--precision fp32 with it");
}

BenchModel build(const Args& args, const Settings& settings) {
  const torch::Device device(args.text("device"));
  const auto dtype = args.text("dtype") == "float64" ? torch::kFloat64 : torch::kFloat32;
  check_autocast_dtype(args, settings.precision);
  torch::manual_seed(static_cast<uint64_t>(args.integer("seed")));
  BenchModel m;
  auto spec = model_spec(args);
  spec.recompute_norm = settings.recompute_norm;
  m.encoder = models::ResNet(spec.encoder_options());
  m.head = models::make_head(args.text("head"), m.encoder->feature_dim(), args.integer("classes"));
  m.encoder->to(device, dtype);
  m.head->to(device, dtype);
  m.encoder->train();
  m.head->train();

  engine::StepOptions step;
  step.chunked.chunk = settings.chunk;
  step.chunked.keep = settings.keep;
  step.chunked.cache_frozen = settings.cache_frozen;
  step.chunked.device = device;
  step.chunked.dtype = dtype;
  step.chunked.channels_last = spec.channels_last;
  step.precision = settings.precision;
  step.retry_on_out_of_memory = !args.on("no-retry");
  auto encoder = engine::frame_encoder(m.encoder.ptr());
  auto parameters = encoder.parameters;
  for (const auto& p : m.head->parameters()) parameters.push_back(p);
  engine::OptimizerOptions optimizer;
  optimizer.kind = args.text("optimizer");
  m.step = std::make_unique<engine::TrainingStep>(encoder, m.head,
                                                  engine::make_optimizer(parameters, optimizer),
                                                  step, memory::Tracker::of(device));
  return m;
}

Video random_video(const Args& args) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(args.integer("seed")) + 1);
  const int64_t t = args.integer("frames"), s = args.integer("size");
  return {torch::randint(0, 256, {t, 3, s, s}, gen, torch::kUInt8),
          torch::randint(0, args.integer("classes"), {t}, gen, torch::kLong), "random video"};
}

void export_grads(const BenchModel& m, const std::string& path) {
  models::StateDict grads;
  for (const auto& p : m.encoder->named_parameters()) {
    if (p->grad().defined()) grads.emplace_back(p.key(), p->grad().to(torch::kCPU));
  }
  for (const auto& p : m.head->named_parameters()) {
    if (p->grad().defined()) grads.emplace_back("head." + p.key(), p->grad().to(torch::kCPU));
  }
  models::write_state_dict(grads, path);
}


// Plans the step when --chunk is auto, and makes out-of-memory re-plan when there is a budget;
// returns the settings and notes what the planner decided.
struct Planned {
  Settings settings;
  std::vector<std::string> notes;
  engine::Replanner replan;  // empty: the engine halves the chunk
};

Planned plan_step(const Args& args) {
  Planned planned;
  auto request = plan_request(args);
  // What no step can run with (fp16 on a CPU, frames too small for the model) is refused
  // before the probes calibrate.
  plan::refuse_errors(plan::diagnose(request, 0));
  if (request.precisions.size() == 1) {
    check_autocast_dtype(args, request.precisions.front());
    const auto slow = engine::slow_precision_reason(request.precisions.front(), request.model.device);
    if (!slow.empty()) fmt::print(stderr, "warning: {}\n", slow);
  }
  auto& tracker = memory::Tracker::of(request.model.device);
  const bool auto_chunk = !request.chunk.has_value();
  planned.settings.precision = request.precisions.front();
  planned.settings.recompute_norm = request.model.recompute_norm;
  if (!auto_chunk) {
    planned.settings.chunk = *request.chunk;
    planned.settings.keep = args.integer("keep");
    planned.settings.cache_frozen = args.on("cache-frozen");
  }
  const int64_t budget = tracker.available_bytes();
  // Fixed settings need no plan; without a budget or with --no-retry no re-planning either.
  if (!auto_chunk && (tracker.budget_bytes() == 0 || args.on("no-retry"))) return planned;
  // The doctor's static minimum needs no calibration: an impossible budget fails right away.
  auto sizes = plan::static_sizes(request.model);
  sizes.library_bytes = tracker.library_bytes();
  const int64_t minimum = plan::static_minimum_bytes(sizes, request.frames);
  if (minimum > budget) {
    // The doctor's finding says what would lower the minimum; chunking cannot.
    std::string advice;
    for (const auto& finding : plan::diagnose(request, budget)) {
      if (finding.severity == plan::Finding::Severity::Error && advice.empty())
        advice = finding.fix;
    }
    throw memory::OutOfMemoryError(request.model.device, minimum, budget, 0,
                                   "plan: parameters, gradients, optimizer state, frames and "
                                   "features alone need " +
                                       memory::format_bytes(minimum),
                                   false, advice);
  }
  auto calibrated = calibrate_for(args, request);
  const double margin = args.number("margin");
  const auto precision = request.precisions.front();
  if (auto_chunk) {
    const auto chosen = fit_for(args, request, calibrated, budget, margin);
    if (!chosen.fits) {
      throw memory::OutOfMemoryError(request.model.device, chosen.breakdown.peak_bytes, budget, 0,
                                     "plan: does not fit: " + chosen.advice, false,
                                     "raise --budget or lower --frames");
    }
    planned.settings.chunk = chosen.settings.naive() ? 0 : chosen.settings.chunk;
    planned.settings.keep = chosen.settings.keep;
    planned.settings.cache_frozen = chosen.settings.cache_frozen;
    planned.settings.recompute_norm = chosen.settings.recompute_norm;
    planned.notes.push_back(c10::str("planned for ", memory::format_bytes(budget), ": ",
                                     plan::describe(chosen.settings), ", predicted peak ",
                                     memory::format_bytes(chosen.breakdown.peak_bytes)));
    if (!chosen.reason.empty()) planned.notes.push_back(chosen.reason);
  }
  if (!args.on("no-retry")) {
    planned.replan = plan::make_replanner(request, calibrated.sizes, calibrated.costs.at(precision),
                                          precision, budget, margin);
  }
  return planned;
}

}  // namespace

int run_bench_step(const Args& args) {
  const torch::Device device(args.text("device"));
  auto& tracker = memory::Tracker::of(device);
  const auto beyond = plan::budget_beyond_device(args.bytes("budget"), tracker.available_bytes(),
                                                 device, "--budget");
  if (!beyond.empty()) fmt::print(stderr, "warning: {}\n", beyond);
  tracker.set_budget(args.bytes("budget"));
  const auto video = random_video(args);
  const auto planned = plan_step(args);
  BenchModel model = build(args, planned.settings);
  if (planned.replan) model.step->replan = planned.replan;
  std::vector<std::string> retries = planned.notes;
  const bool warmup = !args.on("no-warmup");
  // --versus-naive: naive training of the same model, its steps interleaved with the chunked ones.
  std::optional<BenchModel> naive;
  if (args.on("versus-naive")) {
    TORCH_CHECK(planned.settings.chunk > 0 && args.bytes("budget") == 0,
                "--versus-naive compares a chunked step with naive training: give --chunk > 0 "
                "and no --budget (naive training would not keep to it)");
    Settings naive_settings = planned.settings;
    naive_settings.chunk = 0;
    naive.emplace(build(args, naive_settings));
  }
  if (warmup) {
    const auto first = model.step->step({video});  // oneDNN primitives, allocator cache
    retries.insert(retries.end(), first.replans.begin(), first.replans.end());
    if (naive) naive->step->step({video});
  }
  memory::reset_rss_peak();
  tracker.reset_peak();
  std::vector<engine::StepReport> reports;
  std::vector<double> naive_seconds;  // --versus-naive: pair i is reports[i], naive_seconds[i]
  {
    std::optional<memory::TraceRecorder> trace;
    if (args.has("trace")) trace.emplace(tracker);
    // Written when it goes out of scope, after the measured steps.
    std::optional<torch::autograd::profiler::RecordProfile> profile;
    if (args.has("profile")) {
      TORCH_CHECK(std::ofstream(args.text("profile")).good(), "cannot write the profile ",
                  args.text("profile"));
      profile.emplace(args.text("profile"));
    }
    memory::LeakDetector leaks;
    // --versus-naive: a timed step always follows a step of its own mode, untimed if need be. A
    // naive step right after a chunked one ran up to 40% slower at T = 1,024-2,048
    // (bench/results/step_ratio_inprocess_cold.md), a cost no naive-only run pays.
    bool last_naive = naive && warmup;  // the warm-up ends with the naive step
    const auto chunked_step = [&] {
      if (last_naive) model.step->step({video});
      last_naive = false;
      return model.step->step({video});
    };
    const auto naive_step = [&] {
      if (!last_naive) naive->step->step({video});
      last_naive = true;
      naive_seconds.push_back(naive->step->step({video}).seconds);
    };
    for (int64_t i = 0; i < args.integer("steps"); ++i) {
      if (trace) trace->mark("step " + std::to_string(i + 1));
      const bool naive_first = naive && i % 2 == 1;
      if (naive_first) naive_step();
      reports.push_back(chunked_step());
      if (naive && !naive_first) naive_step();
      if (!args.on("json")) {
        fmt::print("  step {}: {:.2f} s, {}\n", i + 1, reports.back().seconds,
                   memory::memory_line(tracker, reports.back().peak_bytes));
      }
      if (auto warning = leaks.record(tracker.current_bytes(), reports.back().phases)) {
        retries.push_back("warning: " + *warning);
      }
    }
    if (trace) trace->write(args.text("trace"));
  }
  nlohmann::json pairs = nlohmann::json::array();
  std::vector<double> ratios;
  for (size_t i = 0; i < naive_seconds.size(); ++i) {
    pairs.push_back({{"chunked_seconds", reports[i].seconds}, {"naive_seconds", naive_seconds[i]}});
    ratios.push_back(reports[i].seconds / naive_seconds[i]);
  }
  std::sort(reports.begin(), reports.end(),
            [](const auto& a, const auto& b) { return a.seconds < b.seconds; });
  auto report = reports[reports.size() / 2];  // median time
  const int64_t chunk = model.step->options().chunked.chunk;  // after any re-planning
  const int64_t keep = model.step->options().chunked.keep;
  for (const auto& r : reports) retries.insert(retries.end(), r.replans.begin(), r.replans.end());
  for (const auto& r : reports) report.peak_bytes = std::max(report.peak_bytes, r.peak_bytes);
  const auto rss = memory::process_memory();
  if (args.has("export-grads")) export_grads(model, args.text("export-grads"));

  const double fps = static_cast<double>(report.frames) / report.seconds;
  if (args.on("json")) {
    nlohmann::json phases;
    for (const auto& [name, stats] : report.phases) {
      phases[name] = {{"peak_bytes", stats.peak_bytes},
                      {"peak_increase_bytes", stats.peak_increase_bytes},
                      {"calls", stats.calls}};
    }
    nlohmann::json out = {{"model", args.text("model")},
                          {"head", args.text("head")},
                          {"frames", args.integer("frames")},
                          {"size", args.integer("size")},
                          {"chunk", chunk},
                          {"keep", keep},
                          {"recompute_norm", planned.settings.recompute_norm},
                          {"precision", args.text("precision")},
                          {"dtype", args.text("dtype")},
                          {"norm", args.text("norm")},
                          {"freeze", args.has("freeze") ? args.text("freeze") : ""},
                          {"device", device.str()},
                          {"budget_bytes", args.bytes("budget")},
                          {"peak_bytes", report.peak_bytes},
                          {"rss_peak_bytes", rss.rss_peak_bytes},
                          {"step_seconds", report.seconds},
                          {"frames_per_second", fps},
                          {"loss", report.loss},
                          {"phases", phases},
                          {"retries", retries},
                          {"steps", args.integer("steps")},
                          {"warmup", warmup},
                          {"machine", machine_info().describe()}};
    if (naive) {
      out["naive_step_seconds"] = median_of(naive_seconds);
      out["pairs"] = pairs;
      out["ratio_median"] = median_of(ratios);
    }
    fmt::print("{}\n", out.dump());
    return 0;
  }
  for (const auto& r : retries) fmt::print("framefit bench-step: {}\n", r);
  fmt::print("framefit bench-step: {} + {} head, {} frames of {}x{}, chunk {} ({}), {}\n",
             args.text("model"), args.text("head"), args.integer("frames"), args.integer("size"),
             args.integer("size"), chunk, chunk == 0 ? "naive" : "recompute",
             args.text("precision"));
  fmt::print("  step {:.2f} s, {:.1f} frames/s, loss {:.4f}\n", report.seconds, fps, report.loss);
  if (naive) {
    fmt::print("  naive step {:.2f} s; chunked / naive {:.2f}x (median of {} interleaved pairs)\n",
               median_of(naive_seconds), median_of(ratios), ratios.size());
  }
  fmt::print("  peak tensor memory {} (tracked), peak RSS {}\n",
             memory::format_bytes(report.peak_bytes), memory::format_bytes(rss.rss_peak_bytes));
  for (const auto& [name, stats] : report.phases) {
    fmt::print("    {:<10} peak {:>12}  (+{} above entry)\n", name,
               memory::format_bytes(stats.peak_bytes), memory::format_bytes(stats.peak_increase_bytes));
  }
  fmt::print("  {}\n", machine_info().describe());
  return 0;
}

double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

plan::ChunkTrial measure_step(const Args& args, int64_t chunk, bool recompute_norm) {
  const auto request = plan_request(args);
  Settings settings;
  settings.chunk = chunk;
  settings.keep = request.keep.value_or(1);
  settings.cache_frozen = request.cache_frozen.value_or(false);
  settings.precision = request.precisions.front();
  settings.recompute_norm = recompute_norm;
  auto& tracker = memory::Tracker::of(request.model.device);
  plan::ChunkTrial trial;
  try {
    const auto video = random_video(args);
    BenchModel model = build(args, settings);
    model.step->step({video});  // warm-up: optimizer state, kernels' one-time buffers
    auto window = tracker.mark();
    const auto report = model.step->step({video});
    window.close();
    trial.peak_bytes = window.peak_bytes();
    trial.seconds = report.seconds;
    trial.out_of_memory = !report.replans.empty();  // it only fitted after re-planning
  } catch (const c10::Error& e) {
    if (!memory::is_out_of_memory(e)) throw;
    trial.out_of_memory = true;
  }
  tracker.release_cache();
  return trial;
}

int run_bench_memory(const Args& args) {
  const auto request = plan_request(args);
  auto& tracker = memory::Tracker::of(request.model.device);
  tracker.set_budget(args.bytes("budget"));
  plan::refuse_errors(plan::diagnose(request, 0));
  const auto calibrated = calibrate_for(args, request);
  const auto precision = request.precisions.front();
  std::vector<int64_t> chunks;
  {
    std::stringstream list(args.text("chunks"));
    std::string item;
    while (std::getline(list, item, ',')) {
      size_t used = 0;
      int64_t value = -1;
      try {
        value = std::stoll(item, &used);
      } catch (const std::exception&) {
      }
      TORCH_CHECK(used == item.size() && value >= 0, "--chunks: '", item,
                  "' is not a chunk size (an integer >= 0; 0 = naive)");
      chunks.push_back(value);
    }
  }
  nlohmann::json rows = nlohmann::json::array();
  const auto video = random_video(args);
  if (!args.on("json")) {
    fmt::print("framefit bench-memory: {} + {} head, {} frames of {}x{}, {}, keep {}\n",
               args.text("model"), args.text("head"), args.integer("frames"),
               args.integer("size"), args.integer("size"), engine::to_string(precision),
               args.integer("keep"));
    fmt::print("  {:>6} {:>12} {:>12} {:>7} {:>12} {:>9} {:>9}\n", "chunk", "predicted",
               "measured", "error", "peak RSS", "pred. s", "step s");
  }
  for (const int64_t chunk : chunks) {
    Settings settings{chunk, args.integer("keep"), args.on("cache-frozen"), precision,
                      request.model.recompute_norm};
    plan::StepSettings step_settings;
    step_settings.frames = request.frames;
    step_settings.chunk = chunk;
    step_settings.keep = settings.keep;
    step_settings.cache_frozen = settings.cache_frozen;
    step_settings.precision = precision;
    const auto predicted = plan::predict(calibrated.sizes, calibrated.costs.at(precision), step_settings);
    int64_t peak = 0;
    std::vector<double> seconds;
    std::string error;
    memory::ProcessMemory rss;
    try {
      BenchModel model = build(args, settings);
      model.step->step({video});  // warm-up
      memory::reset_rss_peak();
      tracker.reset_peak();
      memory::LeakDetector leaks;
      for (int64_t i = 0; i < args.integer("steps"); ++i) {
        const auto report = model.step->step({video});
        peak = std::max(peak, report.peak_bytes);
        seconds.push_back(report.seconds);
        if (!report.replans.empty()) error = report.replans.front();
      }
      rss = memory::process_memory();
    } catch (const c10::Error& e) {
      if (!memory::is_out_of_memory(e)) throw;
      error = e.what_without_backtrace();
    }
    tracker.release_cache();
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds.empty() ? 0 : seconds[seconds.size() / 2];
    const double relative =
        peak > 0 ? static_cast<double>(predicted.peak_bytes - peak) / static_cast<double>(peak) : 0;
    rows.push_back({{"chunk", chunk}, {"predicted_peak_bytes", predicted.peak_bytes},
                    {"peak_bytes", peak}, {"relative_error", relative},
                    {"rss_peak_bytes", rss.rss_peak_bytes},
                    {"predicted_seconds", predicted.seconds}, {"step_seconds", median},
                    {"predicted_phase", predicted.peak_phase}, {"error", error}});
    if (!args.on("json")) {
      fmt::print("  {:>6} {:>12} {:>12} {:>6.1f}% {:>12} {:>9.2f} {:>9.2f}{}\n",
                 chunk == 0 ? std::string("naive") : std::to_string(chunk),
                 memory::format_bytes(predicted.peak_bytes), memory::format_bytes(peak),
                 100 * relative, memory::format_bytes(rss.rss_peak_bytes), predicted.seconds,
                 median, error.empty() ? "" : "  (" + error + ")");
    }
  }
  if (args.on("json")) {
    fmt::print("{}\n", nlohmann::json{{"model", args.text("model")}, {"head", args.text("head")},
                                      {"frames", args.integer("frames")}, {"size", args.integer("size")},
                                      {"precision", engine::to_string(precision)},
                                      {"freeze", args.has("freeze") ? args.text("freeze") : ""},
                                      {"norm", args.text("norm")}, {"keep", args.integer("keep")},
                                      {"rows", rows}, {"machine", machine_info().describe()}}
                            .dump());
  } else {
    fmt::print("  {}\n", machine_info().describe());
  }
  return 0;
}

}  // namespace framefit::cli
