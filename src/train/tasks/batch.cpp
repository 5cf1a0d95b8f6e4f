// The batch task, clips and segmentation alike: a network (a layer list, R3D-18, R(2+1)D-18, a
// UNet or a TorchScript module) trained on batches of samples (tasks/clips.cpp,
// tasks/segmentation.cpp), the batch and layer checkpointing planned for the budget; its model,
// checkpoint record, evaluation and run.
#include "framefit/train/tasks.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <utility>

#include "../run_files.h"
#include "../run_loop.h"
#include "batch_data.h"
#include "batch_record.h"
#include "framefit/data/clips.h"
#include "framefit/data/dataset.h"
#include "framefit/data/media.h"
#include "framefit/data/segmentation.h"
#include "framefit/engine/batch_step.h"
#include "framefit/engine/extract.h"
#include "framefit/engine/step.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/conv3d.h"
#include "framefit/models/network.h"
#include "framefit/models/norm_relu_conv.h"
#include "framefit/models/resnet.h"
#include "framefit/models/torchscript.h"
#include "framefit/models/unet.h"
#include "framefit/models/video_resnet.h"
#include "framefit/models/weights.h"
#include "framefit/plan/calibration.h"
#include "framefit/plan/planner.h"
#include "task_kinds.h"

namespace framefit::train {

namespace {

using namespace detail;

engine::Precision batch_precision(const Config& config) {
  // auto: fp32. bf16 or fp16 trade precision for a larger batch; the user chooses that.
  const auto precision = config.train.precision.value_or(engine::Precision::FP32);
  engine::check_runs_on(precision, torch::Device(config.device));
  return precision;
}

// The evaluation batch: a train.eval_batch count (on resume and in framefit eval too), else the
// one the checkpoint's run planned.
int64_t evaluation_batch(const Config& config, const BatchProgress& progress) {
  return std::max<int64_t>(1, config.train.eval_batch.value_or(progress.eval_batch));
}

// The logits of `samples`. A forward pass that runs out of memory is run again on each half of
// its samples (in eval mode a sample's logits do not depend on the others in its batch), and
// `model.batch` lowered to the size that ran, so later batches start there.
torch::Tensor evaluation_logits(BatchModel& model, const torch::Tensor& samples,
                                const std::vector<engine::ChainSegment>& segments,
                                const EventCallback& on_event) {
  const int64_t n = samples.size(0);
  try {
    engine::AutocastGuard autocast(model.device, model.precision);
    return model.network.forward(batch_input(model, samples), segments);
  } catch (const std::exception& e) {
    if (n == 1 || !memory::is_out_of_memory(e)) throw;
  }
  const int64_t half = (n + 1) / 2;
  if (half < model.batch) {
    model.batch = half;
    if (on_event) {
      on_event(
          Event::note(Event::Kind::Warning, c10::str("evaluation ran out of memory at a batch of ",
                                                     n, "; continuing with batches of ", half)));
    }
  }
  return torch::cat(
      {evaluation_logits(model, samples.narrow(0, 0, half), segments, on_event),
       evaluation_logits(model, samples.narrow(0, half, n - half), segments, on_event)});
}

// `prefetch_bytes`: decoded samples held ahead (within a training budget, its prefetch reserve).
PhaseMetrics evaluate_data(BatchModel& model, const BatchData& data, const EventCallback& on_event,
                           int64_t prefetch_bytes) {
  ConfusionMatrix confusion(model.classes.size());
  torch::NoGradGuard no_grad;
  model.network.module->eval();
  SampleStream stream(data, data.order(0, 0, false), 0, 0, 0,
                      static_cast<int>(model.config.data.workers), prefetch_bytes);
  const auto start = Clock::now();
  int64_t done = 0, samples = 0;
  const auto segments = engine::store_all(model.network.stage_count());
  while (!stream.done()) {
    auto batch = stream.next(model.batch);
    for (const auto& w : batch.warnings) {
      if (on_event) on_event(Event::note(Event::Kind::Warning, w));
    }
    if (!batch.samples.defined()) continue;
    const auto logits = evaluation_logits(model, batch.samples, segments, on_event);
    auto predicted = logits.argmax(1).cpu().flatten();
    auto truth = batch.labels.flatten();
    if (const int64_t ignore = model.config.data.ignore_id; ignore >= 0) {
      const auto counted = truth.ne(ignore);
      predicted = predicted.masked_select(counted);
      truth = truth.masked_select(counted);
    }
    confusion.add(predicted, truth);
    samples += batch.samples.size(0);
    if (on_event) {
      Event e;
      e.kind = Event::Kind::Evaluate;
      e.step = ++done;
      e.total_steps =
          done + (std::max<int64_t>(0, data.samples() - samples) + model.batch - 1) / model.batch;
      e.elapsed_seconds = seconds_since(start);
      e.frames_per_second = samples / std::max(1e-9, e.elapsed_seconds);
      e.rate_unit = "samples";
      on_event(e);
    }
  }
  return confusion.metrics();
}

// diagnose_task_settings' errors refuse the config before any data is read.
void check_train_settings(const Config& config) {
  plan::refuse_errors(diagnose_task_settings(config));
}

int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t size : shape) n *= size;
  return n;
}

// Per sample of a batch: the stored uint8 sample and int64 label(s).
int64_t stored_sample_bytes(const Config& config, const std::vector<int64_t>& input) {
  return elements(input) + (config.task == "clips" ? 8 : 8 * input[1] * input[2]);
}

