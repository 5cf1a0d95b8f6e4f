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
#include "run_files.h"
#include "run_loop.h"

namespace framefit::train {

namespace {

using namespace detail;

bool is_script_encoder(const Config& config) { return config.model.encoder == "torchscript"; }
bool reads_features(const Config& config) { return config.model.encoder == "features"; }

models::StageLayout stage_layout(const Config& config, torch::Device device) {
  if (reads_features(config)) return {false, ""};  // no frames: nothing to lay out
  const auto layout = models::parse_activation_layout(config.model.layout);
  // Auto leaves a TorchScript encoder's layout as the user wrote it.
  if (is_script_encoder(config)) return {layout == models::ActivationLayout::ChannelsLast, ""};
  return models::resolve_layout(layout, models::parse_norm_kind(config.model.norm), device.type());
}

// The layout of the frames fed to the encoder: that of its first stage.
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
  spec.recompute_norm = config.model.recompute_norm == "true";  // auto: as planned (plan_step)
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

// The tool head's weights, where the model has one.
void read_tool_head(torch::serialize::InputArchive& archive, Model& model,
                    const std::string& checkpoint, const std::string& built_from) {
  if (!model.tools) return;
  torch::serialize::InputArchive tools;
  TORCH_CHECK(archive.try_read("tools", tools), checkpoint,
              " holds no tool head although its config sets data.tools");
  load_module(*model.tools, archive, "tools", checkpoint, built_from);
  model.tools->to(model.device);
}

// What a checkpoint records about the run's position and settings.
struct Progress : RunPosition {  // position: videos of the epoch's order used
  plan::StepSettings settings;
};

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
  progress.step = v[0];
  progress.epoch = v[1];
  progress.position = v[2];
  progress.skipped = v[3];
  progress.settings.chunk = v[4];
  progress.settings.keep = v[5];
  progress.settings.cache_frozen = v[6] != 0;
  progress.settings.precision = static_cast<engine::Precision>(v[7]);
  progress.stale_epochs = p.numel() > 8 ? v[8] : 0;  // patience starts over
  progress.settings.recompute_norm = p.numel() > 9 && v[9] != 0;
  progress.best_score = r[0].item<double>();
  progress.seconds = r[1].item<double>();
  return progress;
}

// The checkpoint's record of its run, of either format; nullopt where the file records none.
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

}  // namespace

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
  options.features_layout = data::parse_feature_layout(config.data.features_layout);
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
                dir.empty() ? "." : dir.string(),
                " (docs/training.md, \"Training on precomputed features\")");
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

