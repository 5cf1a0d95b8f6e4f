#include "framefit/plan/calibration.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "framefit/engine/amp.h"
#include "framefit/engine/checkpoint.h"
#include "framefit/engine/chunked.h"
#include "framefit/engine/loss.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/heads.h"
#include "framefit/models/resnet.h"

namespace framefit::plan {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void synchronize(torch::Device device) {
#ifdef FRAMEFIT_WITH_CUDA
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
#endif
}

// One probe's measurements for a chunk of n frames.
struct ChunkProbe {
  double nograd_peak = 0, grad_peak = 0, saved = 0, backward_peak = 0, accumulate_peak = 0,
         frozen_output = 0;
  double nograd_seconds = 1e30, grad_seconds = 1e30, backward_seconds = 1e30, frozen_seconds = 1e30;
};

ChunkProbe probe_chunk(const ModelSpec& spec, engine::Precision precision,
                       const engine::FrameEncoder& encoder, int64_t n, memory::Tracker& tracker,
                       const CalibrationOptions& options) {
  const auto frames = torch::randint(0, 256, {n, 3, spec.size, spec.size}, torch::kUInt8);
  auto input = [&] {
    return engine::frames_to_input(frames, spec.device, spec.dtype, spec.channels_last);
  };
  auto frozen = [&](const torch::Tensor& x) {
    torch::NoGradGuard no_grad;
    return encoder.frozen ? encoder.frozen(x) : x;
  };
  ChunkProbe probe;
  engine::AutocastGuard autocast(spec.device, precision);
  for (int64_t r = 0; r < options.repeats; ++r) {
    // Each section starts with an empty cast cache, as each pass of the engine does; the cached
    // low-precision weight copies are part of what a pass holds.
    at::autocast::clear_cache();
    {
      torch::NoGradGuard no_grad;
      auto window = tracker.mark();
      const auto start = std::chrono::steady_clock::now();
      auto out = encoder.trainable(frozen(input()));
      synchronize(spec.device);
      probe.nograd_seconds = std::min(probe.nograd_seconds, seconds_since(start));
      probe.nograd_peak = static_cast<double>(window.peak_bytes() - window.entry_bytes());
    }
    if (encoder.frozen) {
      const auto start = std::chrono::steady_clock::now();
      auto h = frozen(input());
      synchronize(spec.device);
      probe.frozen_seconds = std::min(probe.frozen_seconds, seconds_since(start));
      probe.frozen_output = static_cast<double>(h.nbytes());
    } else {
      probe.frozen_seconds = 0;
    }
    at::autocast::clear_cache();
    if (encoder.parameters.empty()) {
      // Frozen through its last stage: the engine only ever runs it without grad.
      probe.grad_seconds = probe.nograd_seconds;
      probe.grad_peak = probe.nograd_peak;
      probe.saved = 0;
      probe.backward_seconds = probe.backward_peak = probe.accumulate_peak = 0;
      continue;
    }
    {
      auto window = tracker.mark();
      auto start = std::chrono::steady_clock::now();
      torch::Tensor out;
      {
        torch::AutoGradMode grad(true);
        out = encoder.trainable(frozen(input()));
      }
      synchronize(spec.device);
      probe.grad_seconds = std::min(probe.grad_seconds, seconds_since(start));
      probe.grad_peak = static_cast<double>(window.peak_bytes() - window.entry_bytes());
      probe.saved = static_cast<double>(tracker.current_bytes() - window.entry_bytes());
      auto grad_out = torch::randn_like(out);
      auto backward = tracker.mark();
      start = std::chrono::steady_clock::now();
      // As the engine's recompute does: gradients returned, not accumulated into .grad.
      auto grads = torch::autograd::grad({out}, encoder.parameters, {grad_out},
                                         /*retain_graph=*/false, /*create_graph=*/false,
                                         /*allow_unused=*/true);
      synchronize(spec.device);
      probe.backward_seconds = std::min(probe.backward_seconds, seconds_since(start));
      probe.backward_peak = static_cast<double>(backward.peak_bytes() - window.entry_bytes());
    }
    at::autocast::clear_cache();
    {
      // As naive training does: backward() adding into the existing .grad, which frees each
      // gradient once added instead of returning them all.
      auto window = tracker.mark();
      torch::Tensor out;
      {
        torch::AutoGradMode grad(true);
        out = encoder.trainable(frozen(input()));
      }
      auto grad_out = torch::randn_like(out);
      auto backward = tracker.mark();
      out.backward(grad_out);
      probe.accumulate_peak = static_cast<double>(backward.peak_bytes() - window.entry_bytes());
    }
    at::autocast::clear_cache();
  }
  return probe;
}

struct HeadProbe {
  double peak = 0, seconds = 1e30;
};

HeadProbe probe_head(const ModelSpec& spec, models::TemporalHead& head, int64_t feature_dim,
                     int64_t n, memory::Tracker& tracker, const CalibrationOptions& options) {
  const auto dtype = spec.dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto labels = torch::randint(0, spec.classes, {n}, torch::kLong).to(spec.device);
  HeadProbe probe;
  for (int64_t r = 0; r < options.repeats; ++r) {
    // A fresh leaf each time: its gradient is allocated like the engine's features gradient.
    auto features =
        torch::randn({n, feature_dim}, torch::TensorOptions().dtype(dtype).device(spec.device))
            .requires_grad_(true);
    auto window = tracker.mark();
    const auto start = std::chrono::steady_clock::now();
    engine::phase_loss(head.forward(features), labels, {}).backward();
    synchronize(spec.device);
    probe.seconds = std::min(probe.seconds, seconds_since(start));
    probe.peak = static_cast<double>(window.peak_bytes() - window.entry_bytes());
  }
  return probe;
}

}  // namespace

