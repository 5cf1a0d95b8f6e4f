#include "framefit/plan/planner.h"

#include "framefit/core/runtime.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "framefit/memory/tracker.h"

namespace framefit::plan {

namespace {

// Chunk sizes worth trying: roughly geometric, so a 2,000-frame video needs ~20 candidates.
std::vector<int64_t> chunk_candidates(const PlanRequest& request) {
  if (request.chunk) return {*request.chunk};
  std::vector<int64_t> chunks;
  for (int64_t k : {1,  2,  3,   4,   6,   8,   12,  16,  24,   32,   48,
                    64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048}) {
    if (k < request.frames) chunks.push_back(k);
  }
  chunks.push_back(0);  // naive
  return chunks;
}

std::vector<int64_t> keep_candidates(const PlanRequest& request, int64_t chunk) {
  if (request.keep) return {*request.keep};
  if (chunk == 0 || chunk >= request.frames) return {0};  // nothing to keep in one pass
  const int64_t chunks = (request.frames + chunk - 1) / chunk;
  std::vector<int64_t> keeps;
  for (int64_t k : {0, 1, 2, 3, 4, 6, 8, 12, 16}) {
    if (k <= chunks) keeps.push_back(k);
  }
  return keeps;
}

std::vector<int64_t> accumulate_candidates(const PlanRequest& request) {
  if (request.accumulate) return {*request.accumulate};
  std::vector<int64_t> result;
  int64_t last_per_call = -1;
  for (int64_t a = 1; a <= request.videos; ++a) {
    const int64_t per_call = (request.videos + a - 1) / a;
    if (per_call != last_per_call) result.push_back(a);
    last_per_call = per_call;
  }
  return result;
}

struct Candidate {
  StepSettings settings;
  int64_t accumulate = 1;
  Breakdown breakdown;
  double seconds = 0;
};

// Encoder calls per video: one for naive training, else one per chunk.
int64_t chunks_per_video(const StepSettings& s) {
  return s.naive() ? 1 : (s.frames + s.chunk - 1) / s.chunk;
}

// The time a candidate is compared by: a 16-bit precision's counts kLowerPrecisionGain more, so
// that it wins over fp32 only where clearly faster.
double compared_seconds(const Candidate& c) {
  return c.settings.precision == engine::Precision::FP32 ? c.seconds
                                                         : c.seconds / (1 - kLowerPrecisionGain);
}

// Faster first (compared_seconds); equal time: less accumulation, then fewer encoder calls
// (per-call overhead the time model does not see below its calibrated chunk sizes: an
// all-frozen encoder's predicted time is the same for any chunk, and one-frame chunks ran 3x
// slower), then less memory.
bool better(const Candidate& a, const Candidate& b) {
  const double sa = compared_seconds(a), sb = compared_seconds(b);
  const double tolerance = 1e-9 * std::max(sa, sb);
  if (std::abs(sa - sb) > tolerance) return sa < sb;
  if (a.accumulate != b.accumulate) return a.accumulate < b.accumulate;
  const int64_t calls_a = chunks_per_video(a.settings), calls_b = chunks_per_video(b.settings);
  if (calls_a != calls_b) return calls_a < calls_b;
  return a.breakdown.peak_bytes < b.breakdown.peak_bytes;
}

template <typename Visit>
int64_t for_each_candidate(const PlanRequest& request, const StaticSizes& sizes,
                           const std::map<engine::Precision, ChunkCosts>& costs, Visit visit) {
  TORCH_CHECK(request.frames >= 1, "the plan needs the frames per video (>= 1)");
  TORCH_CHECK(request.frames <= kMaxFramesPerVideo, "the plan takes videos of at most ",
              kMaxFramesPerVideo, " frames; got ", request.frames);
  TORCH_CHECK(request.videos >= 1, "the plan needs at least one video per step");
  TORCH_CHECK(!request.precisions.empty(), "the plan needs at least one allowed precision");
  int64_t count = 0;
  std::vector<bool> caches = {false};
  if (request.cache_frozen) {
    caches = {*request.cache_frozen};
  } else if (sizes.frozen_stages > 0) {
    caches = {false, true};
  }
  for (const auto precision : request.precisions) {
    const auto it = costs.find(precision);
    TORCH_CHECK(it != costs.end(), "no calibration for ", engine::to_string(precision),
                ": calibrate every allowed precision first");
    for (const int64_t accumulate : accumulate_candidates(request)) {
      for (const int64_t chunk : chunk_candidates(request)) {
        for (const int64_t keep : keep_candidates(request, chunk)) {
          for (const bool cache : caches) {
            const bool naive = chunk == 0 || chunk >= request.frames;
            if (cache && naive) continue;  // nothing is recomputed
            Candidate c;
            c.settings.frames = request.frames;
            c.settings.shorter_videos = request.shorter_videos;
            c.settings.videos_per_call = (request.videos + accumulate - 1) / accumulate;
            c.settings.chunk = chunk;
            c.settings.keep = keep;
            c.settings.cache_frozen = cache;
            c.settings.precision = precision;
            c.settings.recompute_norm = request.model.recompute_norm;
            c.accumulate = accumulate;
            c.breakdown = predict(sizes, it->second, c.settings);
            c.seconds = c.breakdown.seconds * static_cast<double>(accumulate);
            ++count;
            visit(c);
          }
        }
      }
    }
  }
  return count;
}

int64_t usable(int64_t budget, double margin) {
  return static_cast<int64_t>(std::floor(static_cast<double>(budget) * (1.0 - margin)));
}

}  // namespace

std::string describe(const StepSettings& s, int64_t accumulate) {
  std::string text =
      s.naive() ? "naive (all frames at once)" : c10::str("chunk ", s.chunk, ", keep ", s.keep);
  if (s.cache_frozen) text += ", frozen outputs cached";
  text += ", " + engine::to_string(s.precision);
  if (s.recompute_norm) text += ", BatchNorm recomputed";
  if (accumulate > 1)
    text += c10::str(", accumulate ", accumulate, " (", s.videos_per_call, " video(s) per call)");
  return text;
}

std::string fits_when_auto(const StepSettings& settings, int64_t accumulate) {
  return "; it fits this budget if chunk, keep, caching and accumulation are left to the "
         "planner (auto): " +
         describe(settings, accumulate);
}

int64_t allocator_margin_bytes(int64_t budget_bytes, torch::Device device) {
  constexpr double kCudaMargin = 0.1;
  return device.is_cuda() ? budget_bytes - usable(budget_bytes, kCudaMargin) : 0;
}

std::string budget_beyond_device(int64_t budget_bytes, int64_t available_bytes,
                                 torch::Device device, const std::string& what) {
  if (budget_bytes <= 0 || budget_bytes <= available_bytes) return "";
  const int64_t available = available_bytes;
  const bool cuda = device.is_cuda();
  return c10::str(what, " ", memory::format_bytes(budget_bytes), " is more than the ",
                  cuda ? "device's free memory" : "system's available memory", " (",
                  memory::format_bytes(available), "): a plan that fills it will ",
                  cuda ? "run out of device memory and be re-planned step by step"
                       : "swap or be stopped by the system",
                  "; lower ", what, " to plan within what there is");
}

int64_t static_minimum_bytes(const StaticSizes& sizes, int64_t frames) {
  return sizes.parameter_bytes + sizes.trained_bytes() + sizes.optimizer_state_bytes +
         frames * sizes.resident_bytes_per_frame() + 2 * frames * sizes.feature_bytes +
         sizes.library_bytes;
}

Plan fit(const PlanRequest& request, const StaticSizes& sizes,
         const std::map<engine::Precision, ChunkCosts>& costs, int64_t budget_bytes,
         double margin) {
  TORCH_CHECK(budget_bytes > 0, "the plan needs a budget (> 0 bytes)");
  TORCH_CHECK(margin >= 0 && margin < 1, "the safety margin is a fraction in [0, 1); got ", margin);
  const int64_t limit = usable(budget_bytes, margin);
  std::optional<Candidate> best, smallest;
  Plan plan;
  plan.candidates = for_each_candidate(request, sizes, costs, [&](const Candidate& c) {
    if (!smallest || c.breakdown.peak_bytes < smallest->breakdown.peak_bytes) smallest = c;
    if (c.breakdown.peak_bytes <= limit && (!best || better(c, *best))) best = c;
  });
  plan.budget_bytes = budget_bytes;
  plan.margin_bytes = budget_bytes - limit;
  const Candidate& chosen = best ? *best : *smallest;
  plan.fits = best.has_value();
  plan.settings = chosen.settings;
  plan.accumulate = chosen.accumulate;
  plan.breakdown = chosen.breakdown;
  plan.step_seconds = chosen.seconds;
  if (!plan.fits) {
    plan.minimum_budget_bytes = static_cast<int64_t>(
        std::ceil(static_cast<double>(smallest->breakdown.peak_bytes) / (1.0 - margin)));
    // The breakdown shows the peak; the budget it needs adds the margin, which is said so that
    // the two numbers agree.
    plan.needs =
        c10::str("needs at least ", memory::format_bytes(plan.minimum_budget_bytes),
                 " (a predicted peak of ", memory::format_bytes(smallest->breakdown.peak_bytes),
                 " plus the ", std::lround(100 * margin), "% margin, with ",
                 describe(smallest->settings, smallest->accumulate), ")");
    plan.advice = plan.needs;
    // Settings the user fixed may be what stands in the way.
    PlanRequest relaxed = request;
    relaxed.chunk.reset();
    relaxed.keep.reset();
    relaxed.cache_frozen.reset();
    relaxed.accumulate.reset();
    std::optional<Candidate> relaxed_best;
    for_each_candidate(relaxed, sizes, costs, [&](const Candidate& c) {
      if (c.breakdown.peak_bytes <= limit && (!relaxed_best || better(c, *relaxed_best)))
        relaxed_best = c;
    });
    if (relaxed_best)
      plan.advice += fits_when_auto(relaxed_best->settings, relaxed_best->accumulate);
  }
  return plan;
}

Plan fit_recompute_norm(const PlanRequest& request, const StaticSizes& sizes,
                        const std::map<engine::Precision, ChunkCosts>& plain,
                        const std::map<engine::Precision, ChunkCosts>& recomputed,
                        int64_t budget_bytes, double margin) {
  PlanRequest without = request;
  without.model.recompute_norm = false;
  auto plan = fit(without, sizes, plain, budget_bytes, margin);
  PlanRequest with = request;
  with.model.recompute_norm = true;
  with.precisions.clear();
  for (const auto precision : request.precisions) {
    if (recomputed.count(precision)) with.precisions.push_back(precision);
  }
  if (with.precisions.empty()) return plan;
  auto other = fit(with, sizes, recomputed, budget_bytes, margin);
  const int64_t candidates = plan.candidates + other.candidates;
  // Both timed by the plain calibration: the same settings take the same time, as far as two
  // probe runs can tell, so only a larger chunk or keep can make the recomputed plan faster.
  // (Each calibration's own time lines differed by 6% at equal settings, from noise alone.)
  const double other_seconds =
      predict(sizes, plain.at(other.settings.precision), other.settings).seconds *
      static_cast<double>(other.accumulate);
  const bool take_other =
      other.fits ? !plan.fits || other_seconds < (1 - kRecomputeNormGain) * plan.step_seconds
                 : !plan.fits && other.minimum_budget_bytes < plan.minimum_budget_bytes;
  auto& chosen = take_other ? other : plan;
  if (take_other && plan.fits) {
    chosen.reason =
        c10::str("BatchNorm recomputed: predicted ", std::round(other_seconds * 100) / 100,
                 " s a step, the plain blocks' best plan (", describe(plan.settings), ") ",
                 std::round(plan.step_seconds * 100) / 100, " s");
  } else if (take_other) {
    chosen.reason = c10::str("BatchNorm recomputed: without it nothing fits (",
                             plan.advice.substr(0, plan.advice.find(';')), ")");
  }
  chosen.candidates = candidates;
  return std::move(chosen);
}

std::vector<TableRow> plan_table(const PlanRequest& request, const StaticSizes& sizes,
                                 const std::map<engine::Precision, ChunkCosts>& costs,
                                 int64_t budget_bytes, double margin) {
  PlanRequest table = request;
  table.keep = request.keep.value_or(1);
  table.cache_frozen = request.cache_frozen.value_or(false);
  table.accumulate = request.accumulate.value_or(1);
  std::vector<TableRow> rows;
  const int64_t limit = budget_bytes > 0 ? usable(budget_bytes, margin) : 0;
  for_each_candidate(table, sizes, costs, [&](const Candidate& c) {
    TableRow row;
    row.settings = c.settings;
    if (c.settings.naive()) row.settings.keep = 0;
    row.breakdown = c.breakdown;
    row.breakdown.seconds = c.seconds;
    row.fits = budget_bytes == 0 || c.breakdown.peak_bytes <= limit;
    rows.push_back(row);
  });
  return rows;
}

engine::Replanner make_replanner(PlanRequest request, StaticSizes sizes, ChunkCosts costs,
                                 engine::Precision precision, int64_t budget_bytes, double margin) {
  request.precisions = {precision};
  request.accumulate = 1;  // a retry repeats the same call with the same videos
  request.videos = 1;
  return [=](const engine::OutOfMemoryEvent& event) -> std::optional<engine::RetrySettings> {
    StepSettings failed;
    failed.frames = request.frames;
    failed.shorter_videos = request.shorter_videos;
    failed.chunk = event.chunk;
    failed.keep = event.keep;
    failed.cache_frozen = event.cache_frozen;
    failed.precision = precision;
    const auto predicted = predict(sizes, costs, failed);
    // The step needed at least in-use + requested bytes where the model predicted the phase's
    // peak: scale every prediction by that underestimate.
    const auto phase = predicted.phase_peaks.find(event.phase);
    const double expected = static_cast<double>(
        phase != predicted.phase_peaks.end() ? phase->second : predicted.peak_bytes);
    const double needed = static_cast<double>(event.in_use_bytes + event.requested_bytes);
    const double scale = std::max(1.05, needed / std::max(1.0, expected));
    const int64_t budget = event.budget_bytes > 0 ? event.budget_bytes : budget_bytes;
    PlanRequest retry = request;
    retry.chunk.reset();
    retry.keep.reset();
    retry.cache_frozen.reset();
    std::optional<Candidate> best;
    int64_t smallest = std::numeric_limits<int64_t>::max();
    const double limit = static_cast<double>(usable(budget, margin));
    for_each_candidate(retry, sizes, {{precision, costs}}, [&](const Candidate& c) {
      smallest = std::min(smallest, c.breakdown.peak_bytes);
      const double corrected = static_cast<double>(c.breakdown.peak_bytes) * scale;
      if (corrected <= limit && c.breakdown.peak_bytes < predicted.peak_bytes &&
          (!best || better(c, *best))) {
        best = c;
      }
    });
    engine::RetrySettings settings;
    if (best) {
      settings.chunk = best->settings.naive() ? 0 : best->settings.chunk;
      settings.keep = best->settings.keep;
      settings.cache_frozen = best->settings.cache_frozen;
      settings.reason = c10::str("re-planned with the memory model corrected by ×",
                                 std::round(scale * 100) / 100, ", predicted peak ",
                                 memory::format_bytes(static_cast<int64_t>(
                                     static_cast<double>(best->breakdown.peak_bytes) * scale)));
      return settings;
    }
    // Below the smallest plan's peak nothing can succeed (the optimizer's state, created by the
    // first step, would not fit): give up with the error rather than retry smaller chunks.
    if (smallest > budget) return std::nullopt;
    auto halved = engine::halve_chunk(event);
    if (halved)
      halved->reason =
          "the corrected memory model finds nothing smaller that fits; halving the chunk";
    return halved;
  };
}

LargestChunk find_largest_chunk(const PlanRequest& request, const StaticSizes& sizes,
                                const ChunkCosts& costs, engine::Precision precision,
                                int64_t budget_bytes, double headroom,
                                const std::function<ChunkTrial(int64_t)>& run_step,
                                int max_trials) {
  TORCH_CHECK(budget_bytes > 0 && headroom >= 0 && headroom < 1,
              "find_largest_chunk needs a budget and a headroom fraction in [0, 1)");
  const double limit = static_cast<double>(budget_bytes) * (1.0 - headroom);
  LargestChunk result;
  double scale = 1.0;                // measured / predicted, learned from trials
  int64_t ceiling = request.frames;  // chunks above this failed
  auto settings_for = [&](int64_t chunk) {
    StepSettings s;
    s.frames = request.frames;
    s.shorter_videos = request.shorter_videos;
    s.chunk = chunk >= request.frames ? 0 : chunk;
    s.keep = request.keep.value_or(1);
    s.cache_frozen = request.cache_frozen.value_or(false);
    s.precision = precision;
    return s;
  };
  while (result.trials < max_trials) {
    // Predicted peak grows with the chunk: binary search the largest that fits.
    int64_t lo = 0, hi = ceiling;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      const double peak = static_cast<double>(predict(sizes, costs, settings_for(mid)).peak_bytes);
      if (peak * scale <= limit) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    if (lo == 0) {
      result.log.push_back("no chunk fits the budget with the headroom, by the memory model");
      return result;
    }
    const int64_t predicted = predict(sizes, costs, settings_for(lo)).peak_bytes;
    const auto trial = run_step(lo);
    ++result.trials;
    result.log.push_back(c10::str("trial ", result.trials, ": chunk ", lo, ", predicted ",
                                  memory::format_bytes(predicted), ", ",
                                  trial.out_of_memory
                                      ? std::string("out of memory")
                                      : "measured " + memory::format_bytes(trial.peak_bytes)));
    if (!trial.out_of_memory && static_cast<double>(trial.peak_bytes) <= limit) {
      result.found = true;
      result.chunk = lo;
      result.predicted_peak_bytes = predicted;
      result.measured_peak_bytes = trial.peak_bytes;
      return result;
    }
    // Learn from the miss and try below it.
    const double measured = trial.out_of_memory ? static_cast<double>(budget_bytes)
                                                : static_cast<double>(trial.peak_bytes);
    // 1% beyond the observed ratio, so the next choice is not another near miss.
    scale = std::max(scale * 1.02, 1.01 * measured / static_cast<double>(predicted));
    ceiling = lo - 1;
    if (ceiling < 1) break;
  }
  return result;
}

std::vector<engine::Precision> candidate_precisions(torch::Device device) {
  std::vector<engine::Precision> precisions = {engine::Precision::FP32};
  if (device.is_cuda()) {
    precisions.push_back(engine::Precision::FP16);
    precisions.push_back(engine::Precision::BF16);
  } else if (cpu_bf16().kernels == Bf16Kernels::Native) {
    // Emulated bf16 runs slower than fp32 and only its memory could be worth it: the user
    // chooses that (train.precision bf16).
    precisions.push_back(engine::Precision::BF16);
  }
  return precisions;
}

std::vector<engine::StageCost> BatchCosts::at(int64_t batch) const {
  TORCH_CHECK(fixed.empty() || fixed.size() == per_sample.size(),
              "BatchCosts: fixed and per-sample costs differ in length");
  auto costs = engine::scale_costs(per_sample, static_cast<double>(batch));
  for (size_t i = 0; i < fixed.size(); ++i) {
    costs[i].kept_bytes += fixed[i].kept_bytes;
    costs[i].output_bytes += fixed[i].output_bytes;
    costs[i].peak_bytes += fixed[i].peak_bytes;
    costs[i].forward_peak_bytes += fixed[i].forward_peak_bytes;
    costs[i].seconds += fixed[i].seconds;
    costs[i].parameter_grad_bytes += fixed[i].parameter_grad_bytes;
  }
  if (batch == 1 && single.size() == costs.size()) {
    for (size_t i = 0; i < costs.size(); ++i) {
      auto& c = costs[i];
      const auto& s = single[i];
      c.kept_bytes = std::max(c.kept_bytes, s.kept_bytes);
      c.output_bytes = std::max(c.output_bytes, s.output_bytes);
      c.peak_bytes = std::max(c.peak_bytes, s.peak_bytes);
      c.forward_peak_bytes = std::max(c.forward_peak_bytes, s.forward_peak_bytes);
      c.seconds = std::max(c.seconds, s.seconds);
    }
  }
  return costs;
}

BatchCosts BatchCosts::through(int64_t b1, const std::vector<engine::StageCost>& c1, int64_t b2,
                               const std::vector<engine::StageCost>& c2) {
  TORCH_CHECK(b1 < b2 && c1.size() == c2.size(),
              "BatchCosts::through: two measurements at "
              "different batches of the same stages");
  BatchCosts costs;
  const auto n1 = static_cast<double>(b1);
  const auto n2 = static_cast<double>(b2);
  const auto line = [&](double y1, double y2) {
    auto l = Linear::through(n1, y1, n2, y2);
    if (l.slope < 0) l = Linear{y1, 0.0};  // falling: the smaller batch's (larger) value
    // Faster than proportional growth between the two (a convolution algorithm with a workspace
    // chosen from some batch on): the line through the larger measurement and zero, so the
    // model gives what was measured there instead of overshooting it.
    if (l.intercept < 0) l = Linear{0.0, y2 / n2};
    return l;
  };
  const auto bytes = [&](int64_t y1, int64_t y2, int64_t& slope, int64_t& intercept) {
    const auto l = line(static_cast<double>(y1), static_cast<double>(y2));
    slope = static_cast<int64_t>(std::ceil(l.slope));
    intercept = static_cast<int64_t>(std::ceil(l.intercept));
  };
  for (size_t i = 0; i < c1.size(); ++i) {
    engine::StageCost slope, intercept;
    bytes(c1[i].kept_bytes, c2[i].kept_bytes, slope.kept_bytes, intercept.kept_bytes);
    bytes(c1[i].output_bytes, c2[i].output_bytes, slope.output_bytes, intercept.output_bytes);
    bytes(c1[i].peak_bytes, c2[i].peak_bytes, slope.peak_bytes, intercept.peak_bytes);
    bytes(c1[i].forward_peak_bytes, c2[i].forward_peak_bytes, slope.forward_peak_bytes,
          intercept.forward_peak_bytes);
    const auto seconds = line(c1[i].seconds, c2[i].seconds);
    slope.seconds = seconds.slope;
    intercept.seconds = seconds.intercept;
    intercept.parameter_grad_bytes = c2[i].parameter_grad_bytes;  // the same at any batch
    costs.per_sample.push_back(slope);
    costs.fixed.push_back(intercept);
  }
  return costs;
}

int64_t batch_peak_bytes(const BatchCosts& costs, int64_t batch, const ChainPlan& chain) {
  return costs.static_bytes + costs.library_bytes + batch * costs.input_bytes_per_sample +
         chain.predicted_bytes;
}

std::string to_string(Recompute recompute) {
  switch (recompute) {
    case Recompute::Nothing: return "off";
    case Recompute::AsNeeded: return "auto";
    case Recompute::EveryStage: return "all";
  }
  return "auto";
}

Recompute parse_recompute(const std::string& checkpointing) {
  if (checkpointing == "off") return Recompute::Nothing;
  if (checkpointing == "auto") return Recompute::AsNeeded;
  if (checkpointing == "all") return Recompute::EveryStage;
  TORCH_CHECK(false, "unknown checkpointing \"", checkpointing, "\": use off, auto or all");
}

ChainPlan plan_batch_chain(const BatchCosts& costs, int64_t batch, int64_t budget_bytes,
                           Recompute recompute, int64_t micro_batches) {
  TORCH_CHECK(micro_batches >= 1, "plan_batch_chain: micro_batches must be >= 1");
  const auto scaled = costs.at((batch + micro_batches - 1) / micro_batches);
  const int64_t room = budget_bytes - costs.static_bytes - costs.library_bytes -
                       batch * costs.input_bytes_per_sample;
  const auto stages = static_cast<int64_t>(scaled.size());
  auto fixed =
      evaluate_chain(scaled, recompute == Recompute::EveryStage ? engine::recompute_every(stages, 1)
                                                                : engine::store_all(stages));
  fixed.fits = fixed.predicted_bytes <= room;
  if (recompute != Recompute::AsNeeded || fixed.fits || room <= 0) return fixed;
  return plan_chain(scaled, room, costs.max_segment_stages);
}

ChainPlan least_memory_chain(const BatchCosts& costs, int64_t samples) {
  // With a budget nothing fits, plan_chain answers with the plan that holds the least.
  return plan_chain(costs.at(samples), 1, costs.max_segment_stages);
}

BatchPlan plan_batch(const BatchCosts& costs, int64_t budget_bytes, Recompute recompute,
                     int64_t max_batch) {
  TORCH_CHECK(!costs.per_sample.empty(), "plan_batch: no stage costs");
  TORCH_CHECK(budget_bytes > 0, "plan_batch: give a budget");
  if (costs.failed_batch > 0) max_batch = std::min(max_batch, costs.failed_batch - 1);
  const auto fits = [&](int64_t batch) {
    return plan_batch_chain(costs, batch, budget_bytes, recompute).fits;
  };
  BatchPlan result;
  result.minimum_bytes_one_sample = costs.static_bytes + costs.library_bytes +
                                    costs.input_bytes_per_sample +
                                    least_memory_chain(costs, 1).minimum_bytes;
  if (max_batch < 1 || !fits(1)) return result;
  // Memory grows with the batch, so the largest batch that fits is found by bisection.
  int64_t low = 1, high = 2;
  while (high <= max_batch && fits(high)) low = high, high *= 2;
  high = std::min(high, max_batch + 1);
  while (high - low > 1) {
    const int64_t mid = (low + high) / 2;
    (fits(mid) ? low : high) = mid;
  }
  result.batch = low;
  result.chain = plan_batch_chain(costs, low, budget_bytes, recompute);
  result.predicted_peak_bytes = batch_peak_bytes(costs, low, result.chain);
  return result;
}

std::vector<BatchRow> batch_table(const BatchCosts& costs, int64_t budget_bytes,
                                  Recompute recompute, int64_t largest) {
  std::vector<int64_t> batches;
  for (int64_t b = 1; b <= std::max<int64_t>(2, 2 * largest); b *= 2) batches.push_back(b);
  if (largest > 0) batches.insert(batches.end(), {largest, largest + 1});
  std::sort(batches.begin(), batches.end());
  batches.erase(std::unique(batches.begin(), batches.end()), batches.end());
  const auto stages = static_cast<int64_t>(costs.per_sample.size());
  std::vector<BatchRow> rows;
  for (const int64_t b : batches) {
    BatchRow row;
    row.batch = b;
    row.plain_peak_bytes =
        batch_peak_bytes(costs, b, evaluate_chain(costs.at(b), engine::store_all(stages)));
    const auto chain = plan_batch_chain(costs, b, budget_bytes, recompute);
    row.planned_peak_bytes = batch_peak_bytes(costs, b, chain);
    row.recomputed_stages = chain.recomputed_stages();
    row.fits = chain.fits && (costs.failed_batch == 0 || b < costs.failed_batch);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace framefit::plan
