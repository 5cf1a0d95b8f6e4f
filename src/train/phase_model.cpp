#include "framefit/train/trainer.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "framefit/engine/chunked.h"
#include "framefit/engine/step.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/norm_relu_conv.h"
#include "framefit/models/torchscript.h"
#include "framefit/models/weights.h"
#include "framefit/plan/calibration.h"
#include "framefit/plan/planner.h"
#include "framefit/train/tasks.h"
#include "phase_model.h"
#include "run_files.h"

namespace framefit::train {

using namespace detail;

namespace detail {

bool is_script_encoder(const Config& config) { return config.model.encoder == "torchscript"; }
bool reads_features(const Config& config) { return config.model.encoder == "features"; }

models::StageLayout stage_layout(const Config& config, torch::Device device) {
  if (reads_features(config)) return {false, ""};  // no frames: nothing to lay out
  const auto layout = config.model.layout;
  // Auto leaves a TorchScript encoder's layout as the user wrote it.
  if (is_script_encoder(config)) return {layout == models::ActivationLayout::ChannelsLast, ""};
  return models::resolve_layout(layout, models::parse_norm_kind(config.model.norm), device.type());
}

bool channels_last_input(const Config& config, torch::Device device) {
  return stage_layout(config, device).channels_last;
}

plan::ModelSpec model_spec(const Config& config, int64_t size, torch::Device device) {
  plan::ModelSpec spec;
  spec.model = config.model.encoder;
  spec.head = config.model.head;
  spec.head_settings = config.model.head_settings;
  spec.classes = static_cast<int64_t>(config.data.classes.size());
  spec.tools = static_cast<int64_t>(config.data.tools.size());
  spec.norm = config.model.norm;
  spec.groups = config.model.groups;
  spec.freeze = config.model.freeze;
  const auto layout = stage_layout(config, device);
  spec.channels_last = layout.channels_last;
  spec.nchw_from = layout.nchw_from;
  spec.recompute_norm =
      config.model.recompute_norm.value_or(false);  // auto: as planned (plan_step)
  spec.size = size;
  spec.optimizer = config.train.optimizer;
  spec.device = device;
  return spec;
}

int64_t frame_size_for_planning(const data::VideoDataset& dataset) {
  // The memory model assumes square frames; use the side with the same pixel count.
  int64_t largest = 1;
  for (int64_t i = 0; i < dataset.size(); ++i) {
    const auto [h, w] = dataset.frame_size(i);
    largest = std::max<int64_t>(largest, std::llround(std::sqrt(static_cast<double>(h * w))));
  }
  return largest;
}

void read_tool_head(torch::serialize::InputArchive& archive, Model& model,
                    const std::string& checkpoint, const std::string& built_from) {
  if (!model.tools) return;
  torch::serialize::InputArchive tools;
  TORCH_CHECK(archive.try_read("tools", tools), checkpoint,
              " holds no tool head although its config sets data.tools");
  load_module(*model.tools, archive, "tools", checkpoint, built_from);
  model.tools->to(model.device);
}

void write_model(torch::serialize::OutputArchive& archive, const Model& model) {
  archive.write("format", c10::IValue(std::string("framefit-checkpoint-1")));
  archive.write("config", c10::IValue(to_yaml(model.config)));
  torch::serialize::OutputArchive encoder, head;
  model.encoder_module().save(encoder);
  model.head->save(head);
  if (model.script) write_script(archive, *model.script);
  archive.write("encoder", encoder);
  archive.write("head", head);
  if (model.tools) {
    torch::serialize::OutputArchive tools;
    model.tools->save(tools);
    archive.write("tools", tools);
  }
}

void write_progress(torch::serialize::OutputArchive& archive, const Progress& p) {
  write_run_record(archive, {p,
                             {{"chunk", p.settings.chunk},
                              {"keep", p.settings.keep},
                              {"cache_frozen", p.settings.cache_frozen},
                              {"precision", static_cast<int64_t>(p.settings.precision)},
                              {"recompute_norm", p.settings.recompute_norm}},
                             {}});
}

// Format 1: step, epoch, position, skipped, chunk, keep, cache_frozen, precision, stale_epochs,
// recompute_norm in one int64 tensor (the last two absent in its first checkpoints), best score
// and seconds in a double one. `p`: the first, already read.
Progress read_first_format_video_progress(torch::serialize::InputArchive& archive,
                                          const torch::Tensor& p) {
  torch::Tensor r;
  archive.read("progress_real", r);
  const auto* v = p.data_ptr<int64_t>();
  Progress progress;
  static_cast<RunPosition&>(progress) = first_format_position(p, r);
  progress.settings.chunk = v[4];
  progress.settings.keep = v[5];
  progress.settings.cache_frozen = v[6] != 0;
  progress.settings.precision = static_cast<engine::Precision>(v[7]);
  progress.stale_epochs = p.numel() > 8 ? v[8] : 0;  // patience starts over
  progress.settings.recompute_norm = p.numel() > 9 && v[9] != 0;
  return progress;
}

std::optional<Progress> try_read_video_progress(torch::serialize::InputArchive& archive,
                                                const std::string& checkpoint) {
  if (const auto record = read_run_record(archive, checkpoint)) {
    Progress p;
    static_cast<RunPosition&>(p) = record->position;
    p.settings.chunk = record->setting("chunk", 0);
    p.settings.keep = record->setting("keep", 0);
    p.settings.cache_frozen = record->setting("cache_frozen", 0) != 0;
    p.settings.precision = static_cast<engine::Precision>(record->setting("precision", 0));
    p.settings.recompute_norm = record->setting("recompute_norm", 0) != 0;
    return p;
  }
  torch::Tensor progress;
  if (!archive.try_read("progress", progress)) return std::nullopt;
  return read_first_format_video_progress(archive, progress);
}

Progress read_video_progress(torch::serialize::InputArchive& archive,
                             const std::string& checkpoint) {
  auto progress = try_read_video_progress(archive, checkpoint);
  TORCH_CHECK(progress, "checkpoint ", checkpoint,
              " records no run (no training position): resume from a checkpoint that "
              "framefit train wrote");
  return *progress;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------

data::DataOptions data_options(const Config& config, bool training) {
  data::DataOptions options;
  options.fps = config.data.fps;
  options.labels_fps = config.data.labels_fps;
  options.transform.resize = config.data.resize;
  options.transform.crop = config.data.crop;
  options.transform.random_crop = training && config.data.augment;
  options.transform.flip = training && config.data.augment;
  if (training && config.data.augment) {
    options.transform.brightness = config.data.brightness;
    options.transform.contrast = config.data.contrast;
    options.transform.saturation = config.data.saturation;
    options.transform.hue = config.data.hue;
    options.transform.rotation = config.data.rotation;
  }
  options.skip_bad = config.data.on_error == "skip";
  options.skip_unsampled = config.data.skip_unsampled;
  options.pinned = torch::Device(config.device).is_cuda();
  options.features = reads_features(config);
  options.features_layout = config.data.features_layout;
  options.features_stride = config.data.features_stride;
  options.tools = config.data.tools;
  return options;
}

data::VideoDataset make_dataset(const Config& config, const std::string& split, bool training,
                                const EventCallback& on_event) {
  TORCH_CHECK(!config.data.manifest.empty(),
              "data.manifest is not set: name the CSV listing the videos");
  TORCH_CHECK(!config.data.classes.empty(),
              "data.classes is not set: list the phase names in label order");
  if (reads_features(config) && !std::filesystem::exists(config.data.manifest)) {
    const auto dir = std::filesystem::path(config.data.manifest).parent_path();
    TORCH_CHECK(false, "manifest ", config.data.manifest,
                " does not exist: a features data set is written by framefit extract "
                "--checkpoint RUN/best.pt --out-dir ",
                dir.empty() ? "." : dir.string(), " (docs/commands.md, `framefit extract`)");
  }
  auto entries = data::select_split(data::read_manifest(config.data.manifest), split);
  return data::VideoDataset(std::move(entries), data::ClassList(config.data.classes),
                            data_options(config, training), [&](const std::string& message) {
                              if (on_event) on_event(Event::note(Event::Kind::Warning, message));
                            });
}

void warn_unused_splits(const Config& config, const EventCallback& on_event) {
  const auto& d = config.data;
  const auto note = data::unused_splits(data::read_manifest(d.manifest),
                                        {d.train_split, d.val_split, d.test_split});
  if (!note.empty() && on_event)
    on_event(Event::note(Event::Kind::Warning, "manifest " + d.manifest + ": " + note));
}

std::string no_videos_in_split(const Config& config, const std::string& split) {
  const auto entries = data::read_manifest(config.data.manifest);
  const std::string what = c10::str("split \"", split, "\" of ", config.data.manifest);
  if (!data::select_split(entries, split).empty()) {
    return "no usable videos in " + what + ": every one was skipped (see the warnings above)";
  }
  std::map<std::string, int64_t> counts;  // split -> videos
  for (const auto& e : entries) ++counts[e.split];
  std::vector<std::string> listed;
  for (const auto& [name, n] : counts) {
    listed.push_back(c10::str("\"", name, "\" (", n, n == 1 ? " video)" : " videos)"));
  }
  return c10::str("no videos in ", what, "; its splits are ",
                  listed.empty() ? "none" : c10::Join(", ", listed));
}

namespace detail {

engine::FrameEncoder script_frame_encoder(std::shared_ptr<models::TorchScriptEncoderImpl> script) {
  return engine::frame_encoder(script,
                               [script](const torch::Tensor& x) { return script->forward(x); });
}

std::shared_ptr<models::TorchScriptEncoderImpl> load_script_encoder(
    const Config& config, torch::Device device,
    std::shared_ptr<models::TorchScriptEncoderImpl> stored) {
  TORCH_CHECK(!config.model.script.empty(),
              "model.encoder torchscript needs model.script: the file torch.jit.save wrote");
  TORCH_CHECK(config.model.weights.empty(),
              "model.weights loads torchvision weights into a "
              "ResNet encoder; a TorchScript encoder (",
              config.model.script, ") carries its own: remove model.weights");
  TORCH_CHECK(config.model.freeze.empty(),
              "model.freeze names ResNet stages; freeze a "
              "TorchScript encoder's parameters in Python (requires_grad_(False)) before saving");
  auto script = stored
                    ? std::move(stored)
                    : std::make_shared<models::TorchScriptEncoderImpl>(config.model.script, device);
  script->to(torch::kFloat32);
  const auto trained = script->parameters(/*recurse=*/true);
  TORCH_CHECK(std::any_of(trained.begin(), trained.end(),
                          [](const torch::Tensor& p) { return p.requires_grad(); }),
              "model.script ", config.model.script,
              ": none of the encoder's parameters requires grad, so there is nothing to train "
              "end to end; save it with trainable parameters");
  return script;
}

int64_t script_feature_dim(models::TorchScriptEncoderImpl& script, const Config& config,
                           torch::Device device) {
  const int64_t side =
      config.data.crop > 0 ? config.data.crop : (config.data.resize > 0 ? config.data.resize : 64);
  torch::NoGradGuard no_grad;
  const bool training = script.is_training();
  script.eval();
  torch::Tensor out;
  try {
    out = script.forward(torch::zeros({1, 3, side, side}, torch::TensorOptions().device(device)));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "model.script ", config.model.script, ": a 1x3x", side, "x", side,
                " frame through it failed (", e.what_without_backtrace(),
                "). A per-frame encoder maps [N,3,H,W] to [N,D]; set data.crop to the frame "
                "size it expects");
  }
  script.train(training);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == 1, "model.script ", config.model.script,
              ": a per-frame encoder maps [N,3,H,W] to features [N,D], but one frame gave ",
              out.sizes());
  return out.size(1);
}

}  // namespace detail

namespace {

Model build_model(const Config& config,
                  std::shared_ptr<models::TorchScriptEncoderImpl> stored_script) {
  Model model;
  model.config = config;
  model.classes = data::ClassList(config.data.classes);
  model.device = torch::Device(config.device);
  torch::manual_seed(config.train.seed);
  if (is_script_encoder(config)) {
    model.script = load_script_encoder(config, model.device, std::move(stored_script));
    model.feature_dim = script_feature_dim(*model.script, config, model.device);
  } else if (reads_features(config)) {
    TORCH_CHECK(config.model.weights.empty() && config.model.freeze.empty(),
                "model.weights and model.freeze are for an encoder; model.encoder features has "
                "none (its features were computed before): remove them");
    TORCH_CHECK(config.model.feature_dim > 0,
                "model.encoder features needs model.feature_dim, the features per frame (training "
                "takes it from the data)");
    model.features_input = std::make_shared<torch::nn::Module>("FeaturesInput");
    model.feature_dim = config.model.feature_dim;
  } else {
    const auto spec = model_spec(config, 64, model.device);
    model.encoder = models::ResNet(spec.encoder_options());
    if (!config.model.weights.empty()) {
      load_model_weights(*model.encoder, config, true);
    }
    model.feature_dim = model.encoder->feature_dim();
  }
  model.head = models::make_head(config.model.head, model.feature_dim, model.classes.size(),
                                 config.model.head_settings);
  // Built after the head, so a run without tools initialises as before.
  if (!config.data.tools.empty()) {
    model.tools =
        torch::nn::Linear(model.feature_dim, static_cast<int64_t>(config.data.tools.size()));
    model.tools->to(model.device);
  }
  model.encoder_module().to(model.device);
  model.head->to(model.device);
  return model;
}

}  // namespace

Model build_model(const Config& config) { return build_model(config, nullptr); }

torch::nn::Module& Model::encoder_module() const {
  TORCH_CHECK(script || encoder || features_input,
              "the model has no encoder: build it with build_model");
  if (script) return *script;
  if (features_input) return *features_input;
  return *encoder.ptr();
}

engine::FrameEncoder Model::frame_encoder() const {
  if (features_input) {
    return engine::frame_encoder(features_input, [](const torch::Tensor&) -> torch::Tensor {
      TORCH_CHECK(false,
                  "this model (model.encoder features) has no encoder: it reads precomputed "
                  "features, not frames");
    });
  }
  return script ? script_frame_encoder(script) : engine::frame_encoder(encoder.ptr());
}

Config checkpoint_config(const std::string& checkpoint) {
  auto archive = open_archive(checkpoint);
  return read_config(archive, checkpoint);
}

Model load_model(const std::string& checkpoint, const std::vector<std::string>& overrides) {
  auto archive = open_archive(checkpoint);
  Config config = read_config(archive, checkpoint);
  TORCH_CHECK(!is_batch_task(config), checkpoint, " is a ", config.task,
              " checkpoint: load it with load_batch_model");
  config = config_with_overrides(config, checkpoint, overrides);
  config.model.weights.clear();  // the checkpoint has the weights
  Model model =
      build_model(config, is_script_encoder(config)
                              ? read_script(archive, checkpoint, torch::Device(config.device))
                              : nullptr);
  const auto built_from = stored_config_with(overrides);
  load_module(model.encoder_module(), archive, "encoder", checkpoint, built_from);
  load_module(*model.head, archive, "head", checkpoint, built_from);
  read_tool_head(archive, model, checkpoint, built_from);
  model.encoder_module().to(model.device);
  model.head->to(model.device);
  if (const auto progress = try_read_video_progress(archive, checkpoint)) {
    model.precision = progress->settings.precision;
    if (model.device.is_cpu() && model.precision == engine::Precision::FP16) {
      model.precision = engine::Precision::FP32;  // fp16 autocast is not a CPU thing
    }
  }
  return model;
}

namespace detail {

// What the cached features depend on: the model, the data and how frames are sampled and
// transformed, the precision they were computed in - not the optimizer or the schedule.
// The files too, by size and modification time: the cache is kept by position in the data set,
// so a manifest edited or a video replaced under the same config would otherwise be given the
// features of what was there before.
std::string feature_fingerprint(const Config& config, engine::Precision precision,
                                const std::vector<const data::VideoDataset*>& sets) {
  Config key = config;
  key.train = TrainConfig{};
  key.data.workers = 0;
  key.data.prefetch_bytes = 0;
  key.data.on_error.clear();
  std::string files;
  const auto stamp = [&](const std::string& path) {
    std::error_code no_size, no_time;  // a frame folder has no size; a missing file neither
    const auto size = std::filesystem::file_size(path, no_size);
    const auto time = std::filesystem::last_write_time(path, no_time).time_since_epoch().count();
    files += c10::str("# ", path, " ", no_size ? 0 : size, " ", no_time ? 0 : time, "\n");
  };
  for (const auto* set : sets) {
    for (int64_t v = 0; set && v < set->size(); ++v) stamp(set->entry(v).video);
  }
  if (!config.model.weights.empty()) stamp(config.model.weights);
  return to_yaml(key) + "# precision " + engine::to_string(precision) + "\n" + files;
}

}  // namespace detail

namespace {

// Frames' features for inference: the encoder in eval mode, model.chunk frames at a time, in the
// model's precision (mixed precision in the encoder only: the head runs in float32, as in
// training).
torch::Tensor encode_frames(Model& model, const torch::Tensor& frames) {
  torch::InferenceMode inference;
  model.encoder_module().eval();
  engine::ChunkedOptions options;
  options.chunk = model.chunk;
  options.keep = 0;
  options.device = model.device;
  options.channels_last = channels_last_input(model.config, model.device);
  engine::AutocastGuard autocast(model.device, model.precision);
  return engine::chunked_encode(model.frame_encoder(), frames, options);
}

// The tool head's presence probabilities [T,K] of features [T,D] (float32, as in training);
// undefined without a tool head.
torch::Tensor tool_probabilities(Model& model, const torch::Tensor& features) {
  if (!model.tools) return {};
  model.tools->eval();
  return torch::sigmoid(model.tools->forward(features.to(torch::kFloat32))).cpu();
}

// A whole video's features [T,D] through the head.
Prediction head_prediction(Model& model, const torch::Tensor& features) {
  torch::InferenceMode inference;
  model.head->eval();
  auto logits = model.head->forward(features.to(torch::kFloat32));
  if (logits.dim() == 3) logits = logits[-1];
  Prediction p;
  p.probabilities = torch::softmax(logits.to(torch::kFloat32), -1).cpu();
  p.labels = p.probabilities.argmax(-1);
  p.tool_probabilities = tool_probabilities(model, features);
  return p;
}

// run() again with model.chunk halved while it runs out of memory: without grad a frame's output
// does not depend on its chunk.
template <typename Run>
auto halving_chunk_on_oom(Model& model, const EventCallback& on_event, const Run& run) {
  for (;;) {
    try {
      return run();
    } catch (const std::exception& e) {
      if (model.chunk <= 1 || !memory::is_out_of_memory(e)) throw;
    }
    const int64_t half = model.chunk / 2;
    if (on_event) {
      on_event(Event::note(Event::Kind::Warning,
                           c10::str("inference ran out of memory at chunks of ", model.chunk,
                                    " frames; continuing with chunks of ", half)));
    }
    model.chunk = half;
  }
}

// The video's features (those it brings, else its frames encoded) through the head;
// `features_out` receives them on the CPU.
Prediction predict_video(Model& model, const Video& video, const EventCallback& on_event,
                         torch::Tensor* features_out = nullptr) {
  return halving_chunk_on_oom(model, on_event, [&] {
    torch::InferenceMode inference;
    const auto features = video.features.defined() ? video.features.to(model.device)
                                                   : encode_frames(model, video.frames);
    if (features_out) *features_out = features.cpu();
    return head_prediction(model, features);
  });
}

// predict() and predict_file() take frames, which a model on precomputed features cannot.
void check_reads_frames(const Model& model) {
  TORCH_CHECK(!model.features_input,
              "this model (model.encoder features) reads precomputed features, not frames: "
              "predict from a features file");
}

// Features of frames that arrive a piece at a time (decode_video_pieces, load_pieces), each
// piece encoded as it comes: only one piece of frames is held, and the features.
class PieceEncoder {
 public:
  PieceEncoder(Model& model, const EventCallback& on_event) : model_(model), on_event_(on_event) {}
  void operator()(const torch::Tensor& frames) {
    pieces_.push_back(
        halving_chunk_on_oom(model_, on_event_, [&] { return encode_frames(model_, frames); }));
  }
  torch::Tensor features() const {
    TORCH_CHECK(!pieces_.empty(), "the video has no frames to encode");
    return torch::cat(pieces_);
  }