// Random network inputs of b samples of shape `input`, for calibration.
std::function<torch::Tensor(int64_t)> random_samples(const std::vector<int64_t>& input,
                                                     torch::Device device) {
  return [input, device](int64_t b) {
    std::vector<int64_t> shape = {b};
    shape.insert(shape.end(), input.begin(), input.end());
    return torch::randn(shape, torch::TensorOptions().device(device));
  };
}

// Evaluation batches beyond this only delay the first result on the CPU (time per sample is
// flat from batch 4 on: demo clips 2.7-3.0 ms); 64 still leaves a GPU room to fill.
constexpr int64_t kMaxEvalBatch = 64;

// The evaluation batch (train.eval_batch): without grad nothing is kept for a backward pass, so
// it is planned on its own, from the probe's forward passes in eval mode, within what training
// leaves (its static memory stays while validating).
void plan_evaluation(BatchTaskPlan& plan, const Config& config, const BatchModel& probe,
                     memory::Tracker& tracker) {
  if (const auto fixed = config.train.eval_batch) {
    plan.eval_batch = *fixed;
    return;
  }
  const auto costs = plan::calibrate_inference(
      probe.network, random_samples(plan.input, tracker.device()), plan.static_bytes,
      stored_sample_bytes(config, plan.input) + 4 * elements(plan.input), plan.budget.step, tracker,
      plan.precision, kMaxEvalBatch);
  const auto planned =
      plan::plan_batch(costs, plan.budget.step, plan::Recompute::Nothing, kMaxEvalBatch);
  // Not even one sample: evaluation splits batches that run out of memory down to one sample.
  plan.eval_batch = std::max<int64_t>(1, planned.batch);
  plan.eval_peak_bytes = planned.predicted_peak_bytes;
}

// A resumed run's step settings, checked against a changed budget by plan_training: `peak` is
// their predicted peak, `evaluated` false where the plan's calibration could not tell (their
// convolution backward was not among those planned).
struct HeldSettings {
  const BatchProgress& progress;
  bool evaluated = false;
  int64_t peak = 0;
};

// plan_training with BatchNorm recomputation and time slicing as `save_memory` says (set on the
// probe, where the network has them).
BatchTaskPlan plan_training_with(bool save_memory, const Config& config, const BatchData& data,
                                 const std::vector<int64_t>& input, memory::Tracker& tracker,
                                 const TrainingBudget& budget, BatchModel& probe,
                                 HeldSettings* held) {
  const auto& tc = config.train;
  const auto device = tracker.device();
  const int64_t step_budget = budget.step;
  const bool recompute_norm =
      models::set_recompute_norm(*probe.network.module, save_memory) > 0 && save_memory;
  const int64_t time_slices = save_memory ? models::kTimeSlices : 0;
  const bool sliced =
      models::set_time_slices(*probe.network.module, time_slices) > 0 && save_memory;
  const auto fixed_batch = tc.batch;
  TORCH_CHECK(!fixed_batch || *fixed_batch > 0,
              "train.batch: 0 samples per batch; use auto or a count");
  BatchTaskPlan plan;
  plan.input = input;
  plan.samples = data.samples();
  plan.accumulate = tc.accumulate;
  plan.precision = batch_precision(config);
  plan.budget = budget;
  plan.cuda_budget = device.is_cuda();
  plan.checkpointing = plan::to_string(tc.checkpointing);
  plan.recompute_norm = recompute_norm;
  plan.time_slices = sliced ? time_slices : 0;
  const int64_t stages = probe.network.stage_count();
  plan.static_bytes = plan::training_static_bytes(*probe.network.module, tc.optimizer);
  const bool has_lean = models::set_lean_backward(*probe.network.module,
                                                  config.model.lean_backward.value_or(true)) > 0;
  plan.lean_backward = has_lean && config.model.lean_backward.value_or(true);
  if (fixed_batch && tc.checkpointing != plan::Recompute::AsNeeded) {  // nothing to choose
    plan.batch = plan.largest_batch = *fixed_batch;
    plan.segments = tc.checkpointing == plan::Recompute::EveryStage
                        ? engine::recompute_every(stages, 1)
                        : engine::store_all(stages);
    return plan;
  }
  plan.planned = true;
  bool probe_lean = plan.lean_backward;  // the probe's convolution backward as calibrated
  const auto recompute = tc.checkpointing;
  // The batch and recomputation for the probe's measured costs; `fits`: whether that batch fits.
  const auto plan_measured = [&](BatchTaskPlan p, bool& fits) {
    // Per sample of a batch: the stored samples and labels of the optimizer step's
    // train.accumulate batches, and the float input of the batch being run. On CUDA the stored
    // batches stay in host memory: the device holds the running batch's copy of them.
    const int64_t stored_batches = device.is_cpu() ? p.accumulate : 1;
    const auto costs = plan::calibrate_batch(
        probe.network, random_samples(input, device), p.static_bytes,
        stored_sample_bytes(config, input) * stored_batches + 4 * elements(input), step_budget,
        tracker, p.precision);
    // The largest batch that fits: the plan's unless train.batch fixes it; the table's either way.
    const auto planned = plan::plan_batch(costs, step_budget, recompute);
    p.table = plan::batch_table(costs, step_budget, recompute, planned.batch);
    if (held && held->progress.lean_backward == probe_lean &&
        held->progress.recompute_norm == recompute_norm &&
        held->progress.time_slices == p.time_slices) {
      const auto& h = held->progress;
      const auto chain = plan::evaluate_chain(
          costs.at((h.batch + h.micro_batches - 1) / h.micro_batches), h.segments);
      held->evaluated = true;
      held->peak = plan::batch_peak_bytes(costs, h.batch, chain);
    }
    if (fixed_batch) {
      // More than the samples would only be an epoch's worth of them.
      p.batch = p.largest_batch = std::min(*fixed_batch, p.samples);
    } else {
      p.minimum_bytes_one_sample = planned.minimum_bytes_one_sample;
      p.largest_batch = planned.batch;
      p.batch = std::min(planned.batch, p.samples);
      fits = p.batch > 0;
      if (p.batch == 0) return p;
    }
    auto chain = plan::plan_batch_chain(costs, p.batch, step_budget, recompute);
    // A fixed batch that does not fit: the fewest micro-batches whose activations fit beside
    // the whole batch's inputs (counted in full: conservative for the float input).
    const bool may_checkpoint = recompute != plan::Recompute::Nothing;
    for (int64_t m = 2; fixed_batch && !chain.fits && may_checkpoint && m <= p.batch; ++m) {
      auto micro = plan::plan_batch_chain(costs, p.batch, step_budget, recompute, m);
      if (micro.fits) {
        chain = std::move(micro);
        p.micro_batches = m;
      }
    }
    fits = chain.fits;
    const int64_t micro_batch = (p.batch + p.micro_batches - 1) / p.micro_batches;
    p.segments = chain.segments;
    p.fallback_segments = plan::least_memory_chain(costs, micro_batch).segments;
    const auto evaluated = plan::evaluate_chain(costs.at(micro_batch), p.segments);
    p.input_bytes = costs.input_bytes_per_sample * p.batch;
    p.library_bytes = costs.library_bytes;
    p.activation_bytes = evaluated.predicted_bytes;
    p.predicted_peak_bytes = plan::batch_peak_bytes(costs, p.batch, evaluated);
    return p;
  };
  // The lean convolution backward (models/conv3d.h) holds less but is slower: with
  // model.lean_backward auto, oneDNN's backward is planned first and the lean one taken only
  // where it fits at least twice the batch, or a fixed batch oneDNN's does not fit.
  const bool lean_can_matter = plan.lean_backward && device.is_cpu() &&
                               plan.precision == engine::Precision::FP32 &&
                               !config.model.lean_backward.has_value();
  bool fits = false;
  if (!lean_can_matter) return plan_measured(plan, fits);
  models::set_lean_backward(*probe.network.module, probe_lean = false);
  auto fast = plan_measured(plan, fits);
  fast.lean_backward = false;
  // No convolution small enough for it (layer4 of larger clips): nothing to compare.
  if (models::lean_applicable_calls(*probe.network.module) == 0) return fast;
  const bool fast_fits = fits;
  models::set_lean_backward(*probe.network.module, probe_lean = true);
  const auto lean = plan_measured(plan, fits);
  // Its backward measured 1.1-2.5x slower per step: worth it for at least twice the batch.
  const bool take_lean =
      lean.batch >= 2 * std::max<int64_t>(1, fast.batch) || (fixed_batch && fits && !fast_fits);
  return take_lean ? lean : fast;
}

