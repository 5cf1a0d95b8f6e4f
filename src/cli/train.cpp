// make-demo, train, eval, predict, export: the library does the work and reports through
// events; this file renders them (a progress bar on a terminal, plain lines otherwise).
#include <fmt/core.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>

#include "commands.h"
#include "framefit/core/runtime.h"
#include "framefit/data/dataset.h"
#include "framefit/data/demo.h"
#include "framefit/data/media.h"
#include "framefit/memory/tracker.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"
#include "framefit/train/timeline.h"
#include "framefit/train/trainer.h"

namespace framefit::cli {

namespace {

std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// "1 frame", "12 frames": a count and its unit, plural for a count other than one.
std::string count_of(int64_t n, const std::string& unit) {
  return c10::str(n, " ", unit, n == 1 ? "" : "s");
}

std::string percent(double v) { return std::isnan(v) ? "  -  " : fmt::format("{:5.1f}", 100 * v); }

// What the metrics count: frames (phases), clips, or pixels (segmentation, where the Jaccard
// index is the IoU).
std::string counted(const std::string& task) {
  return task == "clips" ? "clip" : task == "segmentation" ? "pixel" : "frame";
}

void print_metrics(const train::PhaseMetrics& m, const data::ClassList& classes,
                   const std::string& task, const std::vector<std::string>& tools = {}) {
  fmt::print("  {} accuracy {:.2f}% over {} {}s\n", counted(task), 100 * m.accuracy, m.frames,
             counted(task));
  fmt::print("  {:<20} {:>9} {:>9} {:>9} {:>9}\n", task == "phases" ? "phase" : "class",
             "precision", "recall", "F1", task == "segmentation" ? "IoU" : "Jaccard");
  for (int64_t k = 0; k < classes.size(); ++k) {
    fmt::print("  {:<20} {:>9} {:>9} {:>9} {:>9}\n", classes.names()[k], percent(m.precision[k]),
               percent(m.recall[k]), percent(m.f1[k]), percent(m.jaccard[k]));
  }
  fmt::print("  {:<20} {:>9} {:>9} {:>9} {:>9}\n", "macro", percent(m.macro_precision),
             percent(m.macro_recall), percent(m.macro_f1), percent(m.macro_jaccard));
  // The confusion matrix, while it fits a terminal's width; the JSON always has it.
  if (!m.confusion.empty() && m.confusion.size() <= 12) {
    int64_t largest = 1;
    for (const auto& row : m.confusion)
      for (const int64_t n : row) largest = std::max(largest, n);
    const int width = std::max<int>(4, static_cast<int>(std::to_string(largest).size()) + 1);
    fmt::print("  confusion: {}s of each {} (row) by prediction (column {}-{})\n  {:<20}",
               counted(task), task == "phases" ? "phase" : "class", 0, m.confusion.size() - 1, "");
    for (size_t k = 0; k < m.confusion.size(); ++k) fmt::print("{:>{}}", k, width);
    fmt::print("\n");
    for (size_t k = 0; k < m.confusion.size(); ++k) {
      fmt::print("  {:<20}", fmt::format("{} {}", k, classes.names()[k]).substr(0, 20));
      for (const int64_t n : m.confusion[k]) fmt::print("{:>{}}", n, width);
      fmt::print("\n");
    }
  }
  if (m.segments) {
    const auto& s = *m.segments;
    std::string f1;
    for (size_t k = 0; k < s.thresholds.size(); ++k) {
      f1 += fmt::format(", F1@{} {}", std::lround(100 * s.thresholds[k]), percent(s.f1[k]));
    }
    fmt::print("  segments: edit {}{} ({} true, {} predicted segments)\n", percent(s.edit), f1,
               s.true_segments, s.predicted_segments);
  }
  if (m.tools && m.tools->average_precision.size() == tools.size()) {
    const auto& t = *m.tools;
    fmt::print(
        "  tool presence over {} annotated frames (precision, recall, F1 at p >= 0.5):\n"
        "  {:<20} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        t.frames, "tool", "AP", "precision", "recall", "F1", "present");
    for (size_t k = 0; k < tools.size(); ++k) {
      fmt::print("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>9}\n", tools[k],
                 percent(t.average_precision[k]), percent(t.precision[k]), percent(t.recall[k]),
                 percent(t.f1[k]), t.present[k]);
    }
    fmt::print("  {:<20} {:>9}\n", "mean (mAP)", percent(t.mean_average_precision));
  }
}

// Each video's scores, then their mean and standard deviation over the videos (how Cholec80
// papers report phase recognition).
void print_video_metrics(const std::vector<train::VideoMetrics>& videos) {
  const auto a = train::average_over_videos(videos);
  // A column of each video's tool mAP where any video shows a tool.
  const auto tool_cell = [&](const std::string& text) {
    return a.tool_videos > 0 ? fmt::format(" {:>9}", text) : std::string();
  };
  fmt::print("  per video:\n  {:<20} {:>9} {:>9} {:>9} {:>9} {:>9}{}\n", "video", "frames",
             "accuracy", "macro F1", "Jaccard", "edit", tool_cell("tool mAP"));
  for (const auto& v : videos) {
    const auto& m = v.metrics;
    fmt::print("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>9}{}\n", v.name, m.frames, percent(m.accuracy),
               percent(m.macro_f1), percent(m.macro_jaccard),
               m.segments ? percent(m.segments->edit) : "",
               tool_cell(m.tools ? percent(m.tools->mean_average_precision) : ""));
  }
  fmt::print("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>9}{}\n", "mean over videos", "",
             percent(a.accuracy_mean), percent(a.macro_f1_mean), percent(a.macro_jaccard_mean),
             percent(a.edit_mean), tool_cell(percent(a.tool_map_mean)));
  fmt::print("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>9}{}\n", "std over videos", "",
             percent(a.accuracy_std), percent(a.macro_f1_std), percent(a.macro_jaccard_std),
             percent(a.edit_std), tool_cell(percent(a.tool_map_std)));
}

// The relaxed-boundary summary as Cholec80's evaluation script prints it, in percent.
void print_relaxed(const train::RelaxedSummary& s, const std::string& rules,
                   const data::ClassList& classes) {
  fmt::print(
      "  relaxed boundaries of 10 s ({} rules, as Cholec80's evaluation script), {} videos:\n",
      rules, s.videos);
  fmt::print("  {:<24} {:>9} {:>9} {:>9}\n", "phase", "Jaccard", "precision", "recall");
  for (size_t c = 0; c < s.jaccard.size(); ++c) {
    fmt::print("  {:<24} {:>9} {:>9} {:>9}\n", classes.names()[c], percent(s.jaccard[c]),
               percent(s.precision[c]), percent(s.recall[c]));
  }
  fmt::print(
      "  accuracy {} +- {} (over videos); precision {} +- {}, recall {} +- {}, Jaccard {} "
      "+- {} (over phases)\n",
      percent(s.accuracy_mean), percent(s.accuracy_std), percent(s.precision_mean),
      percent(s.precision_std), percent(s.recall_mean), percent(s.recall_std),
      percent(s.jaccard_mean), percent(s.jaccard_std));
}

nlohmann::json relaxed_json(const train::RelaxedSummary& s, const std::string& rules,
                            const std::vector<train::RelaxedVideoMetrics>& videos,
                            const data::ClassList& classes) {
  const auto number = [](double x) {
    return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr);
  };
  const auto per_phase = [&](const std::vector<double>& values) {
    auto out = nlohmann::json::object();
    for (size_t c = 0; c < values.size(); ++c) out[classes.names()[c]] = number(values[c]);
    return out;
  };
  nlohmann::json json = {{"rules", rules},
                         {"boundary_seconds", 10},
                         {"videos", s.videos},
                         {"accuracy_mean", number(s.accuracy_mean)},
                         {"accuracy_std", number(s.accuracy_std)},
                         {"precision_mean", number(s.precision_mean)},
                         {"precision_std", number(s.precision_std)},
                         {"recall_mean", number(s.recall_mean)},
                         {"recall_std", number(s.recall_std)},
                         {"jaccard_mean", number(s.jaccard_mean)},
                         {"jaccard_std", number(s.jaccard_std)},
                         {"precision", per_phase(s.precision)},
                         {"recall", per_phase(s.recall)},
                         {"jaccard", per_phase(s.jaccard)}};
  json["per_video"] = nlohmann::json::array();
  for (const auto& v : videos) {
    json["per_video"].push_back({{"name", v.name},
                                 {"accuracy", number(v.accuracy)},
                                 {"precision", per_phase(v.precision)},
                                 {"recall", per_phase(v.recall)},
                                 {"jaccard", per_phase(v.jaccard)}});
  }
  return json;
}

nlohmann::json metrics_json(const train::PhaseMetrics& m, const data::ClassList& classes,
                            const std::vector<std::string>& tools = {}) {
  return nlohmann::json::parse(train::to_json(m, classes.names(), tools));
}

// Renders training and evaluation events on stderr: one redrawn line on a terminal, plain
// lines (about 20 per epoch) otherwise.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(std::string command)
      : command_(std::move(command)), tty_(isatty(2) != 0) {}
  ~ProgressPrinter() { end_line(); }
  // Ends an open progress line before results go to standard output.
  void finish() { end_line(); }