 private:
  Model& model_;
  const EventCallback& on_event_;
  std::vector<torch::Tensor> pieces_;
};
}  // namespace

std::string phase_csv(const Prediction& prediction, const std::vector<int64_t>& frames,
                      const std::vector<double>& seconds, const data::ClassList& classes,
                      const std::vector<std::string>& tools, const torch::Tensor& truth) {
  std::string csv = truth.defined() ? "frame,time_seconds,phase,confidence,truth"
                                    : "frame,time_seconds,phase,confidence";
  const auto tool_p = prediction.tool_probabilities.defined()
                          ? prediction.tool_probabilities.contiguous()
                          : torch::Tensor();
  if (tool_p.defined()) {
    TORCH_CHECK(tool_p.size(1) == static_cast<int64_t>(tools.size()), "phase_csv: ", tool_p.size(1),
                " tool columns for ", tools.size(), " names");
    for (const auto& t : tools) csv += "," + t;
  }
  csv += "\n";
  const auto fixed = [](double value, int digits) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.*f", digits, value);
    return std::string(text);
  };
  const auto labels = prediction.labels.accessor<int64_t, 1>();
  const auto probabilities = prediction.probabilities.accessor<float, 2>();
  const auto truth_ids = truth.defined() ? truth.contiguous() : torch::Tensor();
  for (int64_t t = 0; t < labels.size(0); ++t) {
    const auto k = static_cast<size_t>(t);
    csv += c10::str(frames[k], ",", fixed(seconds[k], 3), ",", classes.names()[labels[t]], ",",
                    fixed(probabilities[t][labels[t]], 4));
    if (truth_ids.defined()) csv += "," + classes.names()[truth_ids.data_ptr<int64_t>()[t]];
    for (int64_t j = 0; tool_p.defined() && j < tool_p.size(1); ++j) {
      csv += "," + fixed(tool_p.data_ptr<float>()[t * tool_p.size(1) + j], 4);
    }
    csv += "\n";
  }
  return csv;
}