// The training batch, recomputation and convolution backward (plan_for). BatchNorm and ReLU are
// recomputed (models/norm_relu_conv.h), and convolutions followed by pooling sliced along time
// (models/network.h), with train.checkpointing all, and with auto unless a fixed batch fits
// without recomputing anything: the first costs one elementwise pass per such layer, the second
// nothing measurable (bench/results/layers.md).
BatchTaskPlan plan_training(const Config& config, const BatchData& data,
                            const std::vector<int64_t>& input, memory::Tracker& tracker,
                            const TrainingBudget& budget, BatchModel& probe, HeldSettings* held) {
  const int64_t step_budget = budget.step;
  const auto& tc = config.train;
  auto& module = *probe.network.module;
  const bool saves_memory =
      tc.checkpointing != plan::Recompute::Nothing &&
      (models::set_recompute_norm(module, false) > 0 || models::set_time_slices(module, 0) > 0);
  const auto plan_with = [&](bool save_memory) {
    return plan_training_with(save_memory, config, data, input, tracker, budget, probe, held);
  };
  if (!saves_memory) return plan_with(false);
  if (tc.checkpointing == plan::Recompute::AsNeeded && tc.batch) {
    auto plain = plan_with(false);
    const auto flags = engine::recomputed(plain.segments);
    if (plain.micro_batches == 1 && std::count(flags.begin(), flags.end(), true) == 0 &&
        plain.predicted_peak_bytes <= step_budget) {
      return plain;
    }
  }
  return plan_with(true);
}

// The batch and checkpointing for `config` on `data`'s samples, and the evaluation batch:
// calibrated on a probe copy before the trained model exists (calibration runs forward passes
// that move BatchNorm statistics and the random generator, which must not touch the run).
BatchTaskPlan plan_for(const Config& config, const BatchData& data,
                       const std::vector<int64_t>& input, memory::Tracker& tracker,
                       const TrainingBudget& resolved, HeldSettings* held = nullptr) {
  const int64_t budget = resolved.tensors;
  // Weights that cannot fit are named before the probe allocates them: a layer list's 30 GiB
  // convolution ended in the system's out-of-memory error instead of the doctor's finding.
  if (network_kind(config) == "layers") {
    plan::NetworkTraining training;
    training.optimizer = config.train.optimizer;
    plan::refuse_errors(
        plan::diagnose_network_weights(config.model.layers, input, training, budget));
  } else {
    plan::refuse_errors(diagnose_batch_task(config, budget));
  }
  auto probe = build_batch_model(config, input);
  probe.network.module->train();
  auto plan = plan_training(config, data, input, tracker, resolved, probe, held);
  if (plan.batch > 0) plan_evaluation(plan, config, probe, tracker);
  return plan;
}

}  // namespace