ChunkCosts calibrate(const ModelSpec& spec, engine::Precision precision, memory::Tracker& tracker,
                     const CalibrationOptions& options) {
  torch::manual_seed(options.seed);
  auto encoder = models::ResNet(spec.encoder_options());
  encoder->to(spec.device, spec.dtype);
  encoder->train();
  return calibrate(spec, engine::frame_encoder(encoder.ptr()), encoder->feature_dim(), precision,
                   tracker, options);
}

ChunkCosts calibrate(const ModelSpec& spec, const engine::FrameEncoder& encoder,
                     int64_t feature_dim, engine::Precision precision, memory::Tracker& tracker,
                     const CalibrationOptions& options) {
  TORCH_CHECK(tracker.device().type() == spec.device.type(), "calibrating on ", spec.device,
              " needs that device's tracker, not ", tracker.device(), "'s");
  TORCH_CHECK(
      options.chunk_frames.size() == 2 && options.chunk_frames[0] != options.chunk_frames[1] &&
          options.head_frames.size() == 2 && options.head_frames[0] != options.head_frames[1],
      "calibration needs two different chunk sizes and two different head lengths");
  torch::manual_seed(options.seed);
  auto head = models::make_head(spec.head, feature_dim, spec.classes, spec.head_settings);
  head->to(spec.device, spec.dtype);
  head->train();

  // The steady state of training: parameter gradients exist (as after the first step).
  for (auto& p : encoder.parameters) p.mutable_grad() = torch::zeros_like(p);
  // An encoder frozen through its last stage only runs without grad, whose peak at a few frames
  // is a fixed workspace rather than the frames' activations: probed at 4 and 16 times the larger
  // chunk, where the activations set it (a no-grad pass is cheap).
  auto chunk_frames = options.chunk_frames;
  if (encoder.parameters.empty()) {
    const int64_t larger = std::max(chunk_frames[0], chunk_frames[1]);
    chunk_frames = {4 * larger, 16 * larger};
  }
  std::array<ChunkProbe, 2> chunk;
  std::array<HeadProbe, 2> head_probe;
  int probe = 0;
  const auto timed = [&](const std::string& what, const auto& run) {
    const auto start = std::chrono::steady_clock::now();
    run();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (options.on_progress) {
      options.on_progress(c10::str("probe ", ++probe, " of 4: ", what, ", ",
                                   std::round(took.count() * 10) / 10, " s"));
    }
  };
  for (size_t i = 0; i < 2; ++i) {
    timed(c10::str("the encoder on ", chunk_frames[i], " frames"), [&] {
      chunk[i] = probe_chunk(spec, precision, encoder, chunk_frames[i], tracker, options);
    });
    timed(c10::str("the head on ", options.head_frames[i], " frames"), [&] {
      head_probe[i] =
          probe_head(spec, *head, feature_dim, options.head_frames[i], tracker, options);
    });
  }
  const double n1 = static_cast<double>(chunk_frames[0]);
  const double n2 = static_cast<double>(chunk_frames[1]);
  auto line = [&](double ChunkProbe::*field) {
    return Linear::through(n1, chunk[0].*field, n2, chunk[1].*field);
  };
  ChunkCosts costs;
  costs.nograd_peak = line(&ChunkProbe::nograd_peak);
  costs.grad_peak = line(&ChunkProbe::grad_peak);
  costs.saved = line(&ChunkProbe::saved);
  costs.backward_peak = line(&ChunkProbe::backward_peak);
  costs.accumulate_peak = line(&ChunkProbe::accumulate_peak);
  costs.frozen_output = line(&ChunkProbe::frozen_output);
  costs.nograd_seconds = line(&ChunkProbe::nograd_seconds);
  costs.grad_seconds = line(&ChunkProbe::grad_seconds);
  costs.backward_seconds = line(&ChunkProbe::backward_seconds);
  costs.frozen_seconds = line(&ChunkProbe::frozen_seconds);
  const double h1 = static_cast<double>(options.head_frames[0]);
  const double h2 = static_cast<double>(options.head_frames[1]);
  costs.head_peak = Linear::through(h1, head_probe[0].peak, h2, head_probe[1].peak);
  costs.head_seconds = Linear::through(h1, head_probe[0].seconds, h2, head_probe[1].seconds);
  // Times cannot shrink with more frames, and a chunk cannot take negative time: noise on tiny
  // probes (or a per-frame cost that grows with the batch) can make a slope or an intercept
  // negative, and a negative intercept made one-frame chunks look fastest. Both are clamped,
  // keeping the larger probe's time.
  for (auto* t : {&costs.nograd_seconds, &costs.grad_seconds, &costs.backward_seconds,
                  &costs.frozen_seconds, &costs.head_seconds}) {
    const double n = t == &costs.head_seconds ? h2 : n2;
    if (t->slope < 0) *t = Linear{std::max(0.0, t->intercept + t->slope * n), 0.0};
    if (t->intercept < 0) *t = Linear{0.0, std::max(0.0, t->intercept + t->slope * n) / n};
  }
  // One-frame chunks, timed apart: no line through larger chunks gives them (ChunkCosts).
  const auto one = chunk_frames[0] == 1 ? chunk[0]
                   : chunk_frames[1] == 1
                       ? chunk[1]
                       : probe_chunk(spec, precision, encoder, 1, tracker, options);
  costs.one_frame = {one.nograd_seconds, one.grad_seconds, one.backward_seconds,
                     one.frozen_seconds};
  return costs;
}

