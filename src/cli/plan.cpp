// framefit plan and framefit doctor: the memory model, planner and checks from the command line.
#include <fmt/core.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.h"
#include "framefit/core/runtime.h"
#include "framefit/memory/tracker.h"
#include "framefit/plan/calibration.h"
#include "framefit/plan/doctor.h"
#include "framefit/plan/records.h"
#include "framefit/train/budget.h"
#include "framefit/train/config.h"
#include "framefit/train/schedule.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"
#include "framefit/train/trainer.h"

namespace framefit::cli {

plan::ModelSpec model_spec(const Args& args) {
  plan::ModelSpec spec;
  spec.model = args.text("model");
  spec.head = args.text("head");
  spec.classes = args.integer("classes");
  spec.norm = args.text("norm");
  spec.groups = args.integer("groups");
  spec.freeze = args.has("freeze") ? args.text("freeze") : "";
  spec.drop_layer4 = args.on("drop-layer4");
  spec.size = args.integer("size");
  spec.dtype = args.text("dtype") == "float64" ? torch::kFloat64 : torch::kFloat32;
  spec.optimizer = args.text("optimizer");
  spec.device = torch::Device(args.text("device"));
  const auto layout =
      models::resolve_layout(models::parse_activation_layout(args.text("layout")),
                             models::parse_norm_kind(spec.norm), spec.device.type());
  spec.channels_last = layout.channels_last;
  spec.nchw_from = layout.nchw_from;
  spec.recompute_norm = args.text("recompute-norm") == "on";
  return spec;
}

plan::PlanRequest plan_request(const Args& args) {
  plan::PlanRequest request;
  request.model = model_spec(args);
  request.frames = args.integer("frames");
  request.videos = args.has("videos") ? args.integer("videos") : 1;
  auto fixed = [&](const std::string& flag) -> std::optional<int64_t> {
    if (!args.has(flag) || args.text(flag) == "auto") return std::nullopt;
    return args.integer(flag);
  };
  request.chunk = fixed("chunk");
  request.keep = fixed("keep");
  request.accumulate = args.has("accumulate") ? fixed("accumulate") : std::optional<int64_t>(1);
  const std::string cache = args.has("cache-frozen") ? args.text("cache-frozen") : "off";
  if (cache == "true" || cache == "on") request.cache_frozen = true;
  if (cache == "off") request.cache_frozen = false;
  const std::string precision = args.text("precision");
  if (precision == "auto") {
    request.precisions = plan::candidate_precisions(request.model.device);
  } else {
    request.precisions = {engine::parse_precision(precision)};
  }
  return request;
}

namespace {

plan::CalibrationCache calibration_cache(const Args& args) {
  return plan::CalibrationCache(args.has("calibration") ? args.text("calibration")
                                                        : plan::CalibrationCache::default_path());
}

std::function<void(const std::string&)> announce(const Args& args) {
  return [command = args.command()](const std::string& message) {
    fmt::print(stderr, "framefit {}: {}\n", command, message);
  };
}

}  // namespace

Calibrated calibrate_for(const Args& args, const plan::PlanRequest& request) {
  auto& tracker = memory::Tracker::of(request.model.device);
  Calibrated result;
  result.sizes = plan::static_sizes(request.model);
  result.sizes.library_bytes = tracker.library_bytes();
  auto cache = calibration_cache(args);
  result.costs = plan::calibrated_costs(request.model, request.precisions,
                                        plan::Calibrator{cache, tracker, announce(args)});
  return result;
}

plan::Plan fit_for(const Args& args, plan::PlanRequest& request, Calibrated& calibrated,
                   int64_t budget_bytes, double margin) {
  auto cache = calibration_cache(args);
  const plan::Calibrator calibrator{cache, memory::Tracker::of(request.model.device),
                                    announce(args)};
  return plan::plan_chunked_step(request, calibrated.sizes, calibrated.costs, calibrator,
                                 budget_bytes, margin, args.text("recompute-norm") == "auto");
}

namespace {

// One precedence for plan and doctor: --budget over the config's --set over the config file.
train::Config config_with_flags(const Args& args) {
  auto overrides = args.list("set");
  if (args.bytes("budget") > 0) overrides.push_back("train.budget=" + args.text("budget"));
  return train::load_config(args.text("config"), overrides);
}

// Without a config: --budget, else what the device has available.
int64_t flag_budget(const Args& args, const memory::Tracker& tracker) {
  return args.bytes("budget") > 0 ? args.bytes("budget") : tracker.available_bytes();
}

int print_table(const Args& args, const plan::PlanRequest& request, const Calibrated& c,
                int64_t budget, double margin) {
  const auto rows = plan::plan_table(request, c.sizes, c.costs, budget, margin);
  if (args.on("json")) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows) {
      auto row = nlohmann::json(r.settings);
      row["predicted_peak_bytes"] = r.breakdown.peak_bytes;
      row["predicted_seconds"] = r.breakdown.seconds;
      row["fits"] = r.fits;
      out.push_back(row);
    }
    fmt::print("{}\n", nlohmann::json{{"rows", out}, {"budget_bytes", budget}}.dump());
    return 0;
  }
  fmt::print("framefit plan: {} + {} head, {} frames of {}x{}, budget {} ({}% margin)\n",
             request.model.model, request.model.head, request.frames, request.model.size,
             request.model.size, memory::format_bytes(budget), std::lround(margin * 100));
  fmt::print("  {:>9} {:>6} {:>5} {:>12} {:>10} {:>6}\n", "precision", "chunk", "keep", "peak",
             "step s", "fits");
  for (const auto& r : rows) {
    fmt::print("  {:>9} {:>6} {:>5} {:>12} {:>10.2f} {:>6}\n",
               engine::to_string(r.settings.precision),
               r.settings.naive() ? std::string("naive") : std::to_string(r.settings.chunk),
               r.settings.keep, memory::format_bytes(r.breakdown.peak_bytes), r.breakdown.seconds,
               r.fits ? "yes" : "no");
  }
  return 0;
}