  void operator()(const train::Event& e) {
    using Kind = train::Event::Kind;
    switch (e.kind) {
      case Kind::Info:
        end_line();
        fmt::print(stderr, "framefit {}: {}\n", command_, e.message);
        break;
      case Kind::Warning:
        end_line();
        fmt::print(stderr, "framefit {}: warning: {}\n", command_, e.message);
        break;
      case Kind::Step: {
        const std::string text = fmt::format(
            "epoch {}/{} step {}/{} {} loss {:.4f} lr {:.2e} {:.1f} {}/s mem {} rss {} ETA {}",
            e.epoch, e.epochs, e.step, e.total_steps, bar(e.step, e.total_steps), e.loss, e.lr,
            e.frames_per_second, e.rate_unit, memory::format_bytes(e.peak_bytes),
            memory::format_bytes(e.rss_bytes), clock_text(e.eta_seconds));
        const int64_t every =
            std::max<int64_t>(1, e.total_steps / (20 * std::max<int64_t>(1, e.epochs)));
        show(text, e.step % every == 0 || e.step == e.total_steps);
        break;
      }
      case Kind::Evaluate:
        show(fmt::format("evaluating {}/{} {} {} {:.1f} {}/s", e.step, e.total_steps,
                         e.rate_unit == "frames" ? "videos" : "batches", bar(e.step, e.total_steps),
                         e.frames_per_second, e.rate_unit),
             e.step == e.total_steps);
        break;
      case Kind::Epoch:
        end_line();
        if (e.validated) {
          const auto& segments = e.metrics.segments;
          fmt::print(
              stderr,
              "framefit {}: epoch {}/{} done at {}: train loss {:.4f}, {}, validation "
              "accuracy {:.2f}%, macro F1 {:.2f}%, macro Jaccard (IoU) {:.2f}%{}{}{}\n",
              command_, e.epoch, e.epochs, clock_text(e.elapsed_seconds), e.loss, data_text(e),
              100 * e.metrics.accuracy, 100 * e.metrics.macro_f1, 100 * e.metrics.macro_jaccard,
              segments ? fmt::format(", edit {:.2f}%", 100 * segments->edit) : "",
              e.metrics.tools
                  ? fmt::format(", tool mAP {:.2f}%", 100 * e.metrics.tools->mean_average_precision)
                  : "",
              e.best ? " (best so far)" : "");
        } else {
          fmt::print(stderr, "framefit {}: epoch {}/{} done at {}: train loss {:.4f}, {}\n",
                     command_, e.epoch, e.epochs, clock_text(e.elapsed_seconds), e.loss,
                     data_text(e));
        }
        break;
    }
  }