// ---------------------------------------------------------------------------------------------
// Cache file

namespace {

const std::vector<std::pair<const char*, Linear ChunkCosts::*>>& cost_fields() {
  static const std::vector<std::pair<const char*, Linear ChunkCosts::*>> fields = {
      {"nograd_peak", &ChunkCosts::nograd_peak},
      {"grad_peak", &ChunkCosts::grad_peak},
      {"saved", &ChunkCosts::saved},
      {"backward_peak", &ChunkCosts::backward_peak},
      {"accumulate_peak", &ChunkCosts::accumulate_peak},
      {"frozen_output", &ChunkCosts::frozen_output},
      {"head_peak", &ChunkCosts::head_peak},
      {"nograd_seconds", &ChunkCosts::nograd_seconds},
      {"grad_seconds", &ChunkCosts::grad_seconds},
      {"backward_seconds", &ChunkCosts::backward_seconds},
      {"frozen_seconds", &ChunkCosts::frozen_seconds},
      {"head_seconds", &ChunkCosts::head_seconds},
  };
  return fields;
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

}  // namespace

std::string CalibrationCache::default_path() {
  if (!env("FRAMEFIT_CACHE_DIR").empty()) return env("FRAMEFIT_CACHE_DIR") + "/calibration.json";
  if (!env("XDG_CACHE_HOME").empty()) return env("XDG_CACHE_HOME") + "/framefit/calibration.json";
  if (!env("HOME").empty()) return env("HOME") + "/.cache/framefit/calibration.json";
  return ".framefit-calibration.json";
}

CalibrationCache::CalibrationCache(std::string path) : path_(std::move(path)) {
  std::ifstream in(path_);
  if (!in) return;  // no cache yet
  // Parsed without exceptions; a damaged entry (edited by hand, truncated) is recalibrated.
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto file = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!file.is_discarded(), "calibration cache ", path_,
              " is not valid JSON: delete it and it will be recreated");
  if (!file.is_object() || file.value("format", "") != "framefit-calibration" ||
      file.value("version", 0) != kVersion || !file.contains("entries") ||
      !file["entries"].is_object()) {
    return;  // another version: recalibrate rather than misread
  }
  for (const auto& [key, entry] : file["entries"].items()) {
    ChunkCosts costs;
    bool complete = entry.is_object();
    for (const auto& [name, field] : cost_fields()) {
      if (!complete) break;
      const auto pair = entry.value(name, nlohmann::json());
      complete = pair.is_array() && pair.size() == 2 && pair[0].is_number() && pair[1].is_number();
      if (complete) (costs.*field) = Linear{pair[0].get<double>(), pair[1].get<double>()};
    }
    const auto one = complete ? entry.value("one_frame_seconds", nlohmann::json()) : nullptr;
    complete = complete && one.is_array() && one.size() == 4 &&
               std::all_of(one.begin(), one.end(), [](const auto& v) { return v.is_number(); });
    if (complete) {  // a damaged entry is recalibrated
      costs.one_frame = {one[0].get<double>(), one[1].get<double>(), one[2].get<double>(),
                         one[3].get<double>()};
      entries_[key] = costs;
    }
  }
}

