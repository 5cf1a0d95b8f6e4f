#include <fmt/core.h>
#include <torch/torch.h>

#include <chrono>

#include "commands.h"
#include "framefit/data/dataset.h"
#include "framefit/engine/extract.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"
#include "framefit/train/trainer.h"

namespace framefit::cli {

namespace {

// extract --checkpoint / --config: every video of a training config's data set.
int extract_data_set(const Args& args) {
  TORCH_CHECK(args.has("checkpoint") != args.has("config"),
              "give --checkpoint (a trained encoder) or --config (the model a config builds), one "
              "of them");
  TORCH_CHECK(args.has("out-dir"), "extract --", args.has("checkpoint") ? "checkpoint" : "config",
              " writes every video's features into a folder: give --out-dir");
  for (const char* flag : {"input", "video", "output", "model", "weights"}) {
    TORCH_CHECK(!args.has(flag), "--", flag, " is for extracting one video; with --",
                args.has("checkpoint") ? "checkpoint" : "config",
                " the config says the model and the videos");
  }
  auto model = args.has("checkpoint")
                   ? train::load_model(args.text("checkpoint"), args.list("set"))
                   : train::build_model(train::load_config(args.text("config"), args.list("set")));
  model.chunk = args.integer("chunk");  // halved on out-of-memory (--budget)
  memory::Tracker::of(model.device).set_budget(args.bytes("budget"));
  const auto manifest =
      train::extract_features(model, args.text("out-dir"), [](const train::Event& e) {
        const char* kind = e.kind == train::Event::Kind::Warning ? "warning: " : "";
        if (e.kind == train::Event::Kind::Info || e.kind == train::Event::Kind::Warning)
          fmt::print(stderr, "framefit extract: {}{}\n", kind, e.message);
      });
  fmt::print("wrote {} (train on it with model.encoder: features, data.manifest: {})\n", manifest,
             manifest);
  return 0;
}

}  // namespace

int run_extract(const Args& args) {
  if (args.has("checkpoint") || args.has("config")) return extract_data_set(args);
  const torch::Device device(args.text("device"));
  torch::manual_seed(static_cast<uint64_t>(args.integer("seed")));
  auto& tracker = memory::Tracker::of(device);
  tracker.set_budget(args.bytes("budget"));

  TORCH_CHECK(args.has("input") != args.has("video"),
              "give the frames as --input (a [T,3,H,W] tensor file) or --video (a video file or "
              "frame folder), one of them");
  // A tensor file is loaded whole and checked first; a video is decoded a piece (--chunk frames)
  // at a time as it is extracted, so its length does not bound memory.
  torch::Tensor frames;
  const std::string source = args.text(args.has("video") ? "video" : "input");
  if (!args.has("video")) {
    frames = models::read_tensor(source);
    engine::check_video_frames(frames, source);
    engine::check_frames_finite(frames, source);
  }

  const auto norm = models::parse_norm_kind(args.text("norm"));
  const auto layout = models::resolve_layout(models::parse_activation_layout(args.text("layout")),
                                             norm, device.type());
  models::ResNet encoder(models::ResNetOptions(models::parse_resnet_name(args.text("model")))
                             .num_classes(0)
                             .norm(norm)
                             .groups(args.integer("groups"))
                             .drop_layer4(args.on("drop-layer4"))
                             .channels_last(layout.channels_last)
                             .nchw_from(layout.nchw_from));
  if (args.has("weights")) {
    models::LoadOptions load;
    load.ignore_prefixes = {"fc."};
    load.find_prefix = true;
    if (args.has("weights-prefix")) load.prefix = args.text("weights-prefix");
    models::LoadReport report;
    try {
      report =
          models::load_state_dict(*encoder, models::read_state_dict(args.text("weights")), load);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "--weights ", args.text("weights"), ": ", e.what_without_backtrace(),
                  args.has("weights-prefix")
                      ? ""
                      : "(if the weights sit under a key prefix, name it with --weights-prefix)");
    }
    if (!report.prefix.empty()) {
      fmt::print(stderr, "framefit extract: weights taken from the keys under \"{}\"\n",
                 report.prefix);
    }
  } else {
    fmt::print(stderr, "framefit extract: no --weights given: using random weights (seed {})\n",
               args.integer("seed"));
  }
  encoder->eval();
  encoder->to(device);

  engine::ExtractOptions options;
  options.chunk = args.integer("chunk");
  options.device = device;
  options.channels_last = layout.channels_last;
  const bool terminal = isatty(fileno(stderr));
  // total -1: a video decoded a piece at a time, whose sampled frames are counted as they come.
  options.on_progress = [terminal](int64_t done, int64_t total) {
    if (!terminal) return;
    if (total < 0) {
      fmt::print(stderr, "\rframefit extract: {} frames", done);
    } else {
      fmt::print(stderr, "\rframefit extract: {}/{} frames", done, total);
    }
  };

  memory::reset_rss_peak();
  auto window = tracker.mark();
  const auto start = std::chrono::steady_clock::now();
  const auto encode = [&](const torch::Tensor& x) { return encoder->forward(x); };
  torch::Tensor features;
  int64_t height = 0, width = 0;
  if (frames.defined()) {
    features = engine::extract_features(encode, frames, options);
    height = frames.size(2), width = frames.size(3);
  } else {
    data::DataOptions decoding;
    decoding.fps = args.frame_rate("sample-fps");
    decoding.transform.resize = args.integer("resize");
    decoding.transform.crop = args.integer("crop");
    std::vector<torch::Tensor> pieces;
    int64_t done = 0;
    auto piece_options = options;
    piece_options.on_progress = {};
    data::decode_video_pieces(
        source, args.frame_rate("fps"), decoding, options.chunk, [&](const torch::Tensor& piece) {
          pieces.push_back(engine::extract_features(encode, piece, piece_options));
          done += piece.size(0);
          height = piece.size(2), width = piece.size(3);
          if (options.on_progress) options.on_progress(done, -1);
        });
    TORCH_CHECK(!pieces.empty(), "video ", source, ": no frames were sampled");
    features = torch::cat(pieces);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t peak = window.peak_bytes() - window.entry_bytes();
  window.close();
  models::write_tensor(features, args.text("output"));

  if (terminal) fmt::print(stderr, "\n");
  const auto rss = memory::process_memory();
  const int64_t count = features.size(0);
  fmt::print(
      "framefit extract: {} frames {}x{} -> features [{}, {}] in {:.2f} s ({:.1f} frames/s)\n",
      count, height, width, count, features.size(1), seconds, static_cast<double>(count) / seconds);
  fmt::print("  peak tensor memory {}: {} (chunk {}); peak RSS {}\n",
             frames.defined() ? "above the loaded video" : "(decoded a chunk at a time)",
             memory::format_bytes(peak), options.chunk, memory::format_bytes(rss.rss_peak_bytes));
  fmt::print("  wrote {}\n", args.text("output"));
  return 0;
}

}  // namespace framefit::cli