Prediction predict(Model& model, const torch::Tensor& frames, const EventCallback& on_event) {
  check_reads_frames(model);
  TORCH_CHECK(frames.dim() == 4 && frames.size(1) == 3, "predict expects frames [T,3,H,W], got ",
              frames.sizes());
  Video video;
  video.frames = frames;
  return predict_video(model, video, on_event);
}

Prediction predict_file(Model& model, const std::string& video, double folder_fps,
                        const EventCallback& on_event, data::DecodedVideo* decoded) {
  check_reads_frames(model);
  PieceEncoder encoder(model, on_event);
  auto sampled = data::decode_video_pieces(video, folder_fps, data_options(model.config, false),
                                           model.chunk, std::ref(encoder));
  if (decoded) *decoded = std::move(sampled);
  return head_prediction(model, encoder.features());
}

Prediction predict_features(Model& model, const torch::Tensor& features,
                            const EventCallback& on_event) {
  TORCH_CHECK(model.features_input, "this model has a ", model.config.model.encoder,
              " encoder: it predicts from frames");
  TORCH_CHECK(features.dim() == 2 && features.size(1) == model.feature_dim, "expected features [T,",
              model.feature_dim, "], got ", features.sizes());
  Video video;
  video.features = features.to(torch::kFloat32);
  return predict_video(model, video, on_event);
}

