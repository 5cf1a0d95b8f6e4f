#include "run_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "framefit/core/errors.h"
#include "framefit/core/random.h"
#include "framefit/core/runtime.h"
#include "framefit/models/torchscript.h"
#include "framefit/models/weights.h"
#include "framefit/plan/planner.h"

namespace framefit::train::detail {

int64_t RunRecord::setting(const std::string& name, int64_t absent) const {
  const auto it = settings.find(name);
  return it == settings.end() ? absent : it->second;
}

torch::Tensor RunRecord::tensor(const std::string& name) const {
  const auto it = tensors.find(name);
  return it == tensors.end() ? torch::Tensor() : it->second;
}

RunPosition first_format_position(const torch::Tensor& progress, const torch::Tensor& real) {
  const auto* v = progress.data_ptr<int64_t>();
  RunPosition position;
  position.step = v[0];
  position.epoch = v[1];
  position.position = v[2];
  position.skipped = v[3];
  position.best_score = real[0].item<double>();
  position.seconds = real[1].item<double>();
  return position;
}

void write_run_record(torch::serialize::OutputArchive& archive, const RunRecord& record) {
  torch::serialize::OutputArchive run, settings, tensors;
  const RunPosition& p = record.position;
  run.write("format", c10::IValue(kRunRecordFormat));
  run.write("step", c10::IValue(p.step));
  run.write("epoch", c10::IValue(p.epoch));
  run.write("position", c10::IValue(p.position));
  run.write("skipped", c10::IValue(p.skipped));
  run.write("best_score", c10::IValue(p.best_score));
  run.write("stale_epochs", c10::IValue(p.stale_epochs));
  run.write("seconds", c10::IValue(p.seconds));
  for (const auto& [name, value] : record.settings) settings.write(name, c10::IValue(value));
  for (const auto& [name, value] : record.tensors) tensors.write(name, value);
  run.write("settings", settings);
  run.write("tensors", tensors);
  archive.write("run", run);
}

std::optional<RunRecord> read_run_record(torch::serialize::InputArchive& archive,
                                         const std::string& checkpoint) {
  torch::serialize::InputArchive run;
  if (!archive.try_read("run", run)) return std::nullopt;
  const auto value = [&](const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(run.try_read(key, v), "checkpoint ", checkpoint, ": its run record has no `", key,
                "`: the file is damaged; resume from another checkpoint");
    return v;
  };
  const int64_t format = value("format").toInt();
  TORCH_CHECK(format <= kRunRecordFormat, "checkpoint ", checkpoint, " has run record format ",
              format, ", newer than this framefit reads (", kRunRecordFormat,
              "): resume it with the framefit that wrote it, or a newer one");
  RunRecord record;
  RunPosition& p = record.position;
  p.step = value("step").toInt();
  p.epoch = value("epoch").toInt();
  p.position = value("position").toInt();
  p.skipped = value("skipped").toInt();
  p.best_score = value("best_score").toDouble();
  p.stale_epochs = value("stale_epochs").toInt();
  p.seconds = value("seconds").toDouble();
  torch::serialize::InputArchive settings, tensors;
  TORCH_CHECK(run.try_read("settings", settings) && run.try_read("tensors", tensors), "checkpoint ",
              checkpoint,
              ": its run record has no settings: the file is damaged; resume from another "
              "checkpoint");
  for (const auto& name : settings.keys()) {
    c10::IValue v;
    settings.read(name, v);
    record.settings[name] = v.toInt();
  }
  for (const auto& name : tensors.keys()) {
    torch::Tensor t;
    tensors.read(name, t);
    record.tensors[name] = t;
  }
  return record;
}

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
  // mkdir says EEXIST for a file too, which was found only when the first output was written.
  struct stat info {};
  TORCH_CHECK(::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode), "cannot create directory ",
              path, ": a file of that name exists");
}

void warn_if_budget_beyond_device(const Config& config, const memory::Tracker& tracker,
                                  const EventCallback& on_event) {
  const auto warning = plan::budget_beyond_device(config.train.budget, tracker.available_bytes(),
                                                  torch::Device(config.device), "train.budget");
  if (!warning.empty() && on_event) on_event(Event::note(Event::Kind::Warning, warning));
}

