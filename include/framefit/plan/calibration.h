#pragma once
// Calibrating the memory model: short probe runs of the real encoder and head on the target
// device, measured with the tracking allocator, and a small versioned cache file so each
// (model, size, precision, device) is probed once per machine.
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "framefit/memory/tracker.h"
#include "framefit/plan/memory_model.h"
#include "framefit/plan/planner.h"

namespace framefit::plan {

struct CalibrationOptions {
  // Frames per probed chunk: two chunk sizes give each cost's constant and per-frame part.
  std::vector<int64_t> chunk_frames = {4, 12};
  std::vector<int64_t> head_frames = {128, 512};
  int64_t repeats = 2;  // per probe; the fastest time counts, memory from the last
  uint64_t seed = 0;
  // Told after each of the four probes ("probe 2 of 4: the encoder on 12 frames, 3.1 s"): a
  // calibration takes seconds to a minute.
  std::function<void(const std::string&)> on_progress;
};

// Runs the probes (this allocates: a model, a few chunks of frames, their activations),
// measured on `tracker`, the tracker of spec.device.
ChunkCosts calibrate(const ModelSpec& spec, engine::Precision precision, memory::Tracker& tracker,
                     const CalibrationOptions& options = {});
// The same probes on a given encoder of `feature_dim` features per frame (a TorchScript module):
// spec supplies the frame size, head, device and dtype; spec.model is not read. The probes run
// forward passes with grad and set parameter gradients: pass a copy of the trained encoder.
ChunkCosts calibrate(const ModelSpec& spec, const engine::FrameEncoder& encoder,
                     int64_t feature_dim, engine::Precision precision, memory::Tracker& tracker,
                     const CalibrationOptions& options = {});

// Calibrations stored as JSON: {"format": "framefit-calibration", "version": N, "entries":
// {key: costs}}. A file of another version is ignored (and rewritten), never misread.
class CalibrationCache {
 public:
  // 2: accumulate_peak; 3: time lines clamped at 0; 4: the LSTM head's own CPU layer and bf16
  // BatchNorm inputs changed what the head and a bf16 chunk cost; 5: one_frame_seconds.
  static constexpr int kVersion = 5;
  // The default file: $FRAMEFIT_CACHE_DIR/calibration.json, else
  // $XDG_CACHE_HOME/framefit/calibration.json, else ~/.cache/framefit/calibration.json.
  static std::string default_path();

  explicit CalibrationCache(std::string path);
  const std::string& path() const { return path_; }
  std::optional<ChunkCosts> find(const std::string& key) const;
  void put(const std::string& key, const ChunkCosts& costs);
  void save() const;  // atomically (temp file, rename); creates the directory

 private:
  std::string path_;
  std::map<std::string, ChunkCosts> entries_;
};

// Where the calibrations a cache lacks are made: probes measured on `tracker` (the tracker of
// the device the spec names), saved in `cache`, each told to `on_probe` (they take seconds).
struct Calibrator {
  CalibrationCache& cache;
  memory::Tracker& tracker;
  std::function<void(const std::string&)> on_probe;
};

// The costs for `spec` at each precision: from the cache, or calibrated (and saved) when
// missing.
std::map<engine::Precision, ChunkCosts> calibrated_costs(
    const ModelSpec& spec, const std::vector<engine::Precision>& precisions,
    const Calibrator& calibrator, const CalibrationOptions& options = {});

// The plan with BatchNorm recomputation chosen too (fit_recompute_norm), where the encoder takes
// it (spec.takes_recompute_norm()) and `request` allows fp32 (under autocast the plain sequence
// runs): the costs with it from the cache or calibrated. `costs` are request.model's (plain);
// request.model.recompute_norm and `costs` become those of the choice, which the encoder is built
// with and the out-of-memory replanner plans with. Elsewhere plain fit().
Plan fit_choosing_recompute_norm(PlanRequest& request, const StaticSizes& sizes,
                                 std::map<engine::Precision, ChunkCosts>& costs,
                                 const Calibrator& calibrator, int64_t budget_bytes, double margin);

// `plan` measured at its own chunk where that lies well beyond the probes (over twice the larger
// probed chunk): the costs at its precision calibrated again through the larger probe and the
// planned chunk (cached under the key and that chunk), and the plan made again from them, until
// its chunk is one measured (at most three rounds). Lines through 4 and 12 frames alone missed
// oneDNN's larger workspaces at 256 frames (bf16 on AVX-512): the demo's steps peaked 9% above
// the plan. `costs` become those the returned plan was made with (the replanner's).
Plan refit_at_planned_chunk(const PlanRequest& request, const StaticSizes& sizes,
                            std::map<engine::Precision, ChunkCosts>& costs,
                            const Calibrator& calibrator, Plan plan, int64_t budget_bytes,
                            double margin, const CalibrationOptions& options = {});

// The plan `train` and `plan` make: BatchNorm recomputation chosen where `choose_norm`
// (fit_choosing_recompute_norm, else fit), then measured at its own chunk
// (refit_at_planned_chunk). Where settings the request fixes keep it from fitting, the advice's
// "fits if left to the planner" is the plan this same path makes with them auto, so that it
// names what the auto plan chooses. `request` and `costs` change as those functions say.
Plan plan_chunked_step(PlanRequest& request, const StaticSizes& sizes,
                       std::map<engine::Precision, ChunkCosts>& costs, const Calibrator& calibrator,
                       int64_t budget_bytes, double margin, bool choose_norm);

// Bytes that training `module` holds whatever the batch: parameters, buffers, gradients of the
// trained parameters and the optimizer's state (sgd: momentum, one copy; adam/adamw: two).
int64_t training_static_bytes(const torch::nn::Module& module, const std::string& optimizer);

// Calibrates a batch network (clip classifier, UNet) for plan_batch: each stage's cost measured
// at batches 1 and 2 and, wherever their line leads past batch 2 within the budget, again toward
// half that batch, the lines then drawn from batch 2 (batch 1 alone can take a workspace or skip
// one: oneDNN's algorithms depend on the batch and thread count). A batch that runs out of memory
// while measured caps the plan below it. `inputs(b)` makes b samples of input on the device.
// Runs forward passes with grad under `precision`, so BatchNorm statistics move: calibrate a copy
// of the network, not the one being trained. Measured on `tracker`, the tracker of the device
// the network and its inputs are on.
BatchCosts calibrate_batch(const engine::ChainNetwork& network,
                           const std::function<torch::Tensor(int64_t)>& inputs,
                           int64_t static_bytes, int64_t input_bytes_per_sample,
                           int64_t budget_bytes, memory::Tracker& tracker,
                           engine::Precision precision);
// The same for evaluating it as validation does (eval mode, no grad, under `precision`): one
// stage that keeps nothing, whose peak is the forward pass's, for plan_batch without
// checkpointing. Measures batches up to half of `max_batch`; leaves the network in its mode.
BatchCosts calibrate_inference(const engine::ChainNetwork& network,
                               const std::function<torch::Tensor(int64_t)>& inputs,
                               int64_t static_bytes, int64_t input_bytes_per_sample,
                               int64_t budget_bytes, memory::Tracker& tracker,
                               engine::Precision precision, int64_t max_batch);

}  // namespace framefit::plan
