#include "run_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "framefit/models/torchscript.h"
#include "framefit/models/weights.h"

namespace framefit::train::detail {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void make_directories(const std::string& path) {
  std::string partial;
  std::stringstream parts(path);
  std::string part;
  if (!path.empty() && path[0] == '/') partial = "/";
  while (std::getline(parts, part, '/')) {
    if (part.empty()) continue;
    partial += part + "/";
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "cannot create directory ", partial, ": ", std::strerror(errno));
    }
  }
}

models::LoadReport load_model_weights(torch::nn::Module& module, const Config& config,
                                      bool strict) {
  models::LoadOptions options;
  options.strict = strict;
  options.ignore_prefixes = {"fc."};  // the classifier is for ImageNet's classes
  options.prefix = config.model.weights_prefix;
  options.find_prefix = true;
  try {
    return models::load_state_dict(module, models::read_state_dict(config.model.weights), options);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "model.weights ", config.model.weights, ": ", e.what_without_backtrace(),
                config.model.weights_prefix.empty()
                    ? "(if the weights sit under a key prefix, name it in model.weights_prefix)"
                    : "");
  }
}

std::vector<std::string> list_files(const std::string& folder, const std::string& prefix,
                                    const std::string& suffix) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (const dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (name.rfind(prefix, 0) == 0 && name.size() >= suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        names.push_back(folder + "/" + name);
      }
    }
    ::closedir(dir);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  const std::string temp = path + ".tmp";
  archive.save_to(temp);
  const int fd = ::open(temp.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0 && ::fsync(fd) == 0, "checkpoint ", temp, ": cannot flush to disk");
  ::close(fd);
  TORCH_CHECK(std::rename(temp.c_str(), path.c_str()) == 0, "checkpoint ", path,
              ": cannot rename the temporary file into place: ", std::strerror(errno));
  const auto slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : path.substr(0, slash);
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    ::fsync(dir);  // the rename itself
    ::close(dir);
  }
}

torch::Tensor generator_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_generator_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

bool stop_requested(const StopRequest& stop, int64_t step, TrainResult& result,
                    const EventCallback& on_event) {
  if (!stop || !stop()) return false;
  result.stopped = true;
  if (on_event)
    on_event(Event::note(Event::Kind::Info, c10::str("stopping at step ", step, " as requested")));
  return true;
}

bool last_weights_are_best(bool validation_split, double best_score, const TrainResult& result,
                           const EventCallback& on_event) {
  if (result.stopped) return false;
  if (!validation_split) return true;
  if (best_score >= 0) return false;
  if (on_event) {
    on_event(Event::note(Event::Kind::Info, "the run ended before a validation chose a best: " +
                                                result.best_checkpoint +
                                                " holds the last weights"));
  }
  return true;
}

void warn_config_changes(const Config& stored, const Config& resumed_with, double& best_score,
                         const EventCallback& on_event) {
  const bool new_metric = best_metric(stored) != best_metric(resumed_with);
  if (new_metric) best_score = -1;
  const auto changed = config_differences(stored, resumed_with);
  if (changed.empty() || !on_event) return;
  on_event(Event::note(
      Event::Kind::Warning,
      "the config differs from the checkpoint's; training goes on with the new values: " +
          c10::Join("; ", changed) +
          (new_metric ? "; best.pt is chosen by " + best_metric(resumed_with) +
                            " from the next validation on"
                      : std::string())));
}

Config read_config(torch::serialize::InputArchive& archive, const std::string& path) {
  c10::IValue format, text;
  TORCH_CHECK(archive.try_read("format", format) && format.isString() &&
                  format.toStringRef() == "framefit-checkpoint-1",
              path, " is not a framefit checkpoint (to load plain weights, use model.weights)");
  archive.read("config", text);
  return parse_config(text.toStringRef(), "the config stored in " + path);
}

torch::serialize::InputArchive open_archive(const std::string& path) {
  struct stat info {};
  TORCH_CHECK(::stat(path.c_str(), &info) == 0, "checkpoint ", path, ": no such file");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint ", path,
                " cannot be read (damaged or not a checkpoint): ", e.what_without_backtrace());
  }
  return archive;
}

void write_script(torch::serialize::OutputArchive& archive,
                  const models::TorchScriptEncoderImpl& script) {
  std::ostringstream bytes;
  script.save_module(bytes);
  archive.write("script_module", c10::IValue(bytes.str()));
}

std::shared_ptr<models::TorchScriptEncoderImpl> read_script(torch::serialize::InputArchive& archive,
                                                            const std::string& checkpoint,
                                                            torch::Device device) {
  c10::IValue bytes;
  if (!archive.try_read("script_module", bytes)) return nullptr;
  std::istringstream in(bytes.toStringRef());
  return std::make_shared<models::TorchScriptEncoderImpl>(
      in, "the TorchScript module stored in " + checkpoint, device);
}