int print_findings(const Args& args, const std::vector<plan::Finding>& findings) {
  if (args.on("json")) {
    const auto out = nlohmann::json(findings);
    fmt::print("{}\n",
               nlohmann::json{{"ok", !plan::has_errors(findings)}, {"findings", out}}.dump());
  } else {
    for (const auto& f : findings) {
      fmt::print("{}: {}\n  fix: {}\n",
                 f.severity == plan::Finding::Severity::Error ? "error" : "warning", f.problem,
                 f.fix);
    }
    if (findings.empty()) fmt::print("framefit doctor: no problems found\n");
  }
  return plan::has_errors(findings) ? 1 : 0;
}

}  // namespace

// The doctor on a config's layer-list network: each layer's shape and parameters, the memory
// per batch, then the findings. Nothing is allocated. `budget`: what a step may use, which for a
// clips or segmentation config is `full_budget` less the data pipeline's prefetch reserve (on
// CUDA: less the allocator's margin). `data_findings`: diagnose_batch_data's, for such a config.
int doctor_network(const Args& args, const train::Config& config, int64_t full_budget,
                   int64_t budget, const std::vector<plan::Finding>& data_findings) {
  plan::NetworkTraining training;
  training.batch = args.integer("batch");
  training.dtype = args.text("dtype") == "float64" ? torch::kFloat64 : torch::kFloat32;
  training.optimizer = config.train.optimizer;
  const auto& layers = config.model.layers;
  const auto& input = config.model.input;
  auto findings = plan::diagnose_network(layers, input, training, budget);
  const auto settings = train::diagnose_task_settings(config);
  findings.insert(findings.begin(), settings.begin(), settings.end());
  findings.insert(findings.end(), data_findings.begin(), data_findings.end());
  // Shapes for the table; a list that cannot even be read is already one of the findings.
  std::optional<models::NetworkShapes> shapes;
  try {
    shapes = models::infer_shapes(layers, input);
  } catch (const c10::Error&) {
  }
  const auto m = shapes ? plan::network_memory(*shapes, input, training) : plan::NetworkMemory{};
  if (args.on("json")) {
    nlohmann::json out = {{"ok", !plan::has_errors(findings)},
                          {"budget_bytes", full_budget},
                          {"step_budget_bytes", budget}};
    out["findings"] = nlohmann::json(findings);
    nlohmann::json rows = nlohmann::json::array();
    if (shapes) {
      for (const auto& l : shapes->layers) {
        rows.push_back({{"name", l.name},
                        {"type", l.type},
                        {"output", l.output},
                        {"parameters", l.parameters}});
      }
      for (const auto& p : shapes->problems) {
        if (p.expected_inputs > 0) {
          out["mismatches"].push_back({{"layer", p.layer},
                                       {"expected_inputs", p.expected_inputs},
                                       {"actual_inputs", p.actual_inputs}});
        }
      }
      out["parameters"] = shapes->parameters();
      out["static_bytes"] = m.static_bytes();
      out["bytes_per_sample"] = m.bytes_per_sample();
      if (shapes->ok()) {
        out["predicted_peak_bytes"] = m.peak_bytes(training.batch);
        out["largest_batch"] = m.largest_batch(budget);
      }
    }
    out["layers"] = rows;
    fmt::print("{}\n", out.dump());
    return plan::has_errors(findings) ? 1 : 0;
  }
  if (shapes) {
    fmt::print("framefit doctor: {} layers on input {} (per sample)\n", layers.size(),
               models::format_shape(input));
    fmt::print("  {:<18} {:<15} {:>22} {:>16}\n", "layer", "type", "output", "parameters");
    for (const auto& l : shapes->layers) {
      fmt::print("  {:<18} {:<15} {:>22} {:>16}\n", l.name, l.type, models::format_shape(l.output),
                 models::format_count(l.parameters));
    }
    fmt::print("  parameters {} ({}), static memory with gradients and {} state {}\n",
               models::format_count(shapes->parameters()), memory::format_bytes(m.parameter_bytes),
               training.optimizer, memory::format_bytes(m.static_bytes()));
    if (shapes->ok()) {
      fmt::print(
          "  per sample: input {}, activations {}, backward {}; batch {}: {} predicted; "
          "{}: largest batch {}\n",
          memory::format_bytes(m.input_bytes_per_sample),
          memory::format_bytes(m.activation_bytes_per_sample),
          memory::format_bytes(m.backward_bytes_per_sample), training.batch,
          memory::format_bytes(m.peak_bytes(training.batch)),
          budget == full_budget
              ? "budget " + memory::format_bytes(budget)
              : fmt::format("step budget {} (budget {} less {})", memory::format_bytes(budget),
                            memory::format_bytes(full_budget),
                            torch::Device(config.device).is_cuda() ? "the CUDA allocator's margin"
                                                                   : "the prefetch reserve"),
          m.largest_batch(budget));
    }
  }
  return print_findings(args, findings);
}