std::string network_kind(const Config& config) {
  if (!config.model.network.empty()) return config.model.network;
  if (config.task == "segmentation") return "unet";
  return config.model.layers.empty() ? "r3d_18" : "layers";
}

std::vector<int64_t> configured_sample_shape(const Config& config) {
  if (config.task == "clips" && config.data.crop > 0) {
    return {3, config.data.clip_length, config.data.crop, config.data.crop};
  }
  if (config.task == "segmentation" && config.data.resize > 0) {
    return {3, config.data.resize, config.data.resize};
  }
  return {};
}

namespace {

// build_batch_model with a TorchScript network loaded from a checkpoint instead of model.script.
BatchModel build_batch_model(const Config& config, const std::vector<int64_t>& input,
                             std::shared_ptr<models::TorchScriptEncoderImpl> stored_script) {
  TORCH_CHECK(is_batch_task(config), "build_batch_model is for task clips or segmentation, not ",
              config.task);
  TORCH_CHECK(!config.data.classes.empty(), "data.classes is not set: list the class names");
  BatchModel model;
  model.config = config;
  model.classes = data::ClassList(config.data.classes);
  model.input = input;
  model.device = torch::Device(config.device);
  model.precision = batch_precision(config);
  if (model.device.is_cpu() && model.precision == engine::Precision::FP16) {
    model.precision = engine::Precision::FP32;  // inference: fp16 autocast is not a CPU thing
  }
  torch::manual_seed(config.train.seed);
  const int64_t classes = model.classes.size();
  const auto kind = network_kind(config);
  const bool clips = config.task == "clips";
  if (kind == "r3d_18" || kind == "r2plus1d_18") {
    TORCH_CHECK(clips, "model.network ", kind,
                " classifies clips: use task clips, or model.network unet for segmentation");
    auto video =
        models::VideoResNet(models::VideoResNetOptions(kind).num_classes(classes).lean_backward(
            config.model.lean_backward.value_or(true)));
    if (!config.model.weights.empty()) {
      const auto report = load_model_weights(*video, config, false);
      bool only_fc = report.unexpected.empty() && report.mismatched.empty();
      for (const auto& name : report.missing) only_fc = only_fc && name.rfind("fc.", 0) == 0;
      TORCH_CHECK(only_fc, "model.weights ", config.model.weights, " does not fit ", kind, ": ",
                  report.describe());
    }
    model.network = engine::chain_network(video.ptr());
  } else if (kind == "unet") {
    TORCH_CHECK(!clips, "model.network unet segments images: use task segmentation");
    TORCH_CHECK(input.size() == 3, "a UNet takes images [C,H,W], got a sample of ",
                models::format_shape(input));
    TORCH_CHECK(config.model.weights.empty(),
                "model.weights: a UNet starts from random weights here (resume a run instead)");
    auto unet = models::UNet(models::UNetOptions()
                                 .in_channels(input[0])
                                 .classes(classes)
                                 .width(config.model.width)
                                 .depth(config.model.depth)
                                 .norm(models::parse_norm_kind(config.model.norm))
                                 .groups(std::min(config.model.groups, config.model.width))
                                 .bilinear(config.model.bilinear));
    try {  // a meta tensor: shapes only, nothing allocated
      unet->check_input(torch::empty({1, input[0], input[1], input[2]},
                                     torch::TensorOptions().device(torch::kMeta)));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "images of ", input[1], "x", input[2],
                  " (data.resize): ", e.what_without_backtrace());
    }
    model.network = engine::chain_network(unet.ptr());
  } else if (kind == "layers") {
    TORCH_CHECK(!config.model.layers.empty(),
                "model.network layers needs model.layers: the network as a list of layers");
    TORCH_CHECK(config.model.input.empty() || config.model.input == input, "model.input ",
                models::format_shape(config.model.input), " differs from the data's samples, ",
                models::format_shape(input), ": fix model.input or the data settings");
    const auto shapes = models::infer_shapes(config.model.layers, input);
    std::vector<int64_t> wanted = {classes};
    if (!clips) wanted.insert(wanted.end(), input.begin() + 1, input.end());
    auto network = models::Network(models::NetworkOptions(config.model.layers, input)
                                       .lean_backward(config.model.lean_backward.value_or(true)));
    TORCH_CHECK(shapes.output == wanted, "model.layers: the network's output per sample is ",
                models::format_shape(shapes.output), " but task ", config.task, " needs ",
                models::format_shape(wanted), " (one score per class", clips ? "" : " and pixel",
                ")");
    model.network = engine::chain_network(network.ptr());
  } else {
    TORCH_CHECK(!config.model.script.empty(),
                "model.network torchscript needs model.script: the file torch.jit.save wrote");
    auto module = stored_script
                      ? std::move(stored_script)
                      : models::TorchScriptEncoder(config.model.script, model.device).ptr();
    model.network = engine::chain_network(
        module, [module](const torch::Tensor& x) { return module->forward(x); });
  }
  model.network.module->to(model.device);
  return model;
}

}  // namespace

BatchModel build_batch_model(const Config& config, const std::vector<int64_t>& input) {
  return build_batch_model(config, input, nullptr);
}

