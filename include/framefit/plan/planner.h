#pragma once
// The planner: a pure function from a request, the model's sizes and calibrated costs, and a
// budget to the fastest settings that fit, or to "does not fit" with the smallest budget that
// would and the settings that get there. It changes only what the request leaves as auto.
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "framefit/engine/checkpoint.h"
#include "framefit/engine/step.h"
#include "framefit/plan/chain_plan.h"
#include "framefit/plan/memory_model.h"

namespace framefit::plan {

// The longest video the memory model takes (994 days at 25 fps): its byte counts are int64
// products of frames and bytes per frame, and 10^14 frames overflowed them into a plan that
// searched chunk sizes without end.
constexpr int64_t kMaxFramesPerVideo = int64_t{1} << 31;

struct PlanRequest {
  ModelSpec model;
  int64_t frames = 0;  // per video (the longest one), 1 .. kMaxFramesPerVideo
  // Shorter videos are trained too (a data set): plans hold for every length up to `frames`
  // (StepSettings::shorter_videos).
  bool shorter_videos = false;
  int64_t videos = 1;  // per optimizer step
  // nullopt: auto (the planner chooses). chunk 0 is naive training.
  std::optional<int64_t> chunk;
  std::optional<int64_t> keep;
  std::optional<bool> cache_frozen;
  std::optional<int64_t> accumulate;  // calls per optimizer step, videos split across them
  // Precisions the planner may use; one entry fixes it.
  std::vector<engine::Precision> precisions = {engine::Precision::FP32};
};

struct Plan {
  bool fits = false;
  // The chosen settings; when nothing fits, the ones with the smallest peak.
  StepSettings settings;
  int64_t accumulate = 1;
  Breakdown breakdown;      // of one call (videos_per_call videos)
  double step_seconds = 0;  // predicted, whole optimizer step
  int64_t budget_bytes = 0;
  int64_t margin_bytes = 0;  // kept free for what the model does not see
  // When it does not fit: the smallest budget that would, and how (`needs`), then what fits where
  // fixed settings are left to the planner, if that helps; advice says both.
  int64_t minimum_budget_bytes = 0;
  std::string needs;
  std::string advice;
  // Why BatchNorm recomputation was taken (fit_recompute_norm), for the log; "" otherwise.
  std::string reason;
  int64_t candidates = 0;  // settings evaluated
};

// The precisions worth trying on `device`: fp32, plus fp16 and bf16 on CUDA, plus bf16 on a CPU
// with native bf16 instructions (elsewhere bf16 is emulated and slower than fp32).
std::vector<engine::Precision> candidate_precisions(torch::Device device);

// What a batch plan leaves of a budget on `device` beyond the memory it counts. On CUDA a
// budget caps the caching allocator's *reserved* bytes, which exceed the *allocated* bytes
// plans count by the fragmentation of its cached segments, so batch plans leave 10% of a CUDA
// budget (the usual advice; not yet measured), as fit()'s margin does for every chunk plan.
// framefit's CPU allocator enforces the budget on allocated bytes: 0 there.
int64_t allocator_margin_bytes(int64_t budget_bytes, torch::Device device);

// A warning where a budget is more than the `available_bytes` of `device` (CPU: the system's
// available memory; CUDA: the device's free memory; memory::Tracker::available_bytes before a
// budget is set on it), "" otherwise; `what` names the budget in it ("train.budget",
// "--budget"). The budget is kept, as the user's word, but a plan that fills it swaps (CPU) or
// runs out of device memory and is re-planned (CUDA), which the budget was meant to prevent.
std::string budget_beyond_device(int64_t budget_bytes, int64_t available_bytes,
                                 torch::Device device, const std::string& what);

// margin: the fraction of the budget kept free (0.1 = plan for 90% of it). The costs are those
// calibrated for request.model (its recompute_norm is copied into the settings). Of settings that
// fit, the fastest is chosen, except that a 16-bit precision is taken over fp32 only where it is
// predicted at least kLowerPrecisionGain faster (or fp32 does not fit): the two calibrations'
// difference is often within the timing noise, and two fresh calibrations of one config chose
// bf16 once and fp32 the next time.
constexpr double kLowerPrecisionGain = 0.1;
Plan fit(const PlanRequest& request, const StaticSizes& sizes,
         const std::map<engine::Precision, ChunkCosts>& costs, int64_t budget_bytes,
         double margin = 0.1);

// BatchNorm recomputation (ModelSpec::recompute_norm) chosen by the planner, from the costs
// calibrated without it (`plain`) and with it (`recomputed`; its precisions only: under autocast
// the plain sequence runs, so only fp32 is worth calibrating). Recomputing keeps about an eighth
// less per chunk for one elementwise pass per block: its plan is taken where it fits and the
// plain one does not, or where the larger chunk or keep it allows is predicted at least
// kRecomputeNormGain faster, both timed by the plain costs (probes cannot tell its elementwise
// pass from noise); where neither fits, the one needing less. request.model.recompute_norm is not
// read; settings.recompute_norm says which.
constexpr double kRecomputeNormGain = 0.05;
Plan fit_recompute_norm(const PlanRequest& request, const StaticSizes& sizes,
                        const std::map<engine::Precision, ChunkCosts>& plain,
                        const std::map<engine::Precision, ChunkCosts>& recomputed,
                        int64_t budget_bytes, double margin = 0.1);

// Peak and time across chunk sizes and precisions (keep, caching and accumulation as requested,
// or 1 / off / 1), for `framefit plan --table`.
struct TableRow {
  StepSettings settings;
  Breakdown breakdown;
  bool fits = false;
};
std::vector<TableRow> plan_table(const PlanRequest& request, const StaticSizes& sizes,
                                 const std::map<engine::Precision, ChunkCosts>& costs,
                                 int64_t budget_bytes, double margin = 0.1);

// "chunk 16, keep 1, bf16" and the like, for logs.
std::string describe(const StepSettings& settings, int64_t accumulate = 1);
// The advice's second part: "; it fits this budget if chunk, keep, caching and accumulation are
// left to the planner (auto): <settings>".
std::string fits_when_auto(const StepSettings& settings, int64_t accumulate = 1);

// Never out of memory: a TrainingStep replanner that, after an out-of-memory error, corrects
// the model by what the failure showed (at least in-use + requested bytes were needed where it
// predicted less) and re-plans chunk, keep and caching under the same budget for the same
// step; every setting may change then, even ones the user fixed. Falls back to halving the
// chunk when the corrected model finds nothing.
engine::Replanner make_replanner(PlanRequest request, StaticSizes sizes, ChunkCosts costs,
                                 engine::Precision precision, int64_t budget_bytes,
                                 double margin = 0.1);

// The largest chunk that fits: chosen from the model with `headroom` (0.1 = 10% of the budget
// left over), confirmed by one real step; if the step runs out of memory or leaves less than
// the headroom, the model is scaled by what was measured and the next choice tried.
struct ChunkTrial {
  bool out_of_memory = false;
  int64_t peak_bytes = 0;
  double seconds = 0;
};
struct LargestChunk {
  bool found = false;
  int64_t chunk = 0;
  int64_t predicted_peak_bytes = 0;
  int64_t measured_peak_bytes = 0;
  int trials = 0;
  std::vector<std::string> log;
};
LargestChunk find_largest_chunk(const PlanRequest& request, const StaticSizes& sizes,
                                const ChunkCosts& costs, engine::Precision precision,
                                int64_t budget_bytes, double headroom,
                                const std::function<ChunkTrial(int64_t chunk)>& run_step,
                                int max_trials = 4);

// Bytes no setting can go below: parameters, gradients, optimizer state, one video's frames
// and features. Needs no calibration.
int64_t static_minimum_bytes(const StaticSizes& sizes, int64_t frames);

// Batch networks (clip classifiers, UNets, any chain of stages): the largest batch whose
// training step fits a budget, with or without layer checkpointing. Like fit(), a pure function
// of measured costs.
struct BatchCosts {
  int64_t static_bytes = 0;            // parameters, buffers, gradients, optimizer state
  int64_t library_bytes = 0;           // the device's math libraries' workspaces (CUDA)
  int64_t input_bytes_per_sample = 0;  // the batch's input and labels
  // Stage costs at a batch of b samples: fixed + b x per_sample (from two measured batches;
  // fixed holds what does not grow with the batch, such as autocast's weight copies).
  std::vector<engine::StageCost> fixed;
  std::vector<engine::StageCost> per_sample;
  int64_t max_segment_stages = 0;  // plan_chain's limit (1 for a UNet)
  // Measured at batch 1 where the lines are drawn from larger batches: at(1) is never below it
  // (oneDNN's weight gradient takes a workspace while the batch has fewer samples than threads).
  std::vector<engine::StageCost> single;
  // A batch that ran out of memory while being measured (0: none): plans stay below it.
  int64_t failed_batch = 0;
  std::vector<engine::StageCost> at(int64_t batch) const;
  // Through measurements at batches b1 < b2, never below them: a cost that falls from b1 to b2
  // stays at its b1 value, one that grows faster than proportionally follows the line through
  // (0, 0) and its b2 value.
  static BatchCosts through(int64_t b1, const std::vector<engine::StageCost>& c1, int64_t b2,
                            const std::vector<engine::StageCost>& c2);
};
struct BatchPlan {
  int64_t batch = 0;        // 0: not even one sample fits
  ChainPlan chain;          // what to recompute at that batch
  int64_t predicted_peak_bytes = 0;
  int64_t minimum_bytes_one_sample = 0;  // with the most checkpointing allowed
};
// The predicted peak of a batch: static + inputs + the chain plan's activation memory.
int64_t batch_peak_bytes(const BatchCosts& costs, int64_t batch, const ChainPlan& chain);
// What a batch plan may recompute: nothing (train.checkpointing off), what the budget needs
// (auto), or every stage (all; which can hold more than nothing recomputed, so the batch is
// planned for it).
enum class Recompute { Nothing, AsNeeded, EveryStage };
Recompute parse_recompute(const std::string& checkpointing);  // off | auto | all
std::string to_string(Recompute recompute);                   // off | auto | all
// The largest batch that fits; `max_batch` bounds the search.
BatchPlan plan_batch(const BatchCosts& costs, int64_t budget_bytes, Recompute recompute,
                     int64_t max_batch = 4096);
// The chain plan for a given batch (with AsNeeded, checkpointing only if needed to fit). With
// micro_batches > 1 the batch runs in that many pieces: activations of one piece
// (ceil(batch / micro_batches) samples) beside the whole batch's inputs.
ChainPlan plan_batch_chain(const BatchCosts& costs, int64_t batch, int64_t budget_bytes,
                           Recompute recompute, int64_t micro_batches = 1);
// The chain plan that holds the least activation memory for `samples` at once (any time): what
// one sample needs at the least, and what a step that ran out of memory falls back on.
ChainPlan least_memory_chain(const BatchCosts& costs, int64_t samples);

// Predicted peak memory per batch size (seeds/003's table), without checkpointing and with the
// chain plan `recompute` allows for the budget, at batches 1, 2, 4, ... up to twice `largest`
// (the largest batch that fits) and at `largest` and the batch after it.
struct BatchRow {
  int64_t batch = 0;
  int64_t plain_peak_bytes = 0;    // nothing recomputed
  int64_t planned_peak_bytes = 0;  // the chain plan for the budget (the least memory if none fits)
  int64_t recomputed_stages = 0;
  bool fits = false;
};
std::vector<BatchRow> batch_table(const BatchCosts& costs, int64_t budget_bytes,
                                  Recompute recompute, int64_t largest);

}  // namespace framefit::plan