OnlinePredictor::OnlinePredictor(Model& model) : model_(model) {
  TORCH_CHECK(model.head, "OnlinePredictor needs a built model");
  if (const auto* lstm = dynamic_cast<models::LSTMHeadImpl*>(model.head.get())) {
    TORCH_CHECK(!lstm->options().bidirectional(),
                "online prediction needs a causal head; this LSTM is bidirectional (it reads the "
                "frames after each one)");
  } else if (const auto* tcn = dynamic_cast<models::TCNHeadImpl*>(model.head.get())) {
    TORCH_CHECK(tcn->options().causal(),
                "online prediction needs a causal head; this TCN is not causal (its "
                "convolutions read later frames)");
  } else {
    TORCH_CHECK(dynamic_cast<models::LinearHeadImpl*>(model.head.get()),
                "online prediction supports the linear, LSTM and TCN heads");
  }
}

void OnlinePredictor::reset() {
  frames_ = 0;
  history_ = torch::Tensor();
  lstm_state_.clear();
}

Prediction OnlinePredictor::push(const torch::Tensor& frames) {
  TORCH_CHECK(!model_.features_input,
              "this model (model.encoder features) reads features: use push_features");
  engine::check_video_frames(frames, "online frames");
  return push_features(encode_frames(model_, frames));
}