namespace {

engine::FrameEncoder script_frame_encoder(std::shared_ptr<models::TorchScriptEncoderImpl> script) {
  return engine::frame_encoder(script,
                               [script](const torch::Tensor& x) { return script->forward(x); });
}

// A TorchScript encoder from config.model.script (or the module a checkpoint stored), in float32
// like framefit's own models.
std::shared_ptr<models::TorchScriptEncoderImpl> load_script_encoder(
    const Config& config, torch::Device device,
    std::shared_ptr<models::TorchScriptEncoderImpl> stored = nullptr) {
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

// Features per frame of a TorchScript encoder: one frame of the configured size through it in
// eval mode (no BatchNorm statistics move, no dropout draws).
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

namespace {

// A data set's per-video features of an encoder that trains nothing, one file per video in
// `folder`, valid for the settings that produced them (`fingerprint`): files made under other
// settings are removed first.
class FeatureCache {
 public:
  FeatureCache(std::string folder, const std::string& fingerprint) : folder_(std::move(folder)) {
    const auto stamp = folder_ + "/settings.yaml";
    std::ifstream in(stamp);
    const std::string stored((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
    if (stored != fingerprint) {
      std::filesystem::remove_all(folder_);
      make_directories(folder_);
      std::ofstream(stamp) << fingerprint;
    }
  }
  std::string path(int64_t video) const { return folder_ + "/" + std::to_string(video) + ".pt"; }
  bool has(int64_t video) const { return std::filesystem::exists(path(video)); }
  void write(int64_t video, const torch::Tensor& features) const {
    models::write_tensor(features, path(video));  // atomically: a killed run leaves no half file
  }
  // The prefetch job for video v of `set`: its kept features with its labels, or `load` where
  // none are kept or the file does not read or fit its frames (the manifest changed under the
  // same settings).
  data::Prefetcher::Job job(const data::VideoDataset& set, int64_t v, std::function<Video()> load,
                            int64_t feature_dim) const {
    if (!has(v)) return {std::move(load), set.frame_bytes(v)};
    return {[&set, v, file = path(v), load] {
              Video video;
              video.labels = set.labels(v);
              video.tools = set.tools(v);
              video.name = set.entry(v).name;
              try {
                video.features = models::read_tensor(file);
              } catch (const c10::Error&) {
                return load();
              }
              const bool fits =
                  video.features.dim() == 2 && video.features.size(0) == video.labels.size(0);
              return fits ? video : load();
            },
            set.frames(v) * feature_dim * 4};
  }
  const std::string& folder() const { return folder_; }

 private:
  std::string folder_;
};

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

namespace {
// evaluate(), taking and keeping the videos' features in `cache` where one is given, holding
// `prefetch_bytes` of decoded videos ahead (within a training budget, its prefetch reserve).
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
}  // namespace

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

// ---------------------------------------------------------------------------------------------

namespace {

// The share of the step budget a phases plan leaves free for what the memory model does not see.
constexpr double kStepMargin = 0.1;

// The step a phases run trains with: planned for the longest training video (and the largest
// frame) within train.budget less the prefetch reserve, unless chunk, keep and precision are all
// fixed, by the config or by `fixed` (a resumed run's settings).
struct StepPlan {
  plan::PlanRequest request;
  plan::StaticSizes sizes;  // planned only, as are the costs
  std::map<engine::Precision, plan::ChunkCosts> costs;
  plan::Plan chosen;
  bool planned = false;
  TrainingBudget resolved;  // train.budget as the run spends it
  // What the step may use of the tensors' budget, and the prefetch reserve the rest holds.
  int64_t step_budget = 0, prefetch = 0;
  // A resumed run under a changed budget: the prediction for the checkpoint's settings, and
  // whether they were replaced because they do not fit it.
  std::optional<plan::Plan> resumed;
  bool replanned = false;
};

// The step `train` runs for the longest training video, and the budget it is planned in:
// train.budget (else the device's available memory), less on the CPU the runtime's share, less
// the prefetch reserve.
StepPlan step_request(const Config& config, const data::VideoDataset& train_set) {
  const auto& tc = config.train;
  const torch::Device device(config.device);
  StepPlan result;
  result.resolved = resolve_budget(config);
  int64_t longest = 0, shortest = std::numeric_limits<int64_t>::max(), largest_bytes = 0;
  for (int64_t i = 0; i < train_set.size(); ++i) {
    longest = std::max(longest, train_set.frames(i));
    shortest = std::min(shortest, train_set.frames(i));
    largest_bytes = std::max(largest_bytes, train_set.frame_bytes(i));
  }
  result.step_budget = step_budget_bytes(config, result.resolved.tensors, largest_bytes);
  result.prefetch = prefetch_reserve_bytes(config, result.resolved.tensors, largest_bytes);
  auto& request = result.request;
  request.model = model_spec(config, frame_size_for_planning(train_set), device);
  request.frames = longest;
  request.shorter_videos = shortest < longest;
  // A step takes train.accumulate videos, or every one where there are fewer.
  request.videos = std::max<int64_t>(1, std::min<int64_t>(tc.accumulate, train_set.size()));
  request.accumulate = 1;
  request.chunk = fixed_count(tc.chunk);
  request.keep = fixed_count(tc.keep);
  request.precisions = tc.precision == "auto"
                           ? plan::candidate_precisions(device)
                           : std::vector<engine::Precision>{engine::parse_precision(tc.precision)};
  for (const auto precision : request.precisions) engine::check_runs_on(precision, device);
  return result;
}

// A resumed run (`fixed`) keeps the checkpoint's settings, so that it goes on as the
// uninterrupted run would have; with `check_fixed` (its budget changed) they are checked against
// the new budget and, where they do not fit, chunk, keep and caching are planned again as the
// config leaves them, the precision held (the loss scaler's state and the numbers stay its).
StepPlan plan_step(const Config& config, const data::VideoDataset& train_set,
                   const std::optional<plan::StepSettings>& fixed,
                   const std::function<void(const std::string&)>& info, bool check_fixed = false) {
  const torch::Device device(config.device);
  StepPlan result = step_request(config, train_set);
  auto& request = result.request;
  if (reads_features(config)) {
    // Only the head runs, in float32, on whole videos: nothing to choose or calibrate.
    request.model.size = 0;  // no frames
    result.chosen.fits = true;
    auto& settings = result.chosen.settings;
    settings.frames = settings.chunk = request.frames;
    settings.keep = 0;
    settings.precision = engine::Precision::FP32;
    return result;
  }
  // model.recompute_norm auto: the checkpoint's choice, else the planner's (below).
  const bool auto_norm = config.model.recompute_norm == "auto";
  if (fixed) {
    request.chunk = fixed->chunk;
    request.keep = fixed->keep;
    request.cache_frozen = fixed->cache_frozen;
    request.precisions = {fixed->precision};
    if (auto_norm) request.model.recompute_norm = fixed->recompute_norm;
  }
  // With chunk, keep and precision all fixed there is nothing to choose: no calibration, and an
  // out-of-memory step falls back to halving the chunk. Otherwise the planner decides.
  result.planned =
      !request.chunk || !request.keep || request.precisions.size() > 1 || (fixed && check_fixed);
  auto& chosen = result.chosen;
  if (!result.planned) {
    chosen.fits = true;
    chosen.settings.frames = request.frames;
    chosen.settings.shorter_videos = request.shorter_videos;
    chosen.settings.chunk = *request.chunk;
    chosen.settings.keep = *request.keep;
    chosen.settings.cache_frozen = request.cache_frozen.value_or(false);
    chosen.settings.precision = request.precisions.front();
    chosen.settings.recompute_norm = request.model.recompute_norm;
    return result;
  }
  // A TorchScript encoder is sized and calibrated on a copy loaded again from its file (probes
  // move BatchNorm statistics); its costs are not cached, as the file may change under its name.
  std::shared_ptr<models::TorchScriptEncoderImpl> probe_script;
  int64_t script_features = 0;
  if (is_script_encoder(config)) {
    probe_script = load_script_encoder(config, device);
    script_features = script_feature_dim(*probe_script, config, device);
  }
  const bool choose_norm = auto_norm && !fixed && !probe_script;
  result.sizes = probe_script ? plan::static_sizes(request.model, *probe_script, script_features)
                              : plan::static_sizes(request.model);
  result.sizes.library_bytes = plan::library_bytes_on(device);
  if (probe_script) {
    for (const auto precision : request.precisions) {
      info("calibrating the TorchScript encoder at " + engine::to_string(precision) +
           " (probe runs)");
      result.costs[precision] = plan::calibrate(request.model, script_frame_encoder(probe_script),
                                                script_features, precision);
    }
    chosen = plan::fit(request, result.sizes, result.costs, result.step_budget, kStepMargin);
  } else {
    plan::CalibrationCache cache(plan::CalibrationCache::default_path());
    result.costs = plan::calibrated_costs(request.model, request.precisions, cache, info);
    // request.model.recompute_norm and the costs (the replanner's) become those chosen.
    chosen = plan::plan_chunked_step(request, result.sizes, result.costs, cache, result.step_budget,
                                     kStepMargin, choose_norm, info);
  }
  if (!chosen.reason.empty()) info(chosen.reason);
  if (fixed && check_fixed) {
    result.resumed = chosen;
    const auto& tc = config.train;
    auto again = request;
    again.chunk = fixed_count(tc.chunk);
    again.keep = fixed_count(tc.keep);
    again.cache_frozen.reset();
    if (!chosen.fits) {
      const auto replanned =
          plan::fit(again, result.sizes, result.costs, result.step_budget, kStepMargin);
      if (replanned.fits) {
        chosen = replanned;
        result.replanned = true;
      }
      // Where nothing fits, the checkpoint's settings stay (as they ran before): a step that
      // runs out of memory is re-planned.
      chosen.fits = true;
    }
    // The out-of-memory replanner may change what the config leaves as auto.
    request = again;
  }
  return result;
}

}  // namespace

PhasePlan plan_phases(const Config& config, const EventCallback& on_event) {
  TORCH_CHECK(!is_batch_task(config), "plan_phases is for task phases; task ", config.task,
              " is planned by plan_batch_task");
  warn_if_budget_beyond_device(config, on_event);
  const auto train_set = make_dataset(config, config.data.train_split, true, on_event);
  TORCH_CHECK(train_set.size() > 0, no_videos_in_split(config, config.data.train_split));
  const auto step = plan_step(config, train_set, std::nullopt, [&](const std::string& message) {
    if (on_event) on_event(Event::note(Event::Kind::Info, message));
  });
  PhasePlan result;
  result.planned = step.planned;
  result.fits = step.chosen.fits;
  result.settings = step.chosen.settings;
  result.breakdown = step.chosen.breakdown;
  result.advice = step.chosen.advice;
  result.videos = train_set.size();
  result.longest_frames = step.request.frames;
  result.frame_size = step.request.model.size;
  result.budget = step.resolved;
  result.step_budget_bytes = step.step_budget;
  return result;
}

std::vector<plan::Finding> diagnose_phases(const Config& config, std::string* summary) {
  TORCH_CHECK(!is_batch_task(config), "diagnose_phases is for task phases; task ", config.task,
              " is checked by diagnose_batch_task");
  auto findings = diagnose_label_settings(config);
  const auto error = [&](const std::string& problem, const std::string& fix) {
    add_error_once(findings, problem, fix);
  };
  // Every split probed as training probes it, but each bad video reported instead of the first.
  auto probing = config;
  probing.data.on_error = "skip";
  std::optional<data::VideoDataset> train_set;
  for (const auto& split : distinct_splits(config)) {
    try {
      auto set = make_dataset(
          probing, split, split == config.data.train_split,
          skipped_as_errors(findings,
                            "fix or replace the file, or set data.on_error: skip to train "
                            "without it"));
      if (split == config.data.train_split) train_set.emplace(std::move(set));
    } catch (const c10::Error& e) {
      error(e.what_without_backtrace(), "fix the config or the manifest");
    }
  }
  if (!train_set || train_set->size() == 0) {
    if (train_set) {
      error(no_videos_in_split(config, config.data.train_split),
            "set data.train_split to a split of the manifest, or list training videos in it");
    }
    return findings;
  }
  if (reads_features(config)) {
    if (summary) {
      *summary = c10::str(train_set->size(), " training videos of precomputed features (",
                          train_set->feature_dim(), " per frame); the head trains on them alone");
    }
    return findings;
  }
  const auto step = step_request(config, *train_set);
  const auto more = plan::diagnose(step.request, step.step_budget);
  findings.insert(findings.end(), more.begin(), more.end());
  if (summary) {
    const int64_t size = step.request.model.size;
    *summary = c10::str(train_set->size(), " training videos, the longest ", step.request.frames,
                        " sampled frames at ", size, "x", size, "; step budget ",
                        memory::format_bytes(step.step_budget), " (",
                        describe_budget(step.resolved),
                        step.resolved.covers_process() ? " and " : " less ",
                        "the prefetch reserve); `framefit plan --config` chooses the settings");
  }
  return findings;
}

TrainResult train(const Config& given, const std::string& resume, const EventCallback& on_event,
                  const StopRequest& stop) {
  if (is_batch_task(given)) return train_batch(given, resume, on_event, stop);
  plan::refuse_errors(diagnose_label_settings(given));
  Config config = given;  // model.feature_dim comes from the data where it is 0
  auto emit = [&](Event e) {
    if (on_event) on_event(e);
  };
  auto info = [&](const std::string& message) { emit(Event::note(Event::Kind::Info, message)); };
  const auto& tc = config.train;
  RunFolder folder(config, resume);
  const std::string& out_dir = folder.out_dir;
  const std::string& resume_from = folder.resume_from;
  auto& resumed = folder.resumed;
  warn_if_budget_beyond_device(config, on_event);

  const torch::Device device(config.device);
  auto train_set = make_dataset(config, config.data.train_split, true, on_event);
  TORCH_CHECK(train_set.size() > 0, no_videos_in_split(config, config.data.train_split));
  std::optional<data::VideoDataset> val_set;
  if (tc.validate) {
    auto candidate = make_dataset(config, config.data.val_split, false, on_event);
    if (candidate.size() > 0) val_set.emplace(std::move(candidate));
  }
  warn_unused_splits(config, on_event);
  if (reads_features(config)) {
    const int64_t dim = train_set.feature_dim();
    TORCH_CHECK(config.model.feature_dim == 0 || config.model.feature_dim == dim,
                "model.feature_dim is ", config.model.feature_dim,
                " but the training split's features files have ", dim, " features per frame");
    TORCH_CHECK(!val_set || val_set->feature_dim() == dim,
                "the validation split's features files have ", val_set ? val_set->feature_dim() : 0,
                " features per frame, the training split's ", dim,
                ": both must come from the same encoder");
    config.model.feature_dim = dim;
  }
  info("data: " + std::to_string(train_set.size()) + " training videos (" +
       std::to_string(train_set.total_frames()) + " frames)" +
       (val_set ? ", " + std::to_string(val_set->size()) + " validation videos" : std::string()) +
       (train_set.skipped() ? ", " + std::to_string(train_set.skipped()) + " skipped"
                            : std::string()));

  write_config(config, out_dir);

  // A resumed run continues with the checkpoint's settings (the plan it was trained with, and
  // any re-planning after out-of-memory), so its steps are those of the uninterrupted run.
  std::optional<Progress> saved;
  if (resumed) {
    saved = read_video_progress(resumed->archive, resume_from);
    warn_config_changes(resumed->stored, config, saved->best_score, on_event);
    info("resuming from " + resume_from + " at step " + std::to_string(saved->step));
  }
  auto& tracker = memory::Tracker::of(device);
  const std::string budget_changed = resumed ? budget_change(resumed->stored, config) : "";
  const auto step_plan = plan_step(
      config, train_set, saved ? std::optional<plan::StepSettings>(saved->settings) : std::nullopt,
      info, !budget_changed.empty());
  const auto& chosen = step_plan.chosen;
  const bool planned = step_plan.planned;
  const int64_t step_budget = step_plan.step_budget;
  // Decoded videos held ahead (training and validation) stay within what the step budget leaves.
  const int64_t prefetch_bytes = step_plan.prefetch;
  const int64_t longest = step_plan.request.frames;
  TORCH_CHECK(chosen.fits, "training does not fit in ", describe_budget(step_plan.resolved), ": ",
              chosen.advice);

  // Built after calibration, which seeds the global generator for its probes: the model's
  // initialisation and the generator state training starts from must not depend on whether
  // the calibration was cached.
  Model model = build_model(config);
  Progress progress;
  if (saved) progress = *saved;
  progress.settings = chosen.settings;
  progress.settings.frames = longest;
  models::set_recompute_norm(model.encoder_module(), progress.settings.recompute_norm);
  if (step_plan.resumed) {
    const auto& kept = *step_plan.resumed;
    const std::string change = budget_changed + ": the checkpoint's " +
                               plan::describe(kept.settings) + " is predicted to need " +
                               memory::format_bytes(kept.breakdown.peak_bytes);
    const std::string limit = memory::format_bytes(kept.budget_bytes - kept.margin_bytes) +
                              " planned for (step budget " + memory::format_bytes(step_budget) +
                              c10::str(" less a ", std::lround(100 * kStepMargin), "% margin)");
    if (step_plan.replanned) {
      emit(Event::note(
          Event::Kind::Warning,
          change + ", more than the " + limit + "; re-planned to " +
              plan::describe(progress.settings) + " (predicted " +
              memory::format_bytes(chosen.breakdown.peak_bytes) +
              "): from here the run may differ from the uninterrupted one by rounding" +
              (config.model.norm == "bn" ? " and BatchNorm's statistics per chunk" : "")));
    } else if (kept.fits) {
      info(change + ", within the " + limit + "; kept, so the run goes on as it would have");
    } else {
      emit(Event::note(Event::Kind::Warning,
                       change + "; nothing fits the " + limit + " (" + kept.advice +
                           "): kept (a step that runs out of memory is re-planned)"));
    }
  }
  if (planned && !step_plan.resumed) {
    info("plan: " + plan::describe(progress.settings) + ", predicted peak " +
         memory::format_bytes(chosen.breakdown.peak_bytes) + " of " +
         memory::format_bytes(step_budget) +
         describe_step_budget(step_plan.resolved, step_budget, chosen.breakdown.peak_bytes));
  } else if (reads_features(config)) {
    info(c10::str("settings: the head alone on precomputed features (", model.feature_dim,
                  " per frame), float32, whole videos"));
  } else {
    info("settings: " + plan::describe(progress.settings) +
         (!saved                ? " (fixed by the config; not planned)"
          : step_plan.replanned ? " (re-planned for the new budget)"
                                : " (from the checkpoint)"));
  }

  const auto slow = engine::slow_precision_reason(progress.settings.precision, device);
  if (!slow.empty()) emit(Event::note(Event::Kind::Warning, slow));

  engine::StepOptions options;
  options.chunked.chunk = progress.settings.chunk;
  options.chunked.keep = progress.settings.keep;
  options.chunked.cache_frozen = progress.settings.cache_frozen;
  options.chunked.device = device;
  options.chunked.channels_last = channels_last_input(config, device);
  options.precision = progress.settings.precision;
  options.clip_grad_norm = tc.clip_grad_norm;
  options.loss.smoothing = tc.smoothing;
  options.loss.label_smoothing = tc.label_smoothing;
  if (tc.class_weights) {
    auto counts = torch::zeros({model.classes.size()}, torch::kDouble);
    for (int64_t i = 0; i < train_set.size(); ++i) {
      counts += torch::bincount(train_set.labels(i), {}, model.classes.size()).to(torch::kDouble);
    }
    const auto weights = engine::inverse_frequency_weights(counts);
    info("class weights (inverse frequency over the training frames): " +
         describe_class_weights(weights, model.classes.names()));
    options.loss.class_weights = weights.to(device);
    if (model.tools) {
      const auto k = model.tools->options.out_features();
      auto present = torch::zeros({k}, torch::kDouble),
           annotated = torch::zeros({k}, torch::kDouble);
      for (int64_t i = 0; i < train_set.size(); ++i) {
        const auto tools = train_set.tools(i).to(torch::kDouble);
        present += tools.clamp_min(0).sum(0);
        annotated += tools.ge(0).sum(0).to(torch::kDouble);
      }
      const auto positive = engine::tool_positive_weights(present, annotated);
      info("tool weights of present frames (absent over present annotated training frames): " +
           describe_class_weights(positive, config.data.tools));
      options.tool_positive_weight = positive.to(device);
    }
  }
  auto encoder = model.frame_encoder();
  std::optional<FeatureCache> feature_cache, val_feature_cache;
  if (encoder.parameters.empty() && tc.cache_features == "auto" && !reads_features(config)) {
    if (config.data.augment) {
      info(
          "the encoder trains nothing: with data.augment false its features would be computed "
          "once and the head trained on them in later epochs");
    } else {
      const auto fingerprint = feature_fingerprint(config, progress.settings.precision,
                                                   {&train_set, val_set ? &*val_set : nullptr});
      feature_cache.emplace(out_dir + "/feature_cache", fingerprint);
      if (val_set) val_feature_cache.emplace(out_dir + "/feature_cache/validation", fingerprint);
      options.return_features = true;
      info("the encoder trains nothing: each video's features are kept in " +
           feature_cache->folder() + " after its first step (validation: its first " +
           "evaluation), and later epochs run the head on them without decoding the video");
    }
  }
  auto parameters = encoder.parameters;
  for (auto& p : model.head->parameters()) parameters.push_back(p);
  if (model.tools) {
    for (auto& p : model.tools->parameters()) parameters.push_back(p);
    options.tool_weight = tc.tool_weight;
  }
  auto optimizer = engine::make_optimizer(parameters, optimizer_options(tc));
  engine::TrainingStep step(encoder, model.head, optimizer, options,
                            model.tools ? model.tools.ptr() : nullptr);
  if (planned) {
    step.replan = plan::make_replanner(step_plan.request, step_plan.sizes,
                                       step_plan.costs.at(progress.settings.precision),
                                       progress.settings.precision, step_budget, kStepMargin);
  }

  if (resumed) {
    const std::string built_from = "the config this run resumes with";
    load_module(model.encoder_module(), resumed->archive, "encoder", resume_from, built_from);
    load_module(*model.head, resumed->archive, "head", resume_from, built_from);
    read_tool_head(resumed->archive, model, resume_from, built_from);
    model.encoder_module().to(device);
    model.head->to(device);
    read_resume_state(resumed->archive, *optimizer, step.scaler(), device);
  }

  const int64_t videos = train_set.size();
  const auto run = run_length(tc, (videos + tc.accumulate - 1) / tc.accumulate,
                              std::min<int64_t>(tc.accumulate, videos));
  const memory::ScopedBudget budget_scope(tracker, step_plan.resolved.tensors,
                                          step_plan.resolved.held_limit());

  RunHooks hooks;
  hooks.start_epoch = [&] {
    struct Epoch {
      std::vector<int64_t> order;
      std::optional<data::Prefetcher> prefetcher;
      std::vector<Video> batch;           // the next step's videos
      std::vector<int64_t> batch_videos;  // their indices in train_set
    };
    auto epoch = std::make_shared<Epoch>();
    epoch->order = data::epoch_order(videos, tc.seed, progress.epoch, true);
    std::vector<data::Prefetcher::Job> jobs;
    int64_t from_cache = 0;
    for (int64_t k = progress.position; k < videos; ++k) {
      const int64_t v = epoch->order[k];
      const auto augmentation = train_set.augmentation(v, tc.seed, progress.epoch);
      auto load = [&train_set, v, augmentation] { return train_set.load(v, augmentation); };
      if (feature_cache) {
        from_cache += feature_cache->has(v);
        jobs.push_back(feature_cache->job(train_set, v, load, model.feature_dim));
      } else {
        jobs.push_back({load, train_set.frame_bytes(v)});
      }
    }
    if (from_cache > 0) {
      info(c10::str("epoch ", progress.epoch + 1, ": ", from_cache, " of ", jobs.size(),
                    " videos' features from the feature cache"));
    }
    epoch->prefetcher.emplace(std::move(jobs), static_cast<int>(config.data.workers),
                              prefetch_bytes);
    EpochSteps steps;
    steps.done = [&] { return progress.position >= videos; };
    steps.fetch = [&, epoch] {
      while (static_cast<int64_t>(epoch->batch.size()) < tc.accumulate &&
             progress.position < videos) {
        const int64_t v = epoch->order[progress.position];
        ++progress.position;
        try {
          epoch->batch.push_back(epoch->prefetcher->next());
          epoch->batch_videos.push_back(v);
        } catch (const c10::Error& e) {
          if (!data::skips_error(train_set.options().skip_bad, e)) throw;
          ++progress.skipped;
          emit(Event::note(Event::Kind::Warning,
                           std::string("skipping a video: ") + e.what_without_backtrace()));
        }
      }
      return !epoch->batch.empty();
    };
    steps.step = [&, epoch](double lr) {
      // Taken out of the epoch, so that they are let go when the step ends.
      const auto batch = std::move(epoch->batch);
      const auto batch_videos = std::move(epoch->batch_videos);
      epoch->batch.clear();
      epoch->batch_videos.clear();
      for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
      model.encoder_module().train();  // validation and prediction leave it in eval mode
      model.head->train();
      if (model.tools) model.tools->train();
      const auto report = step.step(batch);
      if (feature_cache) {
        for (size_t i = 0; i < batch.size(); ++i) {
          if (!batch[i].features.defined())
            feature_cache->write(batch_videos[i], report.features[i]);
        }
      }
      // A step that ran out of memory was retried with new settings: later steps and
      // checkpoints (so a resumed run) use them.
      progress.settings.chunk = step.options().chunked.chunk;
      progress.settings.keep = step.options().chunked.keep;
      progress.settings.cache_frozen = step.options().chunked.cache_frozen;
      for (const auto& r : report.replans) emit(Event::note(Event::Kind::Warning, r));
      return StepOutcome{report.loss,       report.frames,
                         "frames",          report.seconds,
                         report.peak_bytes, report.overflow_skipped || report.not_finite_skipped,
                         report.phases};
    };
    steps.release = [epoch] { epoch->prefetcher.reset(); };
    return steps;
  };
  hooks.write = [&](const RunPosition& at, torch::serialize::OutputArchive& archive) {
    write_model(archive, model);
    write_progress(archive, at_position(progress, at));
  };
  hooks.optimizer = optimizer.get();
  hooks.scaler = &step.scaler();
  if (val_set) {
    hooks.validate = [&] {
      model.precision = progress.settings.precision;  // validate as `framefit eval` will
      if (device.is_cpu() && model.precision == engine::Precision::FP16)
        model.precision = engine::Precision::FP32;
      return evaluate_with(model, *val_set, {}, nullptr, {},
                           val_feature_cache ? &*val_feature_cache : nullptr, prefetch_bytes);
    };
  }
  hooks.class_names = model.classes.names();
  hooks.tool_names = config.data.tools;
  hooks.precision = progress.settings.precision;

  auto result = run_epochs(progress, run, config, resumed.has_value(), hooks, stop, on_event);
  result.skipped_videos = progress.skipped + train_set.skipped();
  return result;
}

}  // namespace framefit::train