 private:
  // The epoch's time getting data, as a share of its training time.
  static std::string data_text(const train::Event& e) {
    return fmt::format("{:.0f}% of the time getting data", 100 * e.data_fraction);
  }
  static std::string bar(int64_t done, int64_t total) {
    const int width = 20;
    const int filled = total > 0 ? static_cast<int>(width * done / total) : 0;
    return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
  }
  void show(const std::string& text, bool plain_line) {
    if (tty_) {
      fmt::print(stderr, "\r\033[K{}", text);
      open_ = true;
    } else if (plain_line) {
      fmt::print(stderr, "framefit {}: {}\n", command_, text);
    }
  }
  void end_line() {
    if (open_) fmt::print(stderr, "\n");
    open_ = false;
  }
  std::string command_;
  bool tty_;
  bool open_ = false;
};

}  // namespace

int run_make_demo(const Args& args) {
  data::DemoOptions options;
  options.train_videos = args.integer("train-videos");
  options.val_videos = args.integer("val-videos");
  options.test_videos = args.integer("test-videos");
  options.min_frames = args.integer("min-frames");
  options.max_frames = args.integer("max-frames");
  options.frame_folders = !args.on("no-frame-folders");
  options.seed = static_cast<uint64_t>(args.integer("seed"));
  options.tools = args.on("tools");
  const auto summary =
      data::make_demo(args.text("out"), options, [](const std::string& name, int64_t frames) {
        fmt::print(stderr, "framefit make-demo: {} ({} frames)\n", name, frames);
      });
  fmt::print("wrote {} videos ({} frames) to {}\n  manifest (MP4):           {}\n", summary.videos,
             summary.frames, args.text("out"), summary.manifest);
  if (!summary.frames_manifest.empty()) {
    fmt::print("  manifest (frame folders): {}\n", summary.frames_manifest);
  }
  std::string classes;
  const auto demo_classes = data::demo_classes();
  for (const auto& name : demo_classes.names()) classes += (classes.empty() ? "" : ", ") + name;
  fmt::print("  classes: [{}]\n", classes);
  if (options.tools) {
    fmt::print("  tools: [{}]\n", c10::Join(", ", data::demo_tools()));
  }
  data::SegmentationDemoOptions segmentation;
  segmentation.seed = options.seed;
  const std::string segmentation_dir = args.text("out") + "/segmentation";
  const int64_t images = data::make_segmentation_demo(segmentation_dir, segmentation);
  fmt::print("wrote {} segmentation images and masks to {}/{{train,val,test}}\n", images,
             segmentation_dir);
  return 0;
}