Prediction OnlinePredictor::push_features(const torch::Tensor& features) {
  TORCH_CHECK(features.dim() == 2 && features.size(1) == model_.feature_dim,
              "expected features [N,", model_.feature_dim, "], got ", features.sizes());
  torch::InferenceMode inference;
  model_.head->eval();
  const auto x = features.to(model_.device, torch::kFloat32);
  const int64_t n = x.size(0);
  torch::Tensor logits;  // [N,C]
  if (auto* lstm = dynamic_cast<models::LSTMHeadImpl*>(model_.head.get())) {
    // LibTorch's LSTM with the head's parameters, carrying (h, c) from the last push.
    auto [out, state] =
        lstm_state_.empty()
            ? lstm->lstm->forward(x.unsqueeze(0))
            : lstm->lstm->forward(x.unsqueeze(0), std::make_tuple(lstm_state_[0], lstm_state_[1]));
    lstm_state_ = {std::get<0>(state), std::get<1>(state)};
    logits = lstm->fc(out.squeeze(0));
  } else if (auto* tcn = dynamic_cast<models::TCNHeadImpl*>(model_.head.get())) {
    // A frame's output reads the receptive field before it: run over that much history.
    const auto window = history_.defined() ? torch::cat({history_, x}) : x;
    logits = tcn->forward(window)[-1].slice(0, window.size(0) - n);
    const int64_t keep = std::min<int64_t>(window.size(0), tcn->receptive_field() - 1);
    history_ = window.slice(0, window.size(0) - keep).clone();
  } else {
    logits = model_.head->forward(x)[-1];
  }
  frames_ += n;
  Prediction p;
  p.probabilities = torch::softmax(logits.to(torch::kFloat32), -1).cpu();
  p.labels = p.probabilities.argmax(-1);
  p.tool_probabilities = tool_probabilities(model_, x);
  return p;
}