torch::Tensor batch_input(const BatchModel& model, const torch::Tensor& samples) {
  engine::FrameNormalization normalization;
  const auto kind = network_kind(model.config);
  if (kind == "r3d_18" || kind == "r2plus1d_18") {
    normalization.mean = {0.43216, 0.394666, 0.37645};  // torchvision's video models (Kinetics)
    normalization.std = {0.22803, 0.22145, 0.216989};
  }
  // frames_to_input normalises [N,3,H,W]; a clip's time axis folds into the height.
  const auto sizes = samples.sizes().vec();
  auto flat = samples.reshape({sizes[0], sizes[1], -1, sizes.back()});
  return engine::frames_to_input(flat, model.device, torch::kFloat32, false, normalization)
      .view(sizes);
}

BatchModel load_batch_model(const std::string& checkpoint,
                            const std::vector<std::string>& overrides) {
  auto archive = open_archive(checkpoint);
  Config config = read_config(archive, checkpoint);
  config = config_with_overrides(config, checkpoint, overrides);
  TORCH_CHECK(is_batch_task(config), checkpoint, " is a ", config.task,
              " checkpoint: load it with load_model");
  config.model.weights.clear();  // the checkpoint has the weights
  torch::Tensor input;
  archive.read("input", input);
  BatchModel model = build_batch_model(
      config,
      std::vector<int64_t>(input.data_ptr<int64_t>(), input.data_ptr<int64_t>() + input.numel()),
      network_kind(config) == "torchscript"
          ? read_script(archive, checkpoint, torch::Device(config.device))
          : nullptr);
  load_module(*model.network.module, archive, "network", checkpoint, stored_config_with(overrides));
  model.network.module->to(model.device);
  const auto progress = read_batch_progress(archive, checkpoint);
  model.precision = progress.precision;
  if (model.device.is_cpu() && model.precision == engine::Precision::FP16)
    model.precision = engine::Precision::FP32;
  model.batch = evaluation_batch(config, progress);
  // Its evaluation batch was planned with the run's slicing.
  models::set_time_slices(*model.network.module, progress.time_slices);
  return model;
}

PhaseMetrics evaluate_batch(BatchModel& model, const std::string& split,
                            const EventCallback& on_event) {
  const auto data = batch_data_with_samples(model.config, split, false, on_event);
  return evaluate_data(model, *data, on_event, model.config.data.prefetch_bytes);
}

torch::Tensor predict_batch(BatchModel& model, const torch::Tensor& samples,
                            const EventCallback& on_event) {
  TORCH_CHECK(samples.dim() == static_cast<int64_t>(model.input.size()) + 1 &&
                  samples.sizes().slice(1) == c10::IntArrayRef(model.input),
              "the network takes samples of ", c10::IntArrayRef(model.input), "; got ",
              samples.sizes().slice(1));
  torch::NoGradGuard no_grad;
  model.network.module->eval();
  const auto segments = engine::store_all(model.network.stage_count());
  std::vector<torch::Tensor> parts;
  for (int64_t begin = 0, n = samples.size(0); begin < n;) {
    const int64_t count = std::min(model.batch, n - begin);
    const auto logits =
        evaluation_logits(model, samples.narrow(0, begin, count), segments, on_event);
    parts.push_back(torch::softmax(logits.to(torch::kFloat32), 1).cpu());
    begin += count;
  }
  return torch::cat(parts);
}

std::string BatchTaskPlan::describe() const {
  const auto recompute = engine::recomputed(segments);
  const auto count = std::count(recompute.begin(), recompute.end(), true);
  if (batch == 0) {
    return c10::str("training does not fit in ", describe_budget(budget),
                    ": one sample needs at least ", memory::format_bytes(minimum_bytes_one_sample),
                    " with the checkpointing plan that holds the least; raise train.budget or "
                    "shrink the input");
  }
  const std::string accumulated =
      (micro_batches > 1 ? c10::str(" in ", micro_batches, " micro-batches") : std::string()) +
      (accumulate > 1 ? c10::str(" (", accumulate, " per optimizer step)") : std::string());
  const std::string evaluation =
      eval_peak_bytes > 0 ? c10::str("; evaluation batch ", eval_batch, " (predicted peak ",
                                     memory::format_bytes(eval_peak_bytes), ")")
                          : c10::str("; evaluation batch ", eval_batch);
  if (!planned) {
    return c10::str("settings: batch ", batch, accumulated, ", checkpointing ", checkpointing, " (",
                    count, " of ", recompute.size(), " stages recomputed",
                    recompute_norm ? ", BatchNorm recomputed" : "",
                    time_slices > 0 ? c10::str(", ", time_slices, " time slices") : "",
                    "; fixed by the config, not planned)", evaluation);
  }
  return c10::str(
      "plan: batch ", batch, accumulated, ", ", count, " of ", recompute.size(),
      " stages recomputed, ", engine::to_string(precision),
      lean_backward ? ", lean convolution backward" : "",
      recompute_norm ? ", BatchNorm recomputed" : "",
      time_slices > 0 ? c10::str(", ", time_slices, " time slices") : "", ", predicted peak ",
      memory::format_bytes(predicted_peak_bytes), " of ", memory::format_bytes(budget.step),
      cuda_budget ? c10::str(" (budget ", memory::format_bytes(budget.tensors), " less ",
                             memory::format_bytes(budget.tensors - budget.step),
                             " for CUDA's caching allocator)")
                  : describe_step_budget(budget, predicted_peak_bytes),
      ": static ", memory::format_bytes(static_bytes),
      library_bytes > 0 ? c10::str(", CUDA libraries ", memory::format_bytes(library_bytes)) : "",
      ", inputs ", memory::format_bytes(input_bytes), ", activations ",
      memory::format_bytes(activation_bytes), evaluation);
}