RunFolderLock::RunFolderLock(const std::string& out_dir) {
  const std::string path = out_dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot create ", path, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    char holder[32] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
    ::close(fd_);
    fd_ = -1;
    std::string pid = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "";
    pid.erase(std::remove_if(pid.begin(), pid.end(), [](char c) { return !std::isdigit(c); }),
              pid.end());
    TORCH_CHECK(error != EWOULDBLOCK, "train.out_dir ", out_dir,
                " is in use by another framefit train",
                pid.empty() ? std::string() : " (process " + pid + ")",
                ": wait for it to end, or choose another train.out_dir");
    TORCH_CHECK(false, "cannot lock ", path, ": ", std::strerror(error));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  // The pid only makes the message above more helpful: failing to write it is not an error.
  [[maybe_unused]] const bool written =
      ::ftruncate(fd_, 0) == 0 &&
      ::pwrite(fd_, pid.data(), pid.size(), 0) == static_cast<ssize_t>(pid.size());
}

RunFolderLock::~RunFolderLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
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
  try {
    models::write_file_atomically(path, [&](const models::ByteSink& sink) {
      archive.save_to([&](const void* data, size_t size) {
        sink(data, size);
        return size;
      });
    });
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.what_without_backtrace(),
                ". Checkpoints written before are kept: make room and resume with --resume auto");
  }
}

std::string budget_change(const Config& stored, const Config& resumed_with) {
  const auto text = [](int64_t budget) {
    return budget > 0 ? memory::format_bytes(budget) : std::string("0 (the free memory)");
  };
  if (stored.train.budget == resumed_with.train.budget) return "";
  return "train.budget changed from " + text(stored.train.budget) + " to " +
         text(resumed_with.train.budget);
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

std::optional<ResumedRun> open_resumed(const std::string& checkpoint, const Config& resumed_with) {
  if (checkpoint.empty()) return std::nullopt;
  auto archive = open_archive(checkpoint);
  auto stored = read_config(archive, checkpoint);
  TORCH_CHECK(stored.task == resumed_with.task, "--resume ", checkpoint, ": a checkpoint of task ",
              stored.task, ", and this config is for task ", resumed_with.task,
              ": resume from a checkpoint of this run (--resume auto), or start a new one");
  // best.pt holds the weights alone (no optimizer, scaler or generator state to go on with).
  torch::Tensor rng;
  TORCH_CHECK(archive.try_read("rng", rng), "--resume ", checkpoint,
              ": holds the weights alone, as best.pt does; resume from a step checkpoint "
              "(RUN/checkpoints/step_N.pt, or --resume auto for the newest)");
  return ResumedRun{std::move(archive), std::move(stored)};
}

namespace {
const std::string& with_checkpoint_folder(const std::string& out_dir) {
  make_directories(out_dir + "/checkpoints");
  return out_dir;
}
}  // namespace

RunFolder::RunFolder(const Config& config, const std::string& resume)
    : out_dir(with_checkpoint_folder(config.train.out_dir)),
      lock(out_dir),
      resume_from(resume_path(resume, out_dir, out_dir + "/checkpoints")),
      resumed(open_resumed(resume_from, config)) {}

torch::serialize::InputArchive open_archive(const std::string& path) {
  struct stat info {};
  TORCH_CHECK(::stat(path.c_str(), &info) == 0, "checkpoint ", path, ": no such file");
  models::check_archive(path, "checkpoint " + path);
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint ", path,
                " cannot be read (damaged or not a checkpoint): ", error_text(e));
  }
  return archive;
}

void load_module(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                 const std::string& key, const std::string& checkpoint,
                 const std::string& built_from) {
  torch::serialize::InputArchive part;
  TORCH_CHECK(archive.try_read(key, part), "checkpoint ", checkpoint, " holds no `", key,
              "` weights: it is not a complete framefit checkpoint");
  const std::string advice = "the model.* keys that shape the network must stay as trained";
  // LibTorch's load replaces a tensor with the stored one whatever its size (Tensor::set_), so a
  // model built with --set model.lstm_hidden=64 took the checkpoint's 512 without a word.
  std::map<std::string, std::vector<int64_t>> built_sizes;
  for (const auto& item : module.named_parameters()) built_sizes[item.key()] = item->sizes().vec();
  for (const auto& item : module.named_buffers()) built_sizes[item.key()] = item->sizes().vec();
  try {
    module.load(part);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint ", checkpoint, ": its `", key,
                "` weights do not fit the model built from ", built_from, " (", error_text(e),
                "): ", advice);
  }
  const auto check = [&](const std::string& name, const torch::Tensor& loaded) {
    const auto& built = built_sizes.at(name);
    TORCH_CHECK(loaded.sizes() == c10::IntArrayRef(built), "checkpoint ", checkpoint, ": its `",
                key, ".", name, "` is ", loaded.sizes(), " where the model built from ", built_from,
                " has ", c10::IntArrayRef(built), ": ", advice);
  };
  for (const auto& item : module.named_parameters()) check(item.key(), *item);
  for (const auto& item : module.named_buffers()) check(item.key(), *item);
}