std::optional<ChunkCosts> CalibrationCache::find(const std::string& key) const {
  const auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

void CalibrationCache::put(const std::string& key, const ChunkCosts& costs) {
  entries_[key] = costs;
}

void CalibrationCache::save() const {
  nlohmann::json entries = nlohmann::json::object();
  for (const auto& [key, costs] : entries_) {
    nlohmann::json entry;
    for (const auto& [name, field] : cost_fields()) {
      entry[name] = {(costs.*field).intercept, (costs.*field).slope};
    }
    const auto& one = costs.one_frame;
    entry["one_frame_seconds"] = {one.nograd, one.grad, one.backward, one.frozen};
    entries[key] = entry;
  }
  const nlohmann::json file = {
      {"format", "framefit-calibration"}, {"version", kVersion}, {"entries", entries}};
  const std::filesystem::path path(path_);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  const std::string temp = path_ + ".tmp";
  {
    std::ofstream out(temp);
    TORCH_CHECK(out.good(), "cannot write the calibration cache ", temp);
    out << file.dump(1) << "\n";
    TORCH_CHECK(out.good(), "cannot write the calibration cache ", temp);
  }
  std::filesystem::rename(temp, path);
}

std::map<engine::Precision, ChunkCosts> calibrated_costs(
    const ModelSpec& spec, const std::vector<engine::Precision>& precisions,
    const Calibrator& calibrator, const CalibrationOptions& options) {
  auto& cache = calibrator.cache;
  const auto& on_probe = calibrator.on_probe;
  std::map<engine::Precision, ChunkCosts> result;
  bool changed = false;
  for (const auto precision : precisions) {
    const auto key = spec.calibration_key(precision);
    if (auto costs = cache.find(key)) {
      result[precision] = *costs;
      continue;
    }
    if (on_probe) on_probe("calibrating " + key + " (probe runs, once per machine)");
    auto told = options;
    if (!told.on_progress) told.on_progress = on_probe;
    result[precision] = calibrate(spec, precision, calibrator.tracker, told);
    cache.put(key, result[precision]);
    changed = true;
  }
  if (changed) cache.save();
  return result;
}

Plan plan_chunked_step(PlanRequest& request, const StaticSizes& sizes,
                       std::map<engine::Precision, ChunkCosts>& costs, const Calibrator& calibrator,
                       int64_t budget_bytes, double margin, bool choose_norm) {
  const bool fixed = request.chunk || request.keep || request.cache_frozen || request.accumulate;
  // With fixed settings, the request and costs as given, for the advice below: the fixed plan
  // changes both.
  std::optional<PlanRequest> relaxed_request;
  std::optional<std::map<engine::Precision, ChunkCosts>> relaxed_costs;
  if (fixed) {
    relaxed_request = request;
    relaxed_costs = costs;
  }
  auto plan = choose_norm ? fit_choosing_recompute_norm(request, sizes, costs, calibrator,
                                                        budget_bytes, margin)
                          : fit(request, sizes, costs, budget_bytes, margin);
  plan = refit_at_planned_chunk(request, sizes, costs, calibrator, std::move(plan), budget_bytes,
                                margin);
  if (!plan.fits && fixed) {
    // What this same path plans with the fixed settings left auto, on the copies: `request` and
    // `costs` stay the fixed plan's (the replanner plans with them).
    relaxed_request->chunk.reset();
    relaxed_request->keep.reset();
    relaxed_request->cache_frozen.reset();
    relaxed_request->accumulate.reset();
    const auto relaxed = plan_chunked_step(*relaxed_request, sizes, *relaxed_costs, calibrator,
                                           budget_bytes, margin, choose_norm);
    plan.advice = plan.needs;
    if (relaxed.fits) plan.advice += fits_when_auto(relaxed.settings, relaxed.accumulate);
  }
  return plan;
}

Plan fit_choosing_recompute_norm(PlanRequest& request, const StaticSizes& sizes,
                                 std::map<engine::Precision, ChunkCosts>& costs,
                                 const Calibrator& calibrator, int64_t budget_bytes,
                                 double margin) {
  const auto& allowed = request.precisions;
  const bool fp32 = std::count(allowed.begin(), allowed.end(), engine::Precision::FP32) > 0;
  if (!request.model.takes_recompute_norm() || !fp32) {
    return fit(request, sizes, costs, budget_bytes, margin);
  }
  auto spec = request.model;
  spec.recompute_norm = true;
  auto recomputed = calibrated_costs(spec, {engine::Precision::FP32}, calibrator);
  auto chosen = fit_recompute_norm(request, sizes, costs, recomputed, budget_bytes, margin);
  request.model.recompute_norm = chosen.settings.recompute_norm;
  if (chosen.settings.recompute_norm) costs = std::move(recomputed);
  return chosen;
}

Plan refit_at_planned_chunk(const PlanRequest& request, const StaticSizes& sizes,
                            std::map<engine::Precision, ChunkCosts>& costs,
                            const Calibrator& calibrator, Plan plan, int64_t budget_bytes,
                            double margin, const CalibrationOptions& options) {
  auto& cache = calibrator.cache;
  const auto& on_probe = calibrator.on_probe;
  const int64_t probed = *std::max_element(options.chunk_frames.begin(), options.chunk_frames.end());
  std::set<std::pair<engine::Precision, int64_t>> measured;
  for (int round = 0; round < 3; ++round) {
    const auto& s = plan.settings;
    if (s.naive() || s.chunk <= 2 * probed || measured.count({s.precision, s.chunk})) break;
    measured.insert({s.precision, s.chunk});
    const auto key = c10::str(request.model.calibration_key(s.precision), " through ", s.chunk);
    if (auto found = cache.find(key)) {
      costs[s.precision] = *found;
    } else {
      if (on_probe) on_probe(c10::str("calibrating at the planned chunk of ", s.chunk, " frames"));
      auto through = options;
      through.chunk_frames = {probed, s.chunk};
      if (!through.on_progress) through.on_progress = on_probe;
      costs[s.precision] = calibrate(request.model, s.precision, calibrator.tracker, through);
      cache.put(key, costs[s.precision]);
      cache.save();
    }
    auto again = fit(request, sizes, costs, budget_bytes, margin);
    again.reason = plan.reason;
    plan = std::move(again);
  }
  return plan;
}

int64_t training_static_bytes(const torch::nn::Module& module, const std::string& optimizer) {
  TORCH_CHECK(optimizer == "sgd" || optimizer == "adam" || optimizer == "adamw",
              "unknown optimizer '", optimizer, "': use sgd, adam or adamw");
  int64_t parameters = 0, trained = 0, buffers = 0;
  for (const auto& p : module.parameters()) {
    parameters += static_cast<int64_t>(p.nbytes());
    if (p.requires_grad()) trained += static_cast<int64_t>(p.nbytes());
  }
  for (const auto& b : module.buffers()) buffers += static_cast<int64_t>(b.nbytes());
  return parameters + buffers + trained * (1 + (optimizer == "sgd" ? 1 : 2));
}

namespace {
// Cost lines through batches 1 and 2, measured again toward the batch the budget allows.
// Batches 1 and 2 alone mislead both ways: a workspace oneDNN takes from batch 2 on makes their
// line overshoot (R3D-18 on 4 x 32 x 32 clips: 4,385 MiB predicted for batch 28, 843 measured);
// one its weight gradient takes only while the batch has fewer samples than threads makes it
// undershoot (seeds/001's clips at half size: batch 5 planned within 300 MiB, where batch 3 took
// 306). So wherever the line leads past batch 2 it is measured there (at half the planned batch,
// at least 3, at most 8 times the last measurement: a line that does not grow plans the largest
// batch) and redrawn through its two largest measurements, again while it leads to 4 times its
// last measurement or more (so that the two stay at least twice apart). `at(b)`: the stage costs of
// b samples; `base`: the costs' static and input parts and segment limit.
BatchCosts lines_toward_budget(const std::function<std::vector<engine::StageCost>(int64_t)>& at,
                               const BatchCosts& base, int64_t budget_bytes, int64_t max_batch) {
  const auto through = [&](int64_t b1, const std::vector<engine::StageCost>& c1, int64_t b2,
                           const std::vector<engine::StageCost>& c2) {
    auto costs = BatchCosts::through(b1, c1, b2, c2);
    costs.static_bytes = base.static_bytes;
    costs.library_bytes = base.library_bytes;
    costs.input_bytes_per_sample = base.input_bytes_per_sample;
    costs.max_segment_stages = base.max_segment_stages;
    return costs;
  };
  const auto one = at(1);
  auto high_costs = at(2);
  auto costs = through(1, one, 2, high_costs);
  if (budget_bytes <= 0) return costs;
  const auto planned = [&] {
    return plan_batch(costs, budget_bytes, Recompute::Nothing, max_batch).batch;
  };
  int64_t high = 2;
  int64_t batch = planned();
  for (int round = 0; round < 3 && batch > high && (high == 2 || batch >= 4 * high); ++round) {
    const int64_t next = std::max(high + 1, std::min(batch / 2, 8 * high));
    std::vector<engine::StageCost> next_costs;
    try {
      next_costs = at(next);
    } catch (const std::exception& e) {
      // A device that cannot hold `next` (the budget is near its whole memory): plan below it.
      if (!memory::is_out_of_memory(e)) throw;
      costs.failed_batch = next;
      break;
    }
    costs = through(high, high_costs, next, next_costs);
    costs.single = one;
    high = next;
    high_costs = std::move(next_costs);
    batch = planned();
  }
  return costs;
}

}  // namespace

BatchCosts calibrate_batch(const engine::ChainNetwork& network,
                           const std::function<torch::Tensor(int64_t)>& inputs,
                           int64_t static_bytes, int64_t input_bytes_per_sample,
                           int64_t budget_bytes, memory::Tracker& tracker,
                           engine::Precision precision) {
  const auto at = [&](int64_t batch) {
    const auto x = inputs(batch);
    engine::AutocastGuard autocast(tracker.device(), precision);
    return network.measure(x, tracker);
  };
  BatchCosts base;
  base.static_bytes = static_bytes;
  base.library_bytes = tracker.library_bytes();
  base.input_bytes_per_sample = input_bytes_per_sample;
  base.max_segment_stages = network.max_segment_stages();
  return lines_toward_budget(at, base, budget_bytes, 4096);
}

BatchCosts calibrate_inference(const engine::ChainNetwork& network,
                               const std::function<torch::Tensor(int64_t)>& inputs,
                               int64_t static_bytes, int64_t input_bytes_per_sample,
                               int64_t budget_bytes, memory::Tracker& tracker,
                               engine::Precision precision, int64_t max_batch) {
  auto& module = *network.module;
  const bool was_training = module.is_training();
  module.eval();
  const auto device = tracker.device();
  const auto segments = engine::store_all(network.stage_count());
  // One stage that keeps nothing: nothing is saved for a backward pass.
  const auto at = [&](int64_t batch) {
    const auto x = inputs(batch);
    torch::NoGradGuard no_grad;
    engine::AutocastGuard autocast(device, precision);
    auto window = tracker.mark();
    const auto start = std::chrono::steady_clock::now();
    auto logits = network.forward(x, segments);
    if (logits.is_cuda()) torch::cuda::synchronize();
    engine::StageCost cost;
    cost.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    logits.reset();
    cost.peak_bytes = window.peak_bytes() - window.entry_bytes();
    return std::vector<engine::StageCost>{cost};
  };
  BatchCosts base;
  base.static_bytes = static_bytes;
  base.library_bytes = tracker.library_bytes();
  base.input_bytes_per_sample = input_bytes_per_sample;
  base.max_segment_stages = 1;
  const auto costs = lines_toward_budget(at, base, budget_bytes, max_batch);
  module.train(was_training);
  return costs;
}

}  // namespace framefit::plan