int run_doctor(const Args& args) {
  auto& tracker = memory::Tracker::of(torch::Device(args.text("device")));
  if (args.has("config")) {
    const auto config = config_with_flags(args);
    // What tensors may use of it (on the CPU, a process budget less the runtime's share).
    const auto resolved =
        train::resolve_budget(config, memory::Tracker::of(torch::Device(config.device)));
    const int64_t budget = resolved.tensors;
    // A model the task builds; a layer list is checked as a network, below.
    const bool layer_list = train::is_batch_task(config) ? train::network_kind(config) == "layers"
                                                         : !config.model.layers.empty();
    if (!layer_list) {
      const auto diagnosis = train::task_for(config).diagnose(config, resolved);
      for (const auto& line : diagnosis.summary) {
        if (!args.on("json")) fmt::print("framefit doctor: {}\n", line);
      }
      return print_findings(args, diagnosis.findings);
    }
    // A clips or segmentation config's data, whatever its network.
    std::vector<plan::Finding> data_findings;
    if (train::is_batch_task(config)) {
      std::string summary;
      data_findings = train::diagnose_batch_data(config, &summary);
      if (!args.on("json")) fmt::print("framefit doctor: {}\n", summary);
    }
    // A clips or segmentation config's input follows from its data settings where they fix it.
    auto checked = config;
    if (checked.model.input.empty()) checked.model.input = train::configured_sample_shape(config);
    TORCH_CHECK(!checked.model.layers.empty() && !checked.model.input.empty(), "config ",
                args.text("config"),
                ": `framefit doctor --config` checks a layer-list network; set model.layers and "
                "model.input (per sample, e.g. [3, 60, 230, 230]), or for task clips data.crop "
                "(segmentation: data.resize), from which the input follows");
    // A clips or segmentation run steps within train.budget less the prefetch reserve (and the
    // largest decoded unit, which the doctor does not know: it reads no data).
    const int64_t step_budget = train::is_batch_task(config) ? resolved.step : budget;
    return doctor_network(args, checked, budget, step_budget, data_findings);
  }
  return print_findings(args, plan::diagnose(plan_request(args), flag_budget(args, tracker)));
}

// framefit plan --config: what a run of the config will use, as its task plans it.
int plan_config(const Args& args) {
  const auto config = config_with_flags(args);
  auto& tracker = memory::Tracker::of(torch::Device(config.device));
  auto plan = train::task_for(config).plan(config, tracker, [&](const train::Event& e) {
    if (e.kind == train::Event::Kind::Warning) fmt::print(stderr, "warning: {}\n", e.message);
    if (e.kind == train::Event::Kind::Info && !args.on("json"))
      fmt::print(stderr, "framefit plan: {}\n", e.message);
  });
  if (args.on("json")) {
    plan.record["machine"] = machine_info().describe();
    fmt::print("{}\n", plan.record.dump(2));
  } else {
    for (const auto& line : plan.lines) fmt::print("{}\n", line);
    if (args.on("table")) {
      for (const auto& line : plan.table) fmt::print("{}\n", line);
    }
    fmt::print("  {}\n", machine_info().describe());
  }
  return plan.fits ? 0 : 2;
}