namespace detail {
PhaseMetrics evaluate_with(Model& model, const data::VideoDataset& dataset,
                           const EventCallback& on_event, std::vector<VideoMetrics>* per_video,
                           const PredictionCallback& on_prediction, const FeatureCache* cache,
                           int64_t prefetch_bytes) {
  ConfusionMatrix confusion(model.classes.size());
  std::vector<int64_t> background;
  for (const auto& name : model.config.data.background) {
    const int64_t id = model.classes.find(name);
    TORCH_CHECK(id >= 0, "data.background names '", name, "', which is not a class");
    background.push_back(id);
  }
  SegmentScorer segments(background);
  std::optional<ToolScorer> tools;
  if (model.tools) tools.emplace(model.tools->options.out_features());
  // A video whose frames are more than the loader may hold ahead would be decoded alone anyway:
  // it is decoded and encoded here a piece at a time instead (its job for the loader is empty),
  // so that evaluation holds one piece of its frames and its features.
  std::vector<bool> in_pieces(static_cast<size_t>(dataset.size()));
  std::vector<data::Prefetcher::Job> jobs;
  for (int64_t i = 0; i < dataset.size(); ++i) {
    auto load = [&dataset, i] { return dataset.load(i); };
    in_pieces[i] = !dataset.options().features && !(cache && cache->has(i)) &&
                   dataset.frame_bytes(i) > prefetch_bytes;
    if (in_pieces[i]) {
      jobs.push_back({[] { return Video(); }, 0});
    } else {
      jobs.push_back(cache ? cache->job(dataset, i, load, model.feature_dim)
                           : data::Prefetcher::Job{load, dataset.frame_bytes(i)});
    }
  }
  data::Prefetcher prefetcher(std::move(jobs), std::max<int64_t>(1, model.config.data.workers),
                              prefetch_bytes);
  const auto start = Clock::now();
  int64_t frames = 0;
  for (int64_t i = 0; i < dataset.size(); ++i) {
    Video video;
    try {
      video = prefetcher.next();
      if (in_pieces[i]) {
        PieceEncoder encoder(model, on_event);
        video = dataset.load_pieces(i, model.chunk, std::ref(encoder));
        video.features = encoder.features();
      }
    } catch (const c10::Error& e) {
      if (!data::skips_error(dataset.options().skip_bad, e)) throw;
      if (on_event)
        on_event(Event::note(Event::Kind::Warning,
                             std::string("skipping ") + e.what_without_backtrace()));
      continue;
    }
    torch::Tensor features;
    const bool keep = cache && (in_pieces[i] || !video.features.defined());
    const auto prediction = predict_video(model, video, on_event, keep ? &features : nullptr);
    if (keep) cache->write(i, features);
    confusion.add(prediction.labels, video.labels);
    segments.add(prediction.labels, video.labels);
    if (tools) tools->add(prediction.tool_probabilities, video.tools);
    if (on_prediction) on_prediction(i, prediction);
    if (per_video) {
      ConfusionMatrix own(model.classes.size());
      own.add(prediction.labels, video.labels);
      SegmentScorer own_segments(background);
      own_segments.add(prediction.labels, video.labels);
      per_video->push_back({video.name, own.metrics()});
      per_video->back().metrics.segments = own_segments.metrics();
      if (tools) {
        ToolScorer own_tools(model.tools->options.out_features());
        own_tools.add(prediction.tool_probabilities, video.tools);
        per_video->back().metrics.tools = own_tools.metrics();
      }
    }
    frames += video.labels.numel();
    if (on_event) {
      Event e;
      e.kind = Event::Kind::Evaluate;
      e.step = i + 1;
      e.total_steps = dataset.size();
      e.elapsed_seconds = seconds_since(start);
      e.frames_per_second = frames / std::max(1e-9, e.elapsed_seconds);
      on_event(e);
    }
  }
  auto metrics = confusion.metrics();
  metrics.segments = segments.metrics();
  if (tools) metrics.tools = tools->metrics();
  return metrics;
}
}  // namespace detail