namespace {

// How the planned batch runs (what describe_step reports), taken from a plan.
void take_step_settings(BatchProgress& progress, const BatchTaskPlan& plan) {
  progress.micro_batches = plan.micro_batches;
  progress.segments = plan.segments;
  progress.fallback_segments = plan.fallback_segments;
  progress.lean_backward = plan.lean_backward;
  progress.recompute_norm = plan.recompute_norm;
  progress.time_slices = plan.time_slices;
}

// "batch 8, 2 of 5 stages recomputed in 2 micro-batches, lean convolution backward, BatchNorm
// recomputed".
std::string describe_step(const BatchProgress& p) {
  const auto recompute = engine::recomputed(p.segments);
  int64_t nested = 0;
  for (const auto& s : p.segments) nested += s.nested ? s.end - s.begin : 0;
  return c10::str("batch ", p.batch, ", ", std::count(recompute.begin(), recompute.end(), true),
                  " of ", recompute.size(), " stages recomputed",
                  nested > 0 ? c10::str(" (", nested, " in nested segments)") : "",
                  p.micro_batches > 1 ? c10::str(" in ", p.micro_batches, " micro-batches") : "",
                  p.lean_backward ? ", lean convolution backward" : "",
                  p.recompute_norm ? ", BatchNorm recomputed" : "",
                  p.time_slices > 0 ? c10::str(", ", p.time_slices, " time slices") : "");
}

// A run resumed under another train.budget (`change` says which) holds its batch and precision,
// what it learns from; its recomputation, micro-batches and convolution backward stay the
// checkpoint's where they are predicted to fit the new budget (the run goes on as it would
// have), and are planned again for the held batch where not. The validation batch is planned
// again either way.
void replan_if_budget_changed(BatchProgress& progress, const std::string& change,
                              const Config& config, const BatchData& train_set,
                              const std::vector<int64_t>& input, memory::Tracker& tracker,
                              const TrainingBudget& budget, const EventCallback& on_event) {
  if (change.empty()) return;
  const int64_t step_budget = budget.step;
  const auto note = [&](Event::Kind kind, const std::string& message) {
    if (on_event) on_event(Event::note(kind, message));
  };
  auto held_config = config;
  held_config.train.batch = progress.batch;
  held_config.train.precision = progress.precision;
  HeldSettings held{progress};
  const auto plan = plan_for(held_config, train_set, input, tracker, budget, &held);
  progress.eval_batch = plan.eval_batch;
  const std::string kept = change + ": the checkpoint's " + describe_step(progress);
  if (!plan.planned) {
    note(Event::Kind::Info, kept + " is kept (train.checkpointing " +
                                plan::to_string(config.train.checkpointing) +
                                " with a batch leaves nothing to plan)");
    return;
  }
  const std::string step_budget_text = "the step budget " + memory::format_bytes(step_budget);
  const std::string predicted =
      held.evaluated ? kept + " is predicted to need " + memory::format_bytes(held.peak) : kept;
  if (held.evaluated && held.peak <= step_budget) {
    note(Event::Kind::Info, predicted + ", within " + step_budget_text +
                                "; kept, so the run goes on as it would have");
    return;
  }
  if (plan.predicted_peak_bytes > step_budget) {
    note(Event::Kind::Warning, predicted + "; nothing fits " + step_budget_text +
                                   " at that batch: kept (steps that run out of memory are "
                                   "retried with more micro-batches)");
    return;
  }
  take_step_settings(progress, plan);
  note(Event::Kind::Warning,
       predicted + (held.evaluated ? ", more than " + step_budget_text : std::string()) +
           "; re-planned to " + describe_step(progress) + " (predicted " +
           memory::format_bytes(plan.predicted_peak_bytes) +
           "): from here the run may differ from the uninterrupted one by rounding" +
           (progress.micro_batches > 1 ? " and BatchNorm's statistics per micro-batch" : ""));
}

// The validation split's data, where validation runs and the split has samples.
std::unique_ptr<BatchData> validation_data(const Config& config, const EventCallback& on_event) {
  std::unique_ptr<BatchData> val_set;
  if (config.train.validate) {
    val_set = batch_data(config, config.data.val_split, false, on_event);
    if (val_set->samples() == 0) val_set.reset();
  }
  return val_set;
}

// The largest unit a run loads, in training or validation.
int64_t largest_unit_bytes(const BatchData& train_set, const BatchData* val_set) {
  return std::max(train_set.largest_unit_bytes(), val_set ? val_set->largest_unit_bytes() : 0);
}

}  // namespace

BatchTaskPlan plan_batch_task(const Config& config, memory::Tracker& tracker,
                              const EventCallback& on_event) {
  TORCH_CHECK(is_batch_task(config), "plan_batch_task is for task clips or segmentation");
  check_train_settings(config);
  warn_if_budget_beyond_device(config, tracker, on_event);
  const auto data = batch_data_with_samples(config, config.data.train_split, true, on_event);
  // Resolved before the validation data is read, as training resolves it once its data is.
  const auto resolved = resolve_budget(config, tracker);
  const auto budget = for_largest_unit(
      config, resolved, largest_unit_bytes(*data, validation_data(config, on_event).get()));
  return plan_for(config, *data, data->sample_shape(), tracker, budget);
}

namespace {

// One clips or segmentation run: its data, the batch and recomputation planned for the budget
// (or a resumed checkpoint's), the network, its optimizer and step.
class BatchRun final : public TaskRun {
 public:
  BatchRun(const Config& config, const RunStart& start, memory::Tracker& tracker,
           const EventCallback& on_event);