void prune_checkpoints(const std::string& folder, int64_t keep) {
  auto files = list_files(folder, "step_", ".pt");
  for (size_t i = 0; i + keep < files.size(); ++i) std::remove(files[i].c_str());
}

std::string resume_path(const std::string& resume, const std::string& out_dir,
                        const std::string& checkpoint_dir) {
  if (resume == "auto") {
    const auto files = list_files(checkpoint_dir, "step_", ".pt");
    TORCH_CHECK(!files.empty(), "--resume: no checkpoint in ", checkpoint_dir, " to resume from");
    return files.back();
  }
  if (resume.empty()) {
    TORCH_CHECK(list_files(checkpoint_dir, "step_", ".pt").empty(), out_dir,
                " already holds checkpoints: resume it with --resume, or choose another "
                "train.out_dir");
  }
  return resume;
}

std::optional<int64_t> fixed_count(const std::string& text) {
  if (text == "auto") return std::nullopt;
  return std::stoll(text);
}

void write_config(const Config& config, const std::string& out_dir) {
  std::ofstream out(out_dir + "/config.yaml");
  out << to_yaml(config);
  TORCH_CHECK(out.good(), "cannot write ", out_dir, "/config.yaml");
}

std::string step_checkpoint_path(const std::string& checkpoint_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "/step_%08lld.pt", static_cast<long long>(step));
  return checkpoint_dir + name;
}

void write_resume_state(torch::serialize::OutputArchive& archive,
                        torch::optim::Optimizer& optimizer, const engine::LossScaler& scaler) {
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("scaler", scaler.state());
  archive.write("rng", generator_state());
}

void read_resume_state(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer,
                       engine::LossScaler& scaler) {
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);
  torch::Tensor scaler_state, rng;
  archive.read("scaler", scaler_state);
  archive.read("rng", rng);
  scaler.load_state(scaler_state);
  set_generator_state(rng);
}

std::string describe_class_weights(const torch::Tensor& weights,
                                   const std::vector<std::string>& names) {
  const auto w = weights.to(torch::kDouble).cpu();
  std::string out;
  for (int64_t c = 0; c < w.numel(); ++c) {
    char value[32];
    std::snprintf(value, sizeof(value), "%.3g", w[c].item<double>());
    out +=
        (c ? ", " : "") + (c < static_cast<int64_t>(names.size()) ? names[c] : "?") + " " + value;
  }
  return out;
}

engine::OptimizerOptions optimizer_options(const TrainConfig& train) {
  engine::OptimizerOptions options;
  options.kind = train.optimizer;
  options.lr = train.lr;
  options.weight_decay = train.weight_decay;
  options.momentum = train.momentum;
  return options;
}

RunLength run_length(const TrainConfig& train, int64_t steps_per_epoch) {
  RunLength run;
  run.steps_per_epoch = std::max<int64_t>(1, steps_per_epoch);
  run.total_steps = train.max_steps > 0 ? train.max_steps : train.epochs * run.steps_per_epoch;
  run.epochs = (run.total_steps + run.steps_per_epoch - 1) / run.steps_per_epoch;
  run.schedule.kind = train.schedule;
  run.schedule.lr = train.lr;
  run.schedule.warmup = train.warmup_steps;
  run.schedule.step_size = train.step_size > 0 ? train.step_size : run.steps_per_epoch;
  run.schedule.gamma = train.gamma;
  run.schedule.min_lr = train.min_lr;
  return run;
}

double EpochTotals::data_fraction() const {
  const double total = data_seconds + step_seconds;
  return total > 0 ? data_seconds / total : 0;
}

void report_step(Event& e, const StepOutcome& step, double seconds_per_step, JsonlLog& log,
                 EpochTotals& epoch) {
  if (std::isfinite(step.loss)) {  // a skipped step (LossWatch) does not make the mean NaN
    epoch.loss_sum += step.loss;
    ++epoch.steps;
  }
  epoch.data_seconds += step.data_seconds;
  epoch.step_seconds += step.seconds;
  e.data_seconds = step.data_seconds;
  e.loss = step.loss;
  e.lr = step.lr;
  e.frames_per_second = step.count / std::max(1e-9, step.seconds);
  e.eta_seconds = seconds_per_step * static_cast<double>(e.total_steps - e.step);
  e.peak_bytes = step.peak_bytes;
  e.rss_bytes = memory::process_memory().rss_bytes;
  log.write({{"type", "step"},
             {"step", e.step},
             {"epoch", e.epoch},
             {"loss", e.loss},
             {"lr", e.lr},
             {step.counted, step.count},
             {"seconds", step.seconds},
             {"data_seconds", step.data_seconds},
             {"peak_bytes", step.peak_bytes},
             {"rss_bytes", e.rss_bytes},
             {"skipped_optimizer_step", step.update_skipped}});
}