PhaseMetrics evaluate(Model& model, const data::VideoDataset& dataset,
                      const EventCallback& on_event, std::vector<VideoMetrics>* per_video,
                      const PredictionCallback& on_prediction) {
  return evaluate_with(model, dataset, on_event, per_video, on_prediction, nullptr,
                       model.config.data.prefetch_bytes);
}

std::string extract_features(Model& model, const std::string& out_dir,
                             const EventCallback& on_event) {
  TORCH_CHECK(!model.features_input,
              "this model (model.encoder features) has no encoder to extract features with");
  const auto& d = model.config.data;
  const auto splits = distinct_splits(model.config);
  std::vector<data::VideoDataset> datasets;
  for (const auto& split : splits)
    datasets.push_back(make_dataset(model.config, split, false, on_event));
  // What will be written, checked before anything is: one file per name, and none over an
  // input (--out-dir the data set's own folder wrote manifest.csv over its manifest, and a
  // NAME.txt over an annotation beside its video).
  namespace fs = std::filesystem;
  std::map<fs::path, std::string> inputs;  // path -> what it is
  inputs[fs::weakly_canonical(d.manifest)] = "the data set's manifest " + d.manifest;
  std::map<std::string, std::string> split_of;  // name -> split
  for (size_t s = 0; s < datasets.size(); ++s) {
    for (int64_t i = 0; i < datasets[s].size(); ++i) {
      const auto& entry = datasets[s].entry(i);
      const auto [other, fresh] = split_of.emplace(entry.name, splits[s]);
      TORCH_CHECK(fresh, "two videos are named ", entry.name, " (", other->second, " and ",
                  splits[s], "): their features files would be one; name them apart in ",
                  d.manifest);
      for (const auto& file : {entry.video, entry.labels, entry.features, entry.tools}) {
        if (!file.empty()) inputs[fs::weakly_canonical(file)] = entry.name + "'s " + file;
      }
    }
  }
  for (const auto& [name, split] : split_of) {
    for (const auto& file :
         {name + ".pt", name + ".txt", name + "-tools.txt", std::string("manifest.csv")}) {
      const auto input = inputs.find(fs::weakly_canonical(fs::path(out_dir) / file));
      TORCH_CHECK(input == inputs.end(), "extract would write ", out_dir, "/", file, " over ",
                  input->second, ", an input of the data set: give --out-dir another folder");
    }
  }
  make_directories(out_dir);
  std::vector<data::VideoEntry> written;
  for (size_t s = 0; s < datasets.size(); ++s) {
    const auto& split = splits[s];
    const auto& dataset = datasets[s];
    for (int64_t i = 0; i < dataset.size(); ++i) {
      const auto& entry = dataset.entry(i);
      PieceEncoder encoder(model, on_event);
      const auto video = dataset.load_pieces(i, model.chunk, std::ref(encoder));
      const auto features = encoder.features().cpu();
      data::VideoEntry out;
      out.name = entry.name;
      out.split = split;
      // The manifest names its files relative to its folder, so the folder can move.
      out.features = entry.name + ".pt";
      out.labels = entry.name + ".txt";
      out.fps = d.fps;
      models::write_tensor(features.to(torch::kFloat32), out_dir + "/" + out.features);
      const auto labels = video.labels.contiguous();
      data::write_phase_annotations(
          out_dir + "/" + out.labels,
          std::vector<int64_t>(labels.data_ptr<int64_t>(),
                               labels.data_ptr<int64_t>() + labels.numel()),
          model.classes);
      if (video.tools.defined()) {
        // One row per features row, as the labels; frames without tool annotation left out.
        out.tools = entry.name + "-tools.txt";
        const auto tools = video.tools.contiguous();
        data::write_tool_annotations(
            out_dir + "/" + out.tools, d.tools,
            std::vector<float>(tools.data_ptr<float>(), tools.data_ptr<float>() + tools.numel()));
      }
      written.push_back(out);
      if (on_event) {
        on_event(
            Event::note(Event::Kind::Info,
                        c10::str(split, " ", entry.name, ": ", features.size(0), " x ",
                                 features.size(1), " features -> ", out_dir, "/", out.features)));
      }
    }
  }
  TORCH_CHECK(!written.empty(), "no videos in the splits ", c10::Join(", ", splits), " of ",
              d.manifest);
  const auto manifest = out_dir + "/manifest.csv";
  data::write_manifest(manifest, written);
  return manifest;
}

models::StateDict export_state_dict(const Model& model) {
  models::StateDict out;
  const auto encoder = model.script           ? model.script->named_state()
                       : model.features_input ? models::StateDict{}
                                              : models::state_dict(*model.encoder);
  for (auto& [name, tensor] : encoder) out.emplace_back("encoder." + name, tensor.cpu());
  for (auto& [name, tensor] : models::state_dict(*model.head)) {
    out.emplace_back("head." + name, tensor.cpu());
  }
  if (model.tools) {
    for (auto& [name, tensor] : models::state_dict(*model.tools)) {
      out.emplace_back("tools." + name, tensor.cpu());
    }
  }
  return out;
}

}  // namespace framefit::train