namespace {

// The signal (SIGINT, SIGTERM) that asked a training run to stop; 0: none. The run stops at the
// next step boundary with a checkpoint; the handler resets itself, so a second signal ends the
// process at once.
volatile std::sig_atomic_t stop_signal = 0;

extern "C" void request_stop(int signal) { stop_signal = signal; }

void stop_on_signals() {
  struct sigaction action {};
  action.sa_handler = request_stop;
  action.sa_flags = SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

// `train --resume CHECKPOINT` without --config: the config the checkpoint holds, --set applied,
// in the run folder that holds it (RUN/checkpoints/step_N.pt), so a relative train.out_dir does
// not start a new run when the command runs from another folder.
train::Config stored_run_config(const std::string& checkpoint,
                                const std::vector<std::string>& overrides) {
  namespace fs = std::filesystem;
  TORCH_CHECK(checkpoint != "auto",
              "--resume auto finds the newest checkpoint in the config's train.out_dir: give "
              "--config, or name the checkpoint (--resume RUN/checkpoints/step_N.pt)");
  TORCH_CHECK(fs::is_regular_file(checkpoint), "--resume ", checkpoint,
              ": no such file; name a step checkpoint (RUN/checkpoints/step_N.pt)");
  auto stored = train::checkpoint_config(checkpoint);
  const auto folder = fs::absolute(checkpoint).lexically_normal().parent_path();
  if (folder.filename() == "checkpoints" &&
      fs::weakly_canonical(stored.train.out_dir) != fs::weakly_canonical(folder.parent_path())) {
    stored.train.out_dir = folder.parent_path().string();
  }
  return train::parse_config(train::to_yaml(stored), "the config stored in " + checkpoint,
                             overrides);
}

}  // namespace

int run_train(const Args& args) {
  TORCH_CHECK(args.has("config") || args.has("resume"),
              "--config is required (or --resume CHECKPOINT, whose stored config is used)");
  const auto config = args.has("config") ? train::load_config(args.text("config"), args.list("set"))
                                         : stored_run_config(args.text("resume"), args.list("set"));
  ProgressPrinter printer("train");
  stop_on_signals();
  const auto result = train::train(
      config, args.has("resume") ? args.text("resume") : "",
      [&](const train::Event& e) { printer(e); }, [] { return stop_signal != 0; });
  // A stopped run exits as the signal asked (128 + its number), after saying how to go on.
  const int exit_code = result.stopped ? 128 + static_cast<int>(stop_signal) : 0;
  if (result.stopped) {
    fmt::print(stderr,
               "framefit train: stopped by {} after step {}; `framefit train --resume {}` "
               "continues it\n",
               stop_signal == SIGINT ? "SIGINT" : "SIGTERM", result.steps, result.last_checkpoint);
  }
  const data::ClassList classes(config.data.classes);
  if (args.on("json")) {
    nlohmann::json out = {{"steps", result.steps},
                          {"seconds", result.seconds},
                          {"stopped", result.stopped},
                          {"stopped_early", result.stopped_early},
                          {"best_checkpoint", result.best_checkpoint},
                          {"last_checkpoint", result.last_checkpoint},
                          {"skipped_videos", result.skipped_videos}};
    if (result.validated) {
      out["best_validation"] = metrics_json(result.best, classes, config.data.tools);
      out["best_by"] = train::best_metric(config);
    }
    fmt::print("{}\n", out.dump(2));
    return exit_code;
  }
  fmt::print("trained {} steps in {}; checkpoints in {}\n", result.steps,
             clock_text(result.seconds), config.train.out_dir);
  if (result.validated) {
    fmt::print("best validation by {} (written to {}):\n", train::best_metric(config),
               result.best_checkpoint);
    print_metrics(result.best, classes, config.task, config.data.tools);
  }
  if (result.skipped_videos > 0) {
    fmt::print("skipped {} bad {}\n", result.skipped_videos,
               config.task == "segmentation" ? "images" : "videos");
  }
  return exit_code;
}

int run_eval(const Args& args) {
  ProgressPrinter printer("eval");
  auto on_event = [&](const train::Event& e) { printer(e); };
  train::EvaluationRequest request;
  request.checkpoint = args.text("checkpoint");
  // Overrides apply to the checkpoint's own config (device, another data.manifest, ...).
  request.overrides = args.list("set");
  if (args.has("split")) request.split = args.text("split");
  if (args.has("predictions")) request.predictions_folder = args.text("predictions");
  if (args.has("relaxed")) request.relaxed_rules = args.text("relaxed");
  const std::string& relaxed_rules = request.relaxed_rules;
  // Opened before evaluating, so that a file that cannot be written (a folder of that name, no
  // permission) fails at once.
  std::ofstream out_file;
  if (args.has("out")) {
    out_file.open(args.text("out"));
    TORCH_CHECK(out_file.good(), "cannot write ", args.text("out"));
  }
  const auto evaluation = train::evaluate_checkpoint(request, on_event);
  const auto& metrics = evaluation.metrics;
  const auto& per_video = evaluation.per_video;
  const auto& classes = evaluation.classes;
  const auto& config = evaluation.config;  // the checkpoint's, with the overrides
  const auto& split = evaluation.split;
  const std::string& checkpoint = request.checkpoint;
  auto json = metrics_json(metrics, classes, config.data.tools);
  if (!per_video.empty()) {
    const auto averages = train::average_over_videos(per_video);
    json["video_averages"] = {{"videos", averages.videos},
                              {"accuracy_mean", averages.accuracy_mean},
                              {"accuracy_std", averages.accuracy_std},
                              {"macro_f1_mean", averages.macro_f1_mean},
                              {"macro_f1_std", averages.macro_f1_std},
                              {"macro_jaccard_mean", averages.macro_jaccard_mean},
                              {"macro_jaccard_std", averages.macro_jaccard_std},
                              {"edit_mean", averages.edit_mean},
                              {"edit_std", averages.edit_std}};
    if (averages.tool_videos > 0) {
      json["video_averages"]["tool_videos"] = averages.tool_videos;
      json["video_averages"]["tool_map_mean"] = averages.tool_map_mean;
      json["video_averages"]["tool_map_std"] = averages.tool_map_std;
    }
    json["videos"] = nlohmann::json::array();
    for (const auto& v : per_video) {
      auto entry = metrics_json(v.metrics, classes, config.data.tools);
      entry["name"] = v.name;
      json["videos"].push_back(entry);
    }
  }
  const auto relaxed_summary = train::summarize_relaxed(evaluation.relaxed);
  if (!relaxed_rules.empty()) {
    json["relaxed"] = relaxed_json(relaxed_summary, relaxed_rules, evaluation.relaxed, classes);
  }
  if (args.has("out")) {
    out_file << json.dump(2) << "\n";
    out_file.flush();
    TORCH_CHECK(out_file.good(), "cannot write ", args.text("out"));
  }
  printer.finish();
  if (args.on("json")) {
    fmt::print("{}\n", json.dump(2));
    return 0;
  }
  fmt::print("{} on split \"{}\":\n", checkpoint, split);
  print_metrics(metrics, classes, config.task, config.data.tools);
  if (!per_video.empty()) print_video_metrics(per_video);
  if (!relaxed_rules.empty()) print_relaxed(relaxed_summary, relaxed_rules, classes);
  return 0;
}

namespace {

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

// ".png" for "a/Mask.PNG"; "" without one.
std::string lowercase_extension(const std::string& path) {
  auto ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

// The CSV, to --out or standard output.
// unit: singular ("frame"), made plural for a count other than one.
void write_predictions(const Args& args, const std::string& csv, int64_t rows,
                       const std::string& unit) {
  if (!args.has("out")) {
    fmt::print("{}", csv);
    return;
  }
  std::ofstream out(args.text("out"));
  TORCH_CHECK(out.good(), "cannot write ", args.text("out"));
  out << csv;
  fmt::print(stderr, "framefit predict: {} -> {}\n", count_of(rows, unit), args.text("out"));
}

void print_warning(const train::Event& e) {
  if (e.kind == train::Event::Kind::Warning)
    fmt::print(stderr, "framefit predict: warning: {}\n", e.message);
}

// --video, which predict on a phases or clips model decodes a piece at a time.
std::string video_to_predict(const Args& args, const train::Config& config) {
  TORCH_CHECK(args.has("video"), "framefit predict on a ", config.task,
              " model needs --video (a video file or frame folder)");
  return args.text("video");
}

// predict --online K: the video pushed K frames (or rows) at a time through OnlinePredictor as
// they are decoded, timing each piece as a live feed would see it.
class OnlineRun {
 public:
  OnlineRun(train::Model& model, int64_t piece, bool features)
      : online_(model), piece_(piece), unit_(features ? "rows" : "frames") {}
  void push(const torch::Tensor& part, bool features) {
    const auto start = std::chrono::steady_clock::now();
    const auto p = features ? online_.push_features(part) : online_.push(part);
    seconds_.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    labels_.push_back(p.labels);
    probabilities_.push_back(p.probabilities);
    if (p.tool_probabilities.defined()) tool_probabilities_.push_back(p.tool_probabilities);
    longest_ = std::max(longest_, part.size(0));
  }
  train::Prediction finish() const {
    TORCH_CHECK(!seconds_.empty(), "nothing to predict: the input has no ", unit_);
    const auto tenth = std::max<size_t>(1, seconds_.size() / 10);
    const double total = std::accumulate(seconds_.begin(), seconds_.end(), 0.0);
    fmt::print(stderr,
               "framefit predict: online, {} of {} {}: per piece median {:.3f} ms (first "
               "tenth {:.3f} ms, last tenth {:.3f} ms), {:.0f} frames/s\n",
               count_of(static_cast<int64_t>(seconds_.size()), "piece"), longest_, unit_,
               1e3 * median_of(seconds_),
               1e3 * median_of({seconds_.begin(), seconds_.begin() + tenth}),
               1e3 * median_of({seconds_.end() - tenth, seconds_.end()}),
               static_cast<double>(online_.frames()) / std::max(1e-9, total));
    train::Prediction prediction;
    prediction.labels = torch::cat(labels_);
    prediction.probabilities = torch::cat(probabilities_);
    if (!tool_probabilities_.empty())
      prediction.tool_probabilities = torch::cat(tool_probabilities_);
    return prediction;
  }
  int64_t piece() const { return piece_; }

 private:
  train::OnlinePredictor online_;
  int64_t piece_;
  std::string unit_;
  int64_t longest_ = 0;  // a piece longer than the input is one piece of the whole input
  std::vector<torch::Tensor> labels_, probabilities_, tool_probabilities_;
  std::vector<double> seconds_;
};

int predict_phases(const Args& args) {
  // Overrides apply to the checkpoint's own config (device, another data.manifest, ...).
  auto model = train::load_model(args.text("checkpoint"), args.list("set"));
  data::DecodedVideo video;  // frames, or only the rows' numbers and times for features
  train::Prediction prediction;
  torch::Tensor features;
  if (model.features_input) {
    TORCH_CHECK(args.has("features") && !args.has("video"),
                "this checkpoint's model reads precomputed features (model.encoder features): "
                "give --features F.npy|F.pt instead of --video");
    const auto path = args.text("features");
    const auto layout = model.config.data.features_layout;
    const int64_t stride = model.config.data.features_stride;
    features = data::every_kth_row(
        data::read_features(path, data::time_first(data::feature_file_shape(path), layout, 0,
                                                   model.feature_dim, path)),
        stride);
    if (args.has("online")) {
      OnlineRun online(model, args.integer("online"), true);
      for (int64_t at = 0; at < features.size(0); at += online.piece())
        online.push(features.slice(0, at, at + online.piece()), true);
      prediction = online.finish();
    } else {
      prediction = train::predict_features(model, features, print_warning);
    }
    const double fps = args.frame_rate("fps");
    for (int64_t t = 0; t < features.size(0) * stride; t += stride) {  // the rows' numbers
      video.source_frames.push_back(t);
      video.source_seconds.push_back(fps > 0 ? static_cast<double>(t) / fps : 0.0);
    }
  } else {
    TORCH_CHECK(!args.has("features"),
                "--features is for a model that reads precomputed "
                "features; this checkpoint's has a ",
                model.config.model.encoder, " encoder: give --video");
    const auto path = video_to_predict(args, model.config);
    if (args.has("online")) {
      OnlineRun online(model, args.integer("online"), false);
      video = data::decode_video_pieces(
          path, args.frame_rate("fps"), train::data_options(model.config, false), online.piece(),
          [&](const torch::Tensor& frames) { online.push(frames, false); });
      prediction = online.finish();
    } else {
      prediction = train::predict_file(model, path, args.frame_rate("fps"), print_warning, &video);
    }
  }
  write_predictions(args,
                    train::phase_csv(prediction, video.source_frames, video.source_seconds,
                                     model.classes, model.config.data.tools),
                    prediction.labels.size(0), "frame");
  if (args.has("timeline")) {
    // The phases, then with tools one ribbon per tool: its colour where it is predicted present.
    std::vector<torch::Tensor> rows = {prediction.labels};
    const auto& tools = prediction.tool_probabilities;
    for (int64_t k = 0; tools.defined() && k < tools.size(1); ++k) {
      rows.push_back(torch::where(tools.select(1, k) >= 0.5, torch::tensor(2 * k % 20),
                                  torch::tensor(int64_t{-1})));
    }
    data::write_image(args.text("timeline"), train::timeline_image(rows));
  }
  const auto probabilities = prediction.probabilities.accessor<float, 2>();
  if (args.has("segments")) {
    const auto segments = train::segments_of(prediction.labels);
    std::string rows =
        "segment,phase,first_frame,last_frame,first_seconds,last_seconds,frames,confidence\n";
    for (size_t s = 0; s < segments.size(); ++s) {
      const auto& g = segments[s];
      const auto first = static_cast<size_t>(g.start), last = static_cast<size_t>(g.end - 1);
      double confidence = 0;
      for (int64_t t = g.start; t < g.end; ++t) confidence += probabilities[t][g.label];
      rows +=
          fmt::format("{},{},{},{},{:.3f},{:.3f},{},{:.4f}\n", s, model.classes.names()[g.label],
                      video.source_frames[first], video.source_frames[last],
                      video.source_seconds[first], video.source_seconds[last], g.end - g.start,
                      confidence / static_cast<double>(g.end - g.start));
    }
    std::ofstream out(args.text("segments"));
    out << rows;
    TORCH_CHECK(out.good(), "cannot write ", args.text("segments"));
    fmt::print(stderr, "framefit predict: {} -> {}\n",
               count_of(static_cast<int64_t>(segments.size()), "segment"), args.text("segments"));
  }
  return 0;
}

int predict_clips(const Args& args) {
  auto model = train::load_batch_model(args.text("checkpoint"), args.list("set"));
  data::DecodedVideo video;
  const auto prediction = train::predict_clips_file(model, video_to_predict(args, model.config),
                                                    args.frame_rate("fps"), print_warning, &video);
  const int64_t length = model.input[1];
  std::string csv = "clip,first_frame,last_frame,first_seconds,last_seconds,class,confidence\n";
  const auto labels = prediction.labels.accessor<int64_t, 1>();
  const auto confidence = prediction.confidence.accessor<float, 1>();
  for (int64_t c = 0; c < labels.size(0); ++c) {
    const int64_t start = prediction.starts[static_cast<size_t>(c)];
    const auto first = static_cast<size_t>(start), last = static_cast<size_t>(start + length - 1);
    csv += fmt::format("{},{},{},{:.3f},{:.3f},{},{:.4f}\n", c, video.source_frames[first],
                       video.source_frames[last], video.source_seconds[first],
                       video.source_seconds[last], model.classes.names()[labels[c]], confidence[c]);
  }
  write_predictions(args, csv, labels.size(0), "clip");
  return 0;
}

// Where each image's mask goes: `out` itself, or NAME.png in the folder `out`. Refused before
// anything runs: two images with one mask (a.jpg and a.png), and a mask over an input image
// (--out the images' own folder), which would lose a mask or an image; and a single mask file
// not named .png (it held PNG bytes under its other name).
std::vector<std::string> mask_paths(const std::vector<std::string>& images, const std::string& out,
                                    bool into_folder) {
  namespace fs = std::filesystem;
  TORCH_CHECK(into_folder || lowercase_extension(out) == ".png", "--out ", out,
              ": a mask is written as PNG (lossless, so class ids stay exact); name it .png, or "
              "give a folder");
  std::map<fs::path, size_t> image_at, mask_of;
  for (size_t i = 0; i < images.size(); ++i) image_at[fs::weakly_canonical(images[i])] = i;
  std::vector<std::string> paths;
  for (size_t i = 0; i < images.size(); ++i) {
    std::string path = out;
    if (into_folder) path = (fs::path(out) / fs::path(images[i]).stem()).string() + ".png";
    const auto key = fs::weakly_canonical(path);
    const auto same_mask = mask_of.find(key);
    TORCH_CHECK(same_mask == mask_of.end(), "images ", images[same_mask->second], " and ",
                images[i], " would both have their mask written to ", path,
                ": rename one of them, or predict them separately");
    const auto image = image_at.find(key);
    TORCH_CHECK(image == image_at.end(), "the mask of ", images[i],
                " would be written over the image ", images[image->second],
                ": give --out another file or folder");
    mask_of[key] = i;
    paths.push_back(path);
  }
  return paths;
}

// Masks as PNG files of class ids (gray, like the demo masks), and per image
// the share of its pixels in each class as CSV on standard output.
int predict_masks(const Args& args) {
  TORCH_CHECK(args.has("image") && args.has("out"),
              "framefit predict on a segmentation model needs --image (an image file or a folder "
              "of images) and --out (the mask PNG for one image, a folder for a folder)");
  auto model = train::load_batch_model(args.text("checkpoint"), args.list("set"));
  TORCH_CHECK(model.classes.size() <= 65536,
              "masks hold class ids as PNG pixels of 16 bits at most; this model has ",
              model.classes.size(), " classes");
  const std::string input = args.text("image"), out = args.text("out");
  const bool folder = is_directory(input);
  std::vector<std::string> images =
      folder ? data::list_images(input) : std::vector<std::string>{input};
  TORCH_CHECK(!images.empty(), "no images (.jpg, .jpeg, .png, .bmp, .webp, .tif, .tiff) in ",
              input);
  const auto paths = mask_paths(images, out, folder || is_directory(out));
  if (folder) {
    TORCH_CHECK(is_directory(out) || ::mkdir(out.c_str(), 0755) == 0, "cannot create the folder ",
                out, " for the masks: ", std::strerror(errno));
  }
  const auto masks = train::predict_masks(model, images, print_warning);
  std::string csv = "image,mask,height,width";
  for (const auto& name : model.classes.names()) csv += "," + name;
  csv += "\n";
  for (size_t i = 0; i < images.size(); ++i) {
    const auto& path = paths[i];
    const auto& mask = masks[i];
    data::write_label_image(path, mask);
    const auto shares = torch::bincount(mask.flatten(), {}, model.classes.size())
                            .to(torch::kDouble)
                            .div(static_cast<double>(mask.numel()));
    csv += fmt::format("{},{},{},{}", images[i], path, mask.size(0), mask.size(1));
    for (int64_t c = 0; c < shares.size(0); ++c)
      csv += fmt::format(",{:.4f}", shares[c].item<double>());
    csv += "\n";
  }
  fmt::print("{}", csv);
  fmt::print(stderr, "framefit predict: {} -> {}\n",
             count_of(static_cast<int64_t>(images.size()), "mask"), out);
  return 0;
}

}  // namespace

int run_predict(const Args& args) {
  const auto task = train::checkpoint_config(args.text("checkpoint")).task;
  for (const char* flag : {"segments", "timeline", "online", "features"}) {
    TORCH_CHECK(task == "phases" || !args.has(flag), "--", flag,
                " is for a phases checkpoint; this one is for task ", task);
  }
  // A timeline with another extension was refused by the writer only after predicting.
  TORCH_CHECK(!args.has("timeline") || lowercase_extension(args.text("timeline")) == ".png",
              "--timeline ", args.text("timeline"),
              ": the timeline is a PNG picture; name it .png");
  // Images are the input of a segmentation model only, videos of the others.
  TORCH_CHECK(task == "segmentation" || !args.has("image"),
              "--image is for a segmentation checkpoint; this one is for task ", task,
              ": give --video", task == "phases" ? " (or --features)" : "");
  TORCH_CHECK(task != "segmentation" || !args.has("video"),
              "--video is for a phases or clips checkpoint; this one is for task segmentation: "
              "give --image");
  if (task == "clips") return predict_clips(args);
  if (task == "segmentation") return predict_masks(args);
  return predict_phases(args);
}

int run_bench_data(const Args& args) {
  const auto config = train::load_config(args.text("config"), args.list("set"));
  ProgressPrinter printer("bench-data");
  auto& tracker = memory::Tracker::cpu();
  tracker.reset_peak();
  memory::reset_rss_peak();
  const auto read =
      train::read_split(config, args.text("split"), [&](const train::Event& e) { printer(e); });
  const double per_second = read.seconds > 0 ? read.samples / read.seconds : 0;
  nlohmann::json out = {{"task", config.task},
                        {"units", read.units},
                        {"unit", read.unit_name},
                        {"samples", read.samples},
                        {"sample", read.sample_name},
                        {"seconds", read.seconds},
                        {"samples_per_second", per_second},
                        {"workers", config.data.workers},
                        {"peak_bytes", tracker.peak_bytes()},
                        {"rss_peak_bytes", memory::process_memory().rss_peak_bytes},
                        {"machine", machine_info().describe()}};
  if (read.feature_dim > 0) {
    out["feature_dim"] = read.feature_dim;
  } else {
    out["height"] = read.height;
    out["width"] = read.width;
  }
  if (args.on("json")) {
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  const std::string size = read.feature_dim > 0 ? c10::str(read.feature_dim, " features")
                                                : c10::str(read.height, "x", read.width);
  // "read 48 images of 64x64", "read 12 videos, 1701 frames of 32x32".
  const std::string what =
      read.sample_name == read.unit_name
          ? count_of(read.units, read.unit_name)
          : count_of(read.units, read.unit_name) + ", " + count_of(read.samples, read.sample_name);
  fmt::print(
      "read {} of {} in {:.2f} s: {:.0f} {}s/s with {} workers\n"
      "  peak tensors {}, peak RSS {}\n  {}\n",
      what, size, read.seconds, per_second, read.sample_name, config.data.workers,
      memory::format_bytes(tracker.peak_bytes()),
      memory::format_bytes(memory::process_memory().rss_peak_bytes), machine_info().describe());
  return 0;
}

int run_export(const Args& args) {
  const std::string checkpoint = args.text("checkpoint");
  const auto& task = train::task_for(train::checkpoint_config(checkpoint));
  const auto weights = task.export_weights(checkpoint);
  models::write_state_dict(weights.state, args.text("out"));
  fmt::print("wrote {} tensors to {} ({})\n", weights.state.size(), args.text("out"),
             weights.names);
  return 0;
}

}  // namespace framefit::cli