int run_plan(const Args& args) {
  if (args.has("config")) return plan_config(args);
  auto request = plan_request(args);
  const auto device = request.model.device;
  auto& tracker = memory::Tracker::of(device);
  const int64_t budget = flag_budget(args, tracker);
  const auto beyond = plan::budget_beyond_device(args.bytes("budget"), tracker.available_bytes(),
                                                 device, "--budget");
  if (!beyond.empty()) fmt::print(stderr, "warning: {}\n", beyond);
  const double margin = args.number("margin");
  // Problems the planner cannot plan around come first, before any probe allocates.
  auto findings = plan::diagnose(request, budget);
  if (plan::has_errors(findings)) {
    if (!args.on("json")) return print_findings(args, findings);
    // The keys of a plan's answer, so that a script reads either: it does not fit, and why.
    fmt::print("{}\n", nlohmann::json{{"fits", false},
                                      {"ok", false},
                                      {"budget_bytes", budget},
                                      {"findings", nlohmann::json(findings)},
                                      {"machine", machine_info().describe()}}
                           .dump());
    return 1;
  }
  auto calibrated = calibrate_for(args, request);
  if (args.on("table")) return print_table(args, request, calibrated, budget, margin);

  const auto chosen = fit_for(args, request, calibrated, budget, margin);
  std::optional<plan::LargestChunk> largest;
  if (args.on("find")) {
    tracker.set_budget(budget);
    largest = plan::find_largest_chunk(
        request, calibrated.sizes, calibrated.costs.at(chosen.settings.precision),
        chosen.settings.precision, budget, args.number("headroom"),
        [&](int64_t chunk) { return measure_step(args, chunk, chosen.settings.recompute_norm); });
  }
  if (args.on("json")) {
    nlohmann::json out = {{"fits", chosen.fits},
                          {"predicted_peak_bytes", chosen.breakdown.peak_bytes},
                          {"predicted_step_seconds", chosen.step_seconds},
                          {"chunk", chosen.settings.naive() ? 0 : chosen.settings.chunk},
                          {"keep", chosen.settings.keep},
                          {"cache_frozen", chosen.settings.cache_frozen},
                          {"precision", engine::to_string(chosen.settings.precision)},
                          {"recompute_norm", chosen.settings.recompute_norm},
                          {"reason", chosen.reason},
                          {"accumulate", chosen.accumulate},
                          {"videos_per_call", chosen.settings.videos_per_call},
                          {"budget_bytes", budget},
                          {"margin_bytes", chosen.margin_bytes},
                          {"breakdown", nlohmann::json(chosen.breakdown)},
                          {"candidates", chosen.candidates},
                          {"machine", machine_info().describe()}};
    if (!chosen.fits) {
      out["minimum_budget_bytes"] = chosen.minimum_budget_bytes;
      out["advice"] = chosen.advice;
    }
    nlohmann::json warnings = nlohmann::json::array();
    for (const auto& f : findings) warnings.push_back(f.problem);
    out["warnings"] = warnings;
    out["ok"] = true;  // no finding is an error (those answer above)
    out["findings"] = nlohmann::json(findings);
    if (largest) {
      out["largest_chunk"] = {{"found", largest->found},
                              {"chunk", largest->chunk},
                              {"trials", largest->trials},
                              {"predicted_peak_bytes", largest->predicted_peak_bytes},
                              {"measured_peak_bytes", largest->measured_peak_bytes},
                              {"log", largest->log}};
    }
    fmt::print("{}\n", out.dump());
    return chosen.fits ? 0 : 2;
  }
  for (const auto& f : findings) fmt::print("warning: {}\n  fix: {}\n", f.problem, f.fix);
  fmt::print("framefit plan: {} + {} head, {} frames of {}x{}, {} video(s) per step, budget {}\n",
             request.model.model, request.model.head, request.frames, request.model.size,
             request.model.size, request.videos, memory::format_bytes(budget));
  if (chosen.fits) {
    fmt::print("  plan: {}\n", plan::describe(chosen.settings, chosen.accumulate));
    if (!chosen.reason.empty()) fmt::print("  {}\n", chosen.reason);
  } else {
    fmt::print("  does not fit: {}\n  smallest: {}\n", chosen.advice,
               plan::describe(chosen.settings, chosen.accumulate));
  }
  for (const auto& line : plan::breakdown_lines(chosen.breakdown, chosen.margin_bytes))
    fmt::print("{}\n", line);
  fmt::print("  predicted step time {:.2f} s ({} candidates evaluated)\n", chosen.step_seconds,
             chosen.candidates);
  if (largest) {
    for (const auto& l : largest->log) fmt::print("  {}\n", l);
    if (largest->found) {
      fmt::print("  largest chunk: {} (confirmed by {} real step(s))\n", largest->chunk,
                 largest->trials);
    } else {
      fmt::print("  no chunk confirmed within the budget after {} step(s)\n", largest->trials);
    }
  }
  fmt::print("  {}\n", machine_info().describe());
  return chosen.fits ? 0 : 2;
}

}  // namespace framefit::cli
