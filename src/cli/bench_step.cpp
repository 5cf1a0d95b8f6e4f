// framefit bench-step: one warm-up and one measured training step on random data.
#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <optional>

#include "commands.h"
#include "framefit/core/runtime.h"
#include "framefit/engine/step.h"
#include "framefit/memory/monitor.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"

namespace framefit::cli {

namespace {

struct BenchModel {
  models::ResNet encoder{nullptr};
  std::shared_ptr<models::TemporalHead> head;
  std::unique_ptr<engine::TrainingStep> step;
};

BenchModel build(const Args& args, int64_t chunk) {
  const torch::Device device(args.text("device"));
  const auto dtype = args.text("dtype") == "float64" ? torch::kFloat64 : torch::kFloat32;
  torch::manual_seed(static_cast<uint64_t>(args.integer("seed")));
  BenchModel m;
  auto options = models::ResNetOptions(models::parse_resnet_name(args.text("model")))
                     .num_classes(0)
                     .norm(models::parse_norm_kind(args.text("norm")))
                     .groups(args.integer("groups"))
                     .drop_layer4(args.on("drop-layer4"))
                     .channels_last(args.on("channels-last"));
  if (args.has("freeze")) options.freeze(args.text("freeze"));
  m.encoder = models::ResNet(options);
  m.head = models::make_head(args.text("head"), m.encoder->feature_dim(), args.integer("classes"));
  m.encoder->to(device, dtype);
  m.head->to(device, dtype);
  m.encoder->train();
  m.head->train();

  engine::StepOptions step;
  step.chunked.chunk = chunk;
  step.chunked.keep = args.integer("keep");
  step.chunked.cache_frozen = args.on("cache-frozen");
  step.chunked.device = device;
  step.chunked.dtype = dtype;
  step.chunked.channels_last = args.on("channels-last");
  step.precision = engine::parse_precision(args.text("precision"));
  auto encoder = engine::frame_encoder(m.encoder.ptr());
  auto parameters = encoder.parameters;
  for (const auto& p : m.head->parameters()) parameters.push_back(p);
  engine::OptimizerOptions optimizer;
  optimizer.kind = args.text("optimizer");
  m.step = std::make_unique<engine::TrainingStep>(encoder, m.head,
                                                  engine::make_optimizer(parameters, optimizer), step);
  return m;
}

engine::Video random_video(const Args& args) {
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

}  // namespace

int run_bench_step(const Args& args) {
  const torch::Device device(args.text("device"));
  auto& tracker = memory::Tracker::of(device);
  tracker.set_budget(args.bytes("budget"));
  const auto video = random_video(args);

  // --chunk auto starts at 64 frames; on out-of-memory the training step halves the chunk and
  // retries the same step. (The memory planner of issue #4 will choose from a model instead.)
  const int64_t requested = args.text("chunk") == "auto" ? 64 : args.integer("chunk");
  BenchModel model = build(args, requested);
  std::vector<std::string> retries;
  const bool warmup = !args.on("no-warmup");
  if (warmup) {
    const auto first = model.step->step({video});  // oneDNN primitives, allocator cache
    retries = first.replans;
  }
  memory::reset_rss_peak();
  tracker.reset_peak();
  std::vector<engine::StepReport> reports;
  {
    std::optional<memory::TraceRecorder> trace;
    if (args.has("trace")) trace.emplace(tracker);
    for (int64_t i = 0; i < args.integer("steps"); ++i) {
      if (trace) trace->mark("step " + std::to_string(i + 1));
      reports.push_back(model.step->step({video}));
    }
    if (trace) trace->write(args.text("trace"));
  }
  std::sort(reports.begin(), reports.end(),
            [](const auto& a, const auto& b) { return a.seconds < b.seconds; });
  auto report = reports[reports.size() / 2];  // median time
  const int64_t chunk = model.step->options().chunked.chunk;  // after any re-planning
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
    nlohmann::json out = {
        {"model", args.text("model")}, {"head", args.text("head")},
        {"frames", args.integer("frames")}, {"size", args.integer("size")},
        {"chunk", chunk}, {"keep", args.integer("keep")},
        {"precision", args.text("precision")}, {"dtype", args.text("dtype")},
        {"norm", args.text("norm")}, {"freeze", args.has("freeze") ? args.text("freeze") : ""},
        {"device", device.str()}, {"budget_bytes", args.bytes("budget")},
        {"peak_bytes", report.peak_bytes}, {"rss_peak_bytes", rss.rss_peak_bytes},
        {"step_seconds", report.seconds}, {"frames_per_second", fps},
        {"loss", report.loss}, {"phases", phases}, {"retries", retries},
        {"steps", args.integer("steps")}, {"warmup", warmup},
        {"machine", machine_info().describe()}};
    fmt::print("{}\n", out.dump());
    return 0;
  }
  for (const auto& r : retries) fmt::print("framefit bench-step: {}\n", r);
  fmt::print("framefit bench-step: {} + {} head, {} frames of {}x{}, chunk {} ({}), {}\n",
             args.text("model"), args.text("head"), args.integer("frames"), args.integer("size"),
             args.integer("size"), chunk, chunk == 0 ? "naive" : "recompute",
             args.text("precision"));
  fmt::print("  step {:.2f} s, {:.1f} frames/s, loss {:.4f}\n", report.seconds, fps, report.loss);
  fmt::print("  peak tensor memory {} (tracked), peak RSS {}\n",
             memory::format_bytes(report.peak_bytes), memory::format_bytes(rss.rss_peak_bytes));
  for (const auto& [name, stats] : report.phases) {
    fmt::print("    {:<10} peak {:>12}  (+{} above entry)\n", name,
               memory::format_bytes(stats.peak_bytes), memory::format_bytes(stats.peak_increase_bytes));
  }
  fmt::print("  {}\n", machine_info().describe());
  return 0;
}

}  // namespace framefit::cli