  const Config& config() const override { return config_; }
  RunPosition& position() override { return progress_; }
  TrainingBudget budget() const override { return budget_; }
  int64_t steps_per_epoch() const override {
    return (train_set_->samples() + step_samples() - 1) / step_samples();
  }
  int64_t samples_per_step() const override { return step_samples(); }
  EpochSteps start_epoch() override;
  void write(const RunPosition& at, torch::serialize::OutputArchive& archive) override {
    write_network(archive, model_);
    write_progress(archive, at_position(progress_, at));
  }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  const engine::LossScaler& scaler() override { return step_->scaler(); }
  bool validates() const override { return val_set_ != nullptr; }
  PhaseMetrics validate() override {
    return evaluate_data(model_, *val_set_, {}, budget_.prefetch);
  }
  RunNames names() const override {
    return {model_.classes.names(), {}, "samples", progress_.precision};
  }
  int64_t skipped() const override { return progress_.skipped + train_set_->skipped_at_start(); }

 private:
  int64_t step_samples() const { return progress_.batch * config_.train.accumulate; }
  void emit(Event e) const {
    if (on_event_) on_event_(e);
  }
  void info(const std::string& message) const { emit(Event::note(Event::Kind::Info, message)); }

  Config config_;
  EventCallback on_event_;
  std::unique_ptr<BatchData> train_set_;
  std::unique_ptr<BatchData> val_set_;  // null without validation
  TrainingBudget budget_;
  BatchProgress progress_;
  BatchModel model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<engine::BatchTrainingStep> step_;
};

BatchRun::BatchRun(const Config& config, const RunStart& start, memory::Tracker& tracker,
                   const EventCallback& on_event)
    : config_(config),
      on_event_(on_event),
      train_set_(batch_data_with_samples(config, config.data.train_split, true, on_event)) {
  const auto& tc = config_.train;
  const torch::Device device(config_.device);
  val_set_ = validation_data(config_, on_event);
  if (config_.task == "clips") warn_unused_splits(config_, on_event);
  info("data: " + train_set_->describe() + " for training" +
       (val_set_ ? ", " + val_set_->describe() + " for validation" : std::string()));
  write_config(config_, start.out_dir);

  const auto input = train_set_->sample_shape();
  budget_ = resolve_budget(config_, tracker, largest_unit_bytes(*train_set_, val_set_.get()));

  progress_.precision = batch_precision(config_);
  if (const auto slow = engine::slow_precision_reason(progress_.precision, device); !slow.empty())
    emit(Event::note(Event::Kind::Warning, slow));
  if (start.resumed()) {
    progress_ = read_batch_progress(*start.archive, start.resume_from);
    warn_config_changes(*start.stored, config_, progress_.best_score, on_event);
    info("resuming from " + start.resume_from + " at step " + std::to_string(progress_.step) +
         " with its batch of " + std::to_string(progress_.batch));
    replan_if_budget_changed(progress_, budget_change(*start.stored, config_), config_, *train_set_,
                             input, tracker, budget_, on_event);
  } else {
    const auto plan = plan_for(config_, *train_set_, input, tracker, budget_);
    TORCH_CHECK(plan.batch > 0, plan.describe());
    if (plan.largest_batch > plan.batch && plan.planned) {
      info(c10::str("the budget fits a batch of ", plan.largest_batch, "; using ", plan.batch,
                    ", every training sample"));
    }
    info(plan.describe());
    if (plan.planned && plan.predicted_peak_bytes > plan.budget.step) {
      emit(Event::note(Event::Kind::Warning,
                       c10::str("train.batch ", plan.batch, " is predicted to need ",
                                memory::format_bytes(plan.predicted_peak_bytes), ", more than ",
                                memory::format_bytes(plan.budget.step),
                                " even one sample at a time; steps that run out of memory are "
                                "retried, but train.batch auto would fit the budget")));
    }
    progress_.batch = plan.batch;
    take_step_settings(progress_, plan);
    progress_.eval_batch = plan.eval_batch;
  }
  progress_.eval_batch = evaluation_batch(config_, progress_);

  model_ = build_batch_model(config_, input);
  model_.precision = progress_.precision;
  model_.batch = progress_.eval_batch;
  auto& module = *model_.network.module;
  models::set_lean_backward(module, progress_.lean_backward);
  models::set_recompute_norm(module, progress_.recompute_norm);
  models::set_time_slices(module, progress_.time_slices);
  std::vector<torch::Tensor> parameters;
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) parameters.push_back(p);
  }
  optimizer_ = engine::make_optimizer(parameters, optimizer_options(tc));
  engine::BatchStepOptions options;
  options.device = device;
  options.precision = progress_.precision;
  options.segments = progress_.segments;
  options.fallback_segments = progress_.fallback_segments;
  // The train.accumulate batches of an optimizer step run as micro-batches of the step.
  options.micro_batches = progress_.micro_batches * tc.accumulate;
  options.clip_grad_norm = tc.clip_grad_norm;
  options.ignore_label = config_.data.ignore_id;
  options.label_smoothing = config_.train.label_smoothing;
  if (tc.class_weights) {
    const auto counts = train_set_->class_counts(model_.classes.size());
    options.class_weights = engine::inverse_frequency_weights(counts);
    info("class weights (inverse frequency over the training " +
         std::string(config_.task == "clips" ? "clips" : "pixels") +
         "): " + describe_class_weights(options.class_weights, model_.classes.names()));
  }
  options.to_input = [this](const torch::Tensor& samples) { return batch_input(model_, samples); };
  step_.emplace(model_.network, optimizer_, options, tracker);

  if (start.resumed()) {
    load_module(module, *start.archive, "network", start.resume_from,
                "the config this run resumes with");
    module.to(device);
    read_resume_state(*start.archive, *optimizer_, step_->scaler(), device);
  }
}