Config config_with_overrides(const Config& stored, const std::string& checkpoint,
                             const std::vector<std::string>& overrides) {
  Config config = overrides.empty() ? stored
                                    : parse_config(to_yaml(stored),
                                                   "the config stored in " + checkpoint, overrides);
  // A model trained on a GPU, read on a machine without one: LibTorch's own words were "PyTorch
  // is not linked with support for cuda devices".
  const auto unavailable = device_unavailable(config.device);
  TORCH_CHECK(unavailable.empty(), "checkpoint ", checkpoint, ": device ", config.device,
              overrides.empty() ? " (as it was trained)" : "", " cannot be used: ", unavailable,
              "; add --set device=cpu");
  static const std::set<std::string> free_keys = {
      "model.layout", "model.lean_backward", "model.recompute_norm", "model.weights",
      "model.weights_prefix", "model.freeze"};
  std::vector<std::string> fixed;
  for (const auto& change : config_differences(stored, config)) {
    const auto key = change.substr(0, change.find(':'));
    if ((key == "task" || key.rfind("model.", 0) == 0) && free_keys.count(key) == 0)
      fixed.push_back(change);
  }
  TORCH_CHECK(fixed.empty(), "checkpoint ", checkpoint,
              " holds a trained model, which --set cannot change: ", c10::Join("; ", fixed),
              " (of the model keys, only model.layout, model.lean_backward and "
              "model.recompute_norm, which choose how it runs, may be set here)");
  return config;
}

std::string stored_config_with(const std::vector<std::string>& overrides) {
  return overrides.empty() ? "its stored config"
                           : "its stored config with --set " + c10::Join(" --set ", overrides);
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

std::vector<std::string> distinct_splits(const Config& config) {
  std::vector<std::string> splits;
  for (const auto& split :
       {config.data.train_split, config.data.val_split, config.data.test_split}) {
    if (std::find(splits.begin(), splits.end(), split) == splits.end()) splits.push_back(split);
  }
  return splits;
}

void add_error_once(std::vector<plan::Finding>& findings, const std::string& problem,
                    const std::string& fix) {
  for (const auto& f : findings) {
    if (f.problem == problem) return;
  }
  findings.push_back({plan::Finding::Severity::Error, problem, fix});
}

EventCallback skipped_as_errors(std::vector<plan::Finding>& findings, const std::string& fix) {
  return [&findings, fix](const Event& e) {
    if (e.kind != Event::Kind::Warning) return;
    const std::string skipping = "skipping ";
    add_error_once(
        findings, e.message.rfind(skipping, 0) == 0 ? e.message.substr(skipping.size()) : e.message,
        fix);
  };
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

void write_config(const Config& config, const std::string& out_dir) {
  const std::string path = out_dir + "/config.yaml";
  // One that already says the same (the user's own given as --config, with its comments, or an
  // earlier run's) is kept; one that does not load is written anew.
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    try {
      if (config_differences(load_config(path), config).empty()) return;
    } catch (const c10::Error&) {
    }
  }
  std::ofstream out(path);
  out << to_yaml(config);
  out.flush();  // so that a full disk shows here
  TORCH_CHECK(out.good(), "cannot write ", out_dir, "/config.yaml");
}

std::string step_checkpoint_path(const std::string& checkpoint_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "/step_%08lld.pt", static_cast<long long>(step));
  return checkpoint_dir + name;
}

void write_resume_state(torch::serialize::OutputArchive& archive,
                        torch::optim::Optimizer& optimizer, const engine::LossScaler& scaler,
                        torch::Device device) {
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("scaler", scaler.state());
  archive.write("rng", generator_state(torch::kCPU));
  // Dropout on CUDA draws from the device's generator.
  if (device.is_cuda()) archive.write("rng_cuda", generator_state(device));
}

void read_resume_state(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer,
                       engine::LossScaler& scaler, torch::Device device) {
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);
  torch::Tensor scaler_state, rng, rng_cuda;
  archive.read("scaler", scaler_state);
  archive.read("rng", rng);
  scaler.load_state(scaler_state);
  set_generator_state(torch::kCPU, rng);
  // A run that moved between the CPU and CUDA (the config's device changed, which the resume
  // warning lists) draws from a generator in another state, as any fresh one would.
  if (device.is_cuda() && archive.try_read("rng_cuda", rng_cuda))
    set_generator_state(device, rng_cuda);
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

}  // namespace framefit::train::detail