void end_epoch(Event e, const EpochTotals& totals, const EpochValidation& validation,
               const std::vector<std::string>& class_names, double& best_score,
               int64_t& stale_epochs, TrainResult& result, const EventCallback& emit,
               JsonlLog& log) {
  e.loss = totals.steps ? totals.loss_sum / static_cast<double>(totals.steps) : 0;
  e.data_seconds = totals.data_seconds;
  e.data_fraction = totals.data_fraction();
  nlohmann::json record = {{"type", "epoch"},
                           {"step", e.step},
                           {"epoch", e.epoch},
                           {"loss", e.loss},
                           {"data_seconds", totals.data_seconds},
                           {"step_seconds", totals.step_seconds}};
  if (validation.validate) {
    e.metrics = validation.validate();
    e.validated = true;
    record["val"] = nlohmann::json::parse(to_json(e.metrics, class_names, validation.tool_names));
    const double score = metric_value(e.metrics, validation.best_by);
    ++stale_epochs;
    if (score > best_score) {
      best_score = score;
      stale_epochs = 0;
      e.best = true;
      validation.save_best();
      result.best = e.metrics;
      result.validated = true;
    }
    record["best"] = e.best;
  }
  emit(e);
  log.write(record);
}

namespace {
std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

// A fifth of the time or more, and a second at least: an epoch always waits for its first video.
bool data_bound(const EpochTotals& epoch) {
  return epoch.data_seconds >= 1 && epoch.data_fraction() >= 0.2;
}
}  // namespace

void warn_if_data_bound(const EpochTotals& epoch, int64_t epoch_number, const Config& config,
                        bool& warned, const EventCallback& emit) {
  if (warned || !data_bound(epoch)) return;
  warned = true;
  const auto& d = config.data;
  std::string text = c10::str(
      "epoch ", epoch_number, ": ", static_cast<int>(100 * epoch.data_fraction() + 0.5),
      "% of the training time went to getting data (", seconds_text(epoch.data_seconds), " of ",
      seconds_text(epoch.data_seconds + epoch.step_seconds),
      "), not to training steps: the input pipeline sets the speed. Try more data.workers (now ",
      d.workers, "; this machine has ", std::max(1u, std::thread::hardware_concurrency()),
      " cores, shared with training)");
  const bool jitter = d.brightness > 0 || d.contrast > 0 || d.saturation > 0 || d.hue > 0;
  if (config.model.encoder == "features") {
    text += "; the features files are read from disk";
  } else if (d.augment && (jitter || d.rotation > 0)) {
    text += "; colour jitter and rotation run in the workers too";
  }
  if (config.task != "segmentation" && config.model.encoder != "features") {
    text +=
        "; a video file is decoded from its start to its last sampled frame, a frame folder "
        "reads only the sampled frames";
  }
  emit(Event::note(Event::Kind::Warning, text));
}

bool LossWatch::diverging(double loss, int64_t step, const EventCallback& emit) {
  if (std::isfinite(loss)) {
    in_a_row_ = 0;
    return false;
  }
  ++in_a_row_;
  if (emit) {
    emit(
        Event::note(Event::Kind::Warning,
                    c10::str("step ", step, ": the loss is ", std::isnan(loss) ? "NaN" : "infinite",
                             ": the update was skipped (the weights and BatchNorm statistics are "
                             "those before the step)")));
  }
  return in_a_row_ >= kInARow;
}

void LossWatch::diverged(const std::string& checkpoint, const Config& config,
                         engine::Precision precision) const {
  const auto& tc = config.train;
  TORCH_CHECK(false, "training diverged: the loss was not finite (NaN or infinite) in ", in_a_row_,
              " steps in a row; their updates were skipped. ", checkpoint,
              " holds the weights the last finite step left, which may already be far off: lower "
              "train.lr (now ",
              tc.lr, ")", tc.clip_grad_norm > 0 ? "" : ", set train.clip_grad_norm (e.g. 1)",
              precision == engine::Precision::FP16 ? ", train in bf16 or fp32 instead of fp16" : "",
              ", and resume from it or an earlier checkpoint (--resume PATH, --set for the changed "
              "keys), or start again");
}

bool patience_exhausted(const Config& config, int64_t stale_epochs, TrainResult& result,
                        const EventCallback& emit) {
  const int64_t patience = config.train.patience;
  if (patience <= 0 || stale_epochs < patience) return false;
  result.stopped_early = true;
  emit(Event::note(Event::Kind::Info, c10::str("stopping early: validation ", best_metric(config),
                                               " has not improved for ", stale_epochs,
                                               " epochs (train.patience ", patience, ")")));
  return true;
}

}  // namespace framefit::train::detail