EpochSteps BatchRun::start_epoch() {
  struct Epoch {
    std::optional<SampleStream> stream;
    SampleStream::Batch batch;  // the next step's
  };
  const auto& tc = config_.train;
  auto epoch = std::make_shared<Epoch>();
  epoch->stream.emplace(*train_set_, train_set_->order(tc.seed, progress_.epoch, true),
                        progress_.position, tc.seed, progress_.epoch,
                        static_cast<int>(config_.data.workers), budget_.prefetch);
  EpochSteps steps;
  steps.done = [epoch] { return epoch->stream->done(); };
  steps.fetch = [this, epoch] {
    epoch->batch = epoch->stream->next(step_samples());
    progress_.position = epoch->stream->position();
    progress_.skipped += epoch->batch.skipped_units;
    for (const auto& w : epoch->batch.warnings) emit(Event::note(Event::Kind::Warning, w));
    return epoch->batch.samples.defined();
  };
  steps.step = [this, epoch](double lr) {
    const auto batch = std::exchange(epoch->batch, {});  // let go when the step ends
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    model_.network.module->train();  // validation leaves the model in eval mode
    const auto report = step_->step(batch.samples, batch.labels);
    // A step that ran out of memory was retried with more recomputation or micro-batches:
    // later steps and checkpoints (so a resumed run) keep them.
    const int64_t accumulate = config_.train.accumulate;
    progress_.segments = step_->options().segments;
    progress_.micro_batches = (step_->options().micro_batches + accumulate - 1) / accumulate;
    for (const auto& r : report.replans) emit(Event::note(Event::Kind::Warning, r));
    return StepOutcome{report.loss,
                       report.samples,
                       "samples",
                       report.seconds,
                       report.peak_bytes,
                       report.overflow_skipped || report.not_finite_skipped,
                       {}};
  };
  // Its last unit is not held beside validation's.
  steps.release = [epoch] { epoch->stream->release(); };
  return steps;
}

class BatchTask final : public Task {
 public:
  std::vector<plan::Finding> check_settings(const Config& config) const override {
    return diagnose_task_settings(config);
  }
  std::unique_ptr<TaskRun> start(const Config& config, const RunStart& start,
                                 memory::Tracker& tracker,
                                 const EventCallback& on_event) const override {
    return std::make_unique<BatchRun>(config, start, tracker, on_event);
  }
  RunPlan plan(const Config& config, memory::Tracker& tracker,
               const EventCallback& on_event) const override {
    return batch_run_plan(config, plan_batch_task(config, tracker, on_event));
  }
  // The data's summary and findings, then the named network's (r3d_18, r2plus1d_18, unet,
  // torchscript) static memory against the budget.
  Diagnosis diagnose(const Config& config, const TrainingBudget& budget) const override {
    const int64_t tensors_budget = budget.tensors;
    Diagnosis out;
    std::string summary;
    const auto data_findings = diagnose_batch_data(config, &summary);
    out.summary.push_back(summary);
    int64_t static_bytes = 0;
    out.findings = diagnose_batch_task(config, tensors_budget, &static_bytes);
    out.findings.insert(out.findings.end(), data_findings.begin(), data_findings.end());
    if (static_bytes > 0) {
      out.summary.push_back(c10::str(
          network_kind(config), " for task ", config.task,
          ": static memory (parameters, buffers, gradients, ", config.train.optimizer, " state) ",
          memory::format_bytes(static_bytes), " of budget ", memory::format_bytes(tensors_budget),
          "; `framefit plan --config` finds the batch"));
    }
    return out;
  }
  Evaluation evaluate(const EvaluationRequest& request,
                      const EventCallback& on_event) const override {
    // Refused before the model loads; the checkpoint's task, which evaluate_checkpoint read to
    // get here, is read again only to say so.
    TORCH_CHECK(request.predictions_folder.empty() && request.relaxed_rules.empty(),
                "--predictions and --relaxed are for the per-frame phases of a phases "
                "checkpoint; this one is for task ",
                checkpoint_config(request.checkpoint).task,
                " (framefit predict writes its predictions)");
    auto model = load_batch_model(request.checkpoint, request.overrides);
    Evaluation out;
    out.config = model.config;
    out.classes = model.classes;
    out.split = request.split.empty() ? model.config.data.test_split : request.split;
    out.metrics = evaluate_batch(model, out.split, on_event);
    return out;
  }
  ExportedWeights export_weights(const std::string& checkpoint) const override {
    const auto model = load_batch_model(checkpoint, {"device=cpu"});
    return {models::state_dict(*model.network.module),
            "the network's own names (torchvision's for r3d_18 and r2plus1d_18)"};
  }
  DataThroughput read_split(const Config& config, const std::string& split,
                            const EventCallback& on_event) const override {
    const auto units = batch_data(config, split, true, on_event);
    TORCH_CHECK(units->units() > 0, units->no_samples(split));
    std::vector<data::Prefetcher::Job> jobs;
    for (int64_t unit = 0; unit < units->units(); ++unit) {
      jobs.push_back({[&units, unit, &config] { return units->load(unit, config.train.seed, 0); },
                      units->unit_bytes(unit)});
    }
    auto out = time_loading(std::move(jobs), config);
    out.unit_name = config.task == "clips" ? "video" : "image";
    out.sample_name = config.task == "clips" ? "frame" : "image";
    return out;
  }
};

}  // namespace

const Task& detail::batch_task() {
  static const BatchTask task;
  return task;
}

}  // namespace framefit::train
