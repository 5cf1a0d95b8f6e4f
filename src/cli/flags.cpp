#include "flags.h"

#include <CLI/CLI.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <stdexcept>

#include "framefit/core/runtime.h"
#include "framefit/memory/tracker.h"

namespace framefit::cli {

const std::vector<Command>& command_table() {
  static const std::vector<Command> commands = {
      {"extract",
       "Per-frame features of a video tensor [T,3,H,W] (torch.save file) or of a video file or "
       "frame folder, computed chunk by chunk without grad: memory is bounded by --chunk, not by "
       "T."},
      {"bench-step",
       "One measured end-to-end training step (encoder + temporal head) on random frames and "
       "labels: tracked peak memory, peak RSS, step time. --chunk 0 is naive training."},
      {"plan",
       "Predict a training step's peak memory and time before running it, and choose the "
       "fastest chunk, keep, caching, accumulation and precision that fit --budget (what is "
       "left auto). Calibrates the memory model once per model and machine."},
      {"doctor",
       "Check a training configuration before allocating anything: input too small, a budget "
       "below the static minimum, BatchNorm on tiny chunks, fp16 on a CPU, and more. With "
       "--config: a phases config's data (every split's videos probed, each bad one named) and "
       "step; a layer-list network: a Linear sized for the wrong input, a parameter larger "
       "than the budget, the largest batch that fits."},
      {"bench-memory",
       "Measured peak memory (tracked and RSS) and step time across chunk sizes, next to the "
       "memory model's predictions and their error."},
      {"bench-layers",
       "Training steps of a batch network (clip 3D CNN, R3D-18, R(2+1)D-18, UNet) with and "
       "without layer checkpointing: tracked peak, RSS, step time; --batch 0 finds the largest "
       "batch --budget allows."},
      {"make-demo",
       "Write the demo data set: synthetic procedure videos as MP4 files and JPEG frame folders "
       "with Cholec80-style phase annotations and CSV manifests (two pairs of phases look alike "
       "and differ only in what came before, so a per-frame model cannot tell them apart), and "
       "images with masks for segmentation under segmentation/."},
      {"train",
       "Train from a YAML config (--set overrides any key): phases (encoder and temporal head on "
       "whole videos), clips (3D CNNs) or segmentation (UNet), planned to fit train.budget: "
       "progress, validation each epoch, a JSONL log, atomic "
       "checkpoints (keep-last-N plus best), --resume to continue a stopped run exactly. Ctrl-C "
       "or SIGTERM stops at the next step with a checkpoint (exit code 130 or 143)."},
      {"eval",
       "Metrics of a checkpoint on a split of its data set: accuracy and per-class precision, "
       "recall, F1 and Jaccard (IoU for segmentation) with macro averages, over frames, clips or "
       "pixels by task."},
      {"predict",
       "Predictions of a checkpoint: per-frame phases (phases) or per-clip classes (clips) of one "
       "video file or frame folder as CSV; class masks of images as PNG (segmentation)."},
      {"bench-data",
       "Decoding and transform throughput of a config's data set: every video, features file "
       "or image and mask of a split through the prefetching workers, as training reads it "
       "(frames, rows or images per second, tracked bytes, RSS)."},
      {"export",
       "Write a checkpoint's weights as a state_dict PyTorch loads (torch.load): "
       "encoder.<torchvision name> and head.<name>."},
  };
  return commands;
}

const std::vector<Flag>& flag_table() {
  // Commands that build a model and a training step from flags.
  const std::vector<std::string> step = {"bench-step", "plan", "doctor", "bench-memory"};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  static const std::vector<Flag> flags = {
      {"model",
       with({"extract"}, step),
       FlagType::Choice,
       "Encoder architecture (torchvision layout).",
       "",
       true,
       {"resnet18", "resnet34", "resnet50"}},
      {"weights",
       {"extract"},
       FlagType::ExistingFile,
       "state_dict file from torch.save(model.state_dict(), path); fc.* entries are ignored. "
       "Without it the encoder has random (torchvision-style) weights from --seed.",
       ""},
      {"weights-prefix",
       {"extract"},
       FlagType::Text,
       "The key prefix of the weights in --weights (encoder. for a framefit export, module. "
       "from DistributedDataParallel); absent: found when the keys do not match as they are.",
       ""},
      {"input",
       {"extract"},
       FlagType::ExistingFile,
       "Video tensor [T,3,H,W] saved with torch.save: uint8 (normalised with ImageNet statistics "
       "here) or float (taken as already normalised). Give it or --video.",
       ""},
      {"video",
       {"extract"},
       FlagType::InputPath,
       "Video file or folder of frame images, decoded here (--sample-fps, --resize, --crop): one "
       "feature row per sampled frame. Give it or --input.",
       ""},
      {"sample-fps",
       {"extract"},
       FlagType::Text,
       "With --video: frames per second to sample (as data.fps); absent: every frame.",
       ""},
      {"resize",
       {"extract"},
       FlagType::Int,
       "With --video: shorter side after decoding (as data.resize); 0 keeps the source size.",
       "0"},
      {"crop",
       {"extract"},
       FlagType::Int,
       "With --video: centre crop of this side (as data.crop); 0: none.",
       "0"},
      {"output",
       {"extract"},
       FlagType::OutputFile,
       "Where to write the [T,D] float32 features (torch.save format; torch.load reads it).",
       "",
       true},
      {"chunk", {"extract"}, FlagType::Int, "Frames per forward pass.", "64", false, {}, 1},
      {"head",
       step,
       FlagType::Choice,
       "Temporal head: lstm (seeds/000: LSTM 512 + fc), tcn (causal MS-TCN), linear (per frame).",
       "",
       true,
       {"lstm", "tcn", "linear"}},
      {"frames", step, FlagType::Int, "Frames per video (T).", "", true, {}, 1},
      {"size", step, FlagType::Int, "Frame height and width in pixels.", "", true, {}, 16},
      {"classes", step, FlagType::Int, "Phase classes.", "7", false, {}, 2},
      {"chunk",
       {"bench-step", "plan", "doctor"},
       FlagType::IntOrAuto,
       "Frames per chunk: a count, 0 for naive training (all frames with grad), or auto (the "
       "planner's choice for the budget). On out-of-memory the step is re-planned and retried.",
       "auto",
       false,
       {},
       0},
      {"chunks",
       {"bench-memory"},
       FlagType::Text,
       "Comma-separated chunk sizes to measure (0 = naive).",
       "4,8,16,32"},
      {"keep",
       {"bench-step", "bench-memory"},
       FlagType::Int,
       "Chunks whose graph is kept from the forward pass instead of recomputed.",
       "1",
       false,
       {},
       0},
      {"keep",
       {"plan", "doctor"},
       FlagType::IntOrAuto,
       "Chunks whose graph is kept from the forward pass, or auto (the planner's choice).",
       "auto",
       false,
       {},
       0},
      {"cache-frozen",
       {"bench-step", "bench-memory"},
       FlagType::Switch,
       "Keep frozen stages' outputs between forward and backward instead of recomputing them.",
       ""},
      {"cache-frozen",
       {"plan", "doctor"},
       FlagType::Choice,
       "Keep frozen stages' outputs between forward and backward: on, off or auto.",
       "auto",
       false,
       {"auto", "on", "off"}},
      {"precision",
       {"bench-step", "bench-memory"},
       FlagType::Choice,
       "Autocast precision of the encoder: fp32, bf16 (fast on AVX-512 bf16 CPUs), fp16 (CUDA, "
       "with loss scaling).",
       "fp32",
       false,
       {"fp32", "bf16", "fp16"}},
      {"precision",
       {"plan", "doctor"},
       FlagType::Choice,
       "Autocast precision of the encoder, or auto: the planner may choose fp32 or bf16 (and fp16 "
       "on CUDA).",
       "fp32",
       false,
       {"auto", "fp32", "bf16", "fp16"}},
      {"dtype",
       step,
       FlagType::Choice,
       "Parameter and input dtype; float64 for exactness checks.",
       "float32",
       false,
       {"float32", "float64"}},
      {"optimizer", step, FlagType::Choice, "Optimizer.", "adamw", false, {"sgd", "adam", "adamw"}},
      {"freeze",
       step,
       FlagType::Choice,
       "Freeze the encoder up to and including this stage.",
       "",
       false,
       {"conv1", "layer1", "layer2", "layer3", "layer4"}},
      {"videos",
       {"plan", "doctor"},
       FlagType::Int,
       "Videos per optimizer step.",
       "1",
       false,
       {},
       1},
      {"accumulate",
       {"plan", "doctor"},
       FlagType::IntOrAuto,
       "Calls per optimizer step the videos are split across (gradient accumulation), or auto.",
       "auto",
       false,
       {},
       1},
      {"margin",
       {"bench-step", "plan", "bench-memory"},
       FlagType::Fraction,
       "Fraction of the budget the planner keeps free for what its model does not see.",
       "0.1"},
      {"calibration",
       {"bench-step", "plan", "bench-memory"},
       FlagType::Path,
       "Calibration cache file (default: $FRAMEFIT_CACHE_DIR/calibration.json or "
       "~/.cache/framefit/calibration.json).",
       ""},
      {"table",
       {"plan"},
       FlagType::Switch,
       "Print predicted peak and time across chunk sizes and precisions; with --config on a "
       "clips or segmentation config, predicted peak per batch size with and without "
       "checkpointing.",
       ""},
      {"find",
       {"plan"},
       FlagType::Switch,
       "Find the largest chunk that fits: chosen by the model, confirmed by real training steps "
       "(reports how many).",
       ""},
      {"headroom",
       {"plan"},
       FlagType::Fraction,
       "With --find: the fraction of the budget a confirmed chunk must leave free.",
       "0.1"},
      {"export-grads",
       {"bench-step"},
       FlagType::OutputFile,
       "Write the measured step's parameter gradients (torchvision names for the encoder, head.* "
       "for the head) to this file; torch.load reads it.",
       ""},
      {"json",
       {"bench-step", "plan", "doctor", "bench-memory", "bench-layers"},
       FlagType::Switch,
       "Print the result as one JSON object.",
       ""},
      {"trace",
       {"bench-step"},
       FlagType::OutputFile,
       "Write a Chrome trace (phases as slices, bytes in use as a counter) of the measured steps; "
       "open it in Perfetto or chrome://tracing.",
       ""},
      {"profile",
       {"bench-step"},
       FlagType::OutputFile,
       "Write LibTorch's operator profile of the measured steps (Chrome trace: one slice per "
       "operator and autograd node; bench/step_profile.py sums it per operator). Profiling slows "
       "the step a little.",
       ""},
      {"no-warmup",
       {"bench-step"},
       FlagType::Switch,
       "Measure the first step (for runs too long to repeat; includes one-time set-up costs).",
       ""},
      {"versus-naive",
       {"bench-step"},
       FlagType::Switch,
       "Also build the same model for naive training and alternate its steps with the chunked "
       "ones in this process, the order swapped every pair and each timed step preceded by one "
       "of its own mode, so that both meet the same machine state; the result adds the naive "
       "step's time and each pair's chunked / naive ratio. Peak tensor memory stays the chunked "
       "steps'; peak RSS, --trace and --profile cover both. Needs a chunk and no budget.",
       ""},
      {"no-retry",
       {"bench-step"},
       FlagType::Switch,
       "Fail on out-of-memory instead of re-planning and retrying the step (exit code 3).",
       ""},
      {"steps",
       {"bench-step", "bench-memory"},
       FlagType::Int,
       "Measured steps after the warm-up; the median time is reported.",
       "1",
       false,
       {},
       1},
      {"norm",
       with({"extract"}, step),
       FlagType::Choice,
       "Normalisation layers: bn (BatchNorm), frozen_bn, group_norm.",
       "bn",
       false,
       {"bn", "frozen_bn", "group_norm"}},
      {"groups",
       with({"extract"}, step),
       FlagType::Int,
       "Groups per GroupNorm layer (--norm group_norm).",
       "32",
       false,
       {},
       1},
      {"drop-layer4", with({"extract"}, step), FlagType::Switch,
       "Use the slim ResNet without layer4 (256-d or 1024-d features).", ""},
      {"layout",
       with({"extract"}, step),
       FlagType::Choice,
       "Activation layout of the encoder: auto (channels-last with bn or frozen_bn, where it is "
       "faster, with layer4 in NCHW on the CPU; NCHW with group_norm), nchw, channels_last (every "
       "stage).",
       "auto",
       false,
       {"auto", "nchw", "channels_last"}},
      {"budget", with({"extract", "bench-layers"}, step), FlagType::Bytes,
       "Memory budget for tensors, e.g. 2GiB: exceeding it is an out-of-memory error. Without "
       "it, plans use the device's memory (CPU: what the system has available).",
       ""},
      {"threads",
       with({"extract", "bench-layers", "make-demo", "train", "eval", "predict", "export",
             "bench-data"},
            step),
       FlagType::Int,
       "Compute threads (LibTorch's and OpenBLAS's); 0 = $OMP_NUM_THREADS if set, else all "
       "cores.",
       "0",
       false,
       {},
       0},
      {"seed",
       with({"extract", "bench-layers"}, step),
       FlagType::Int,
       "Random seed.",
       "0",
       false,
       {},
       0},
      {"device", with({"extract", "bench-layers"}, step), FlagType::Device, "cpu, cuda or cuda:N.",
       "cpu"},
      // bench-layers
      {"net",
       {"bench-layers"},
       FlagType::Choice,
       "Batch network: seeds/001's clip classifier fixed (clip3d) or depthwise-separable, "
       "torchvision's video ResNets, a 2D UNet, or the per-frame ResNets as image classifiers.",
       "",
       true,
       {"clip3d", "clip3d_separable", "r3d_18", "r2plus1d_18", "unet", "resnet18", "resnet50"}},
      {"input",
       {"bench-layers"},
       FlagType::Text,
       "One sample's shape: C,T,H,W for clips (3,60,230,230), C,H,W for the UNet.",
       "",
       true},
      {"classes",
       {"bench-layers"},
       FlagType::Int,
       "Classes (per clip, or per pixel).",
       "20",
       false,
       {},
       2},
      {"width",
       {"bench-layers"},
       FlagType::Int,
       "UNet: channels of the first stage.",
       "64",
       false,
       {},
       1},
      {"depth", {"bench-layers"}, FlagType::Int, "UNet: down-sampling steps.", "4", false, {}, 1},
      {"batch",
       {"bench-layers"},
       FlagType::Int,
       "Samples per step; 0: the largest batch --budget allows (planned, then run to check).",
       "1",
       false,
       {},
       0},
      {"precision",
       {"bench-layers"},
       FlagType::Choice,
       "Autocast precision.",
       "fp32",
       false,
       {"fp32", "bf16", "fp16"}},
      {"checkpoint",
       {"bench-layers"},
       FlagType::Choice,
       "Layer checkpointing: off, auto (recompute what the budget requires, least time), or "
       "all (every stage recomputed).",
       "off",
       false,
       {"off", "auto", "all"}},
      {"recompute-norm",
       with({"bench-layers"}, step),
       FlagType::Choice,
       "BatchNorm and ReLU between two convolutions recomputed in the second's backward "
       "(R3D-18, R(2+1)D-18, UNet, ResNet blocks; models/norm_relu_conv.h). auto: bench-layers "
       "with --checkpoint auto or all; plan and bench-step --chunk auto: the planner's choice "
       "for the per-frame ResNet, as model.recompute_norm auto; off otherwise (doctor, "
       "bench-memory, a fixed --chunk).",
       "auto",
       false,
       {"auto", "on", "off"}},
      {"time-slices",
       {"bench-layers"},
       FlagType::Choice,
       "clip3d nets: each convolution, with the ReLU and pooling after it, run over 8 slices "
       "along time, so that its full-resolution output and that output's gradient exist a slice "
       "at a time (the same values and gradients; models/network.h). auto: with --checkpoint "
       "auto or all, as train.checkpointing does for clips.",
       "auto",
       false,
       {"auto", "on", "off"}},
      {"repeat",
       {"bench-layers"},
       FlagType::Int,
       "Measured steps (median time).",
       "3",
       false,
       {},
       1},
      {"onednn-backward",
       {"bench-layers"},
       FlagType::Switch,
       "R3D-18 / R(2+1)D-18 on the CPU: every convolution's backward through oneDNN in one "
       "call over the whole batch, as in LibTorch, instead of LibTorch's own kernel where "
       "oneDNN's workspace is many times the weight (few output positions: layer4 on 112-pixel "
       "clips) and oneDNN's backward split into passes and samples where its buffers are "
       "activation-sized (many: layer1; models/conv3d.h).",
       ""},
      {"plain-pooling",
       {"bench-layers"},
       FlagType::Switch,
       "clip3d nets: PyTorch's max pooling, which keeps its input and int64 indices for "
       "backward, instead of the lean pooling that keeps each maximum's place in its window (a "
       "byte) and runs a preceding ReLU on the pooled output (models/pooling.h).",
       ""},
      // make-demo
      {"out", {"make-demo"}, FlagType::Path, "Folder to write the demo data set into.", "", true},
      {"train-videos", {"make-demo"}, FlagType::Int, "Training videos.", "12", false, {}, 1},
      {"val-videos", {"make-demo"}, FlagType::Int, "Validation videos.", "3", false, {}, 0},
      {"test-videos", {"make-demo"}, FlagType::Int, "Held-out test videos.", "4", false, {}, 0},
      {"min-frames",
       {"make-demo"},
       FlagType::Int,
       "Shortest video, frames at 25 fps.",
       "300",
       false,
       {},
       25},
      {"max-frames",
       {"make-demo"},
       FlagType::Int,
       "Longest video, frames at 25 fps.",
       "1500",
       false,
       {},
       25},
      {"no-frame-folders",
       {"make-demo"},
       FlagType::Switch,
       "Write MP4 files only, no JPEG frame folders.",
       ""},
      {"seed", {"make-demo"}, FlagType::Int, "Random seed.", "0", false, {}, 0},
      {"tools",
       {"make-demo"},
       FlagType::Switch,
       "Also draw two tools (Clip: a white square, Probe: a magenta bar) in view at random times, "
       "annotated every 25th frame in tools/videoNN-tool.txt as Cholec80's tools "
       "(configs/demo_tools.yaml learns them); frames differ from the plain demo's where a tool "
       "shows.",
       ""},
      // train, eval, predict, export
      {"config",
       {"bench-data"},
       FlagType::ExistingFile,
       "YAML config: model.*, data.*, train.*, device (see docs/configuration.md for every key).",
       "",
       true},
      {"config",
       {"train"},
       FlagType::ExistingFile,
       "YAML config: model.*, data.*, train.*, device (see docs/configuration.md for every key). "
       "Required, except with --resume CHECKPOINT: the run then goes on with the config the "
       "checkpoint holds (and --set), in the run folder that holds the checkpoint.",
       ""},
      {"config",
       {"doctor"},
       FlagType::ExistingFile,
       "Check a training config instead of flags; with model.layers and model.input, the "
       "layer-list network: every layer's shape and parameters, and the memory per batch.",
       ""},
      {"config",
       {"plan"},
       FlagType::ExistingFile,
       "Plan a training config instead of flags, as `framefit train` will: for phases the step "
       "settings (chunk, keep, precision) for the longest training video, for clips and "
       "segmentation the batch and layer checkpointing, with the predicted peak in parts.",
       ""},
      {"batch",
       {"doctor"},
       FlagType::Int,
       "Samples per step for a layer-list network (--config with model.layers).",
       "1",
       false,
       {},
       1},
      {"set",
       {"train", "eval", "predict", "bench-data", "doctor", "plan", "extract"},
       FlagType::Repeated,
       "Override a config key: --set train.lr=0.0005 (repeatable; the value is YAML).",
       ""},
      {"resume",
       {"train"},
       FlagType::Text,
       "Continue a stopped run: auto (the newest checkpoint in train.out_dir) or a checkpoint "
       "path (then --config may be left out). Model, optimizer, loss scaler, RNG, data order "
       "and step are restored.",
       ""},
      {"checkpoint",
       {"eval", "predict", "export"},
       FlagType::ExistingFile,
       "Checkpoint written by framefit train (best.pt or checkpoints/step_*.pt).",
       "",
       true},
      {"checkpoint",
       {"extract"},
       FlagType::ExistingFile,
       "Extract the features of every video of this checkpoint's data set (its config's train, "
       "val and test splits; --set data.manifest=... for others) with its trained encoder into "
       "--out-dir, for training a head on them (model.encoder: features).",
       ""},
      {"config",
       {"extract"},
       FlagType::ExistingFile,
       "As --checkpoint, with the model this training config builds (model.weights: e.g. "
       "torchvision's ImageNet weights) instead of a trained one.",
       ""},
      {"out-dir",
       {"extract"},
       FlagType::Path,
       "With --checkpoint or --config: the folder for each video's features (NAME.pt, [T,D] "
       "float32), the labels of its sampled frames (NAME.txt) and manifest.csv.",
       ""},
      {"split", {"bench-data"}, FlagType::Text, "Manifest split to decode.", "train"},
      {"split",
       {"eval"},
       FlagType::Text,
       "Manifest split to evaluate (default: the config's data.test_split).",
       ""},
      {"video",
       {"predict"},
       FlagType::InputPath,
       "Video file or folder of frame images (phases and clips checkpoints).",
       ""},
      {"features",
       {"predict"},
       FlagType::InputPath,
       "Precomputed per-frame features (.npy, or a tensor saved with torch.save as .pt; [T,D] or "
       "[D,T]) for a phases checkpoint of model.encoder features.",
       ""},
      {"online",
       {"predict"},
       FlagType::Int,
       "Phases: predict as online recognition does, the frames (or --features rows) pushed K at "
       "a time through a causal head (same predictions); prints the time per piece.",
       "",
       false,
       {},
       1},
      {"image",
       {"predict"},
       FlagType::InputPath,
       "Image file or folder of images (segmentation checkpoints): each read at the network's "
       "input size, its mask written at the image's size.",
       ""},
      {"fps",
       {"predict", "extract"},
       FlagType::Text,
       "Frame rate of a frame folder (video files know theirs); predict --features: of the "
       "rows, for their times.",
       ""},
      {"out", {"eval"}, FlagType::OutputFile, "Also write the metrics as JSON here.", ""},
      {"out",
       {"predict"},
       FlagType::OutputFileOrFolder,
       "The CSV (default: standard output), or for segmentation the mask PNG (one image) or a "
       "folder for the masks (a folder).",
       ""},
      {"out", {"export"}, FlagType::OutputFile, "The state_dict file to write (.pt).", "", true},
      {"predictions",
       {"eval"},
       FlagType::Path,
       "Phases: also write each video's per-frame predictions to this folder as NAME.csv "
       "(predict's columns and the labelled phase: frame, time_seconds, phase, confidence, "
       "truth; and one column per tool with data.tools) and its timeline as NAME.png (the "
       "labelled phases above the predicted ones, a colour per phase).",
       ""},
      {"relaxed",
       {"eval"},
       FlagType::Choice,
       "Phases: also score with 10-second relaxed boundaries as Cholec80's evaluation script "
       "(Evaluate.m, Main.m) does: cholec80 (its 7 phases in order), m2cai16 (8 phases) or "
       "general (the +-1 rule for every phase).",
       "",
       false,
       {"general", "cholec80", "m2cai16"}},
      {"segments",
       {"predict"},
       FlagType::OutputFile,
       "Phases: also write the predicted phase segments (runs of frames with one phase) as CSV: "
       "segment, phase, first and last frame and time, frames, mean confidence.",
       ""},
      {"timeline",
       {"predict"},
       FlagType::OutputFile,
       "Phases: also write the predicted phases as a timeline picture (PNG): a colour per phase "
       "(matplotlib's tab20 order), time left to right, one column per frame up to 2,000; with "
       "data.tools a ribbon per tool below, coloured where it is predicted present (p >= 0.5).",
       ""},
      {"json", {"eval", "train", "bench-data"}, FlagType::Switch, "Print the result as JSON.", ""},
  };
  return flags;
}

Args::Args(std::string command, std::map<std::string, std::string> values)
    : command_(std::move(command)), values_(std::move(values)) {
  for (const auto& flag : flag_table()) {
    const auto value = values_.find(flag.name);
    if (value == values_.end() ||
        std::find(flag.commands.begin(), flag.commands.end(), command_) == flag.commands.end()) {
      continue;
    }
    if (flag.type == FlagType::Int) integers_[flag.name] = std::stoll(value->second);
    if (flag.type == FlagType::Bytes) integers_[flag.name] = memory::parse_bytes(value->second);
    if (flag.type == FlagType::Fraction) numbers_[flag.name] = std::stod(value->second);
  }
}

bool Args::has(const std::string& flag) const { return values_.count(flag) > 0; }

double Args::frame_rate(const std::string& flag) const {
  if (!has(flag)) return 0;
  const auto value = text(flag);
  char* end = nullptr;
  const double rate = std::strtod(value.c_str(), &end);
  TORCH_CHECK(!value.empty() && *end == '\0' && rate > 0 && std::isfinite(rate), "--", flag, " ",
              value, ": expected a positive frame rate (frames per second)");
  return rate;
}

std::string Args::text(const std::string& flag) const {
  auto it = values_.find(flag);
  TORCH_CHECK(it != values_.end(), "--", flag, " was not given");
  return it->second;
}

int64_t Args::integer(const std::string& flag) const {
  const auto parsed = integers_.find(flag);
  return parsed != integers_.end() ? parsed->second : std::stoll(text(flag));
}

double Args::number(const std::string& flag) const {
  const auto parsed = numbers_.find(flag);
  return parsed != numbers_.end() ? parsed->second : std::stod(text(flag));
}

int64_t Args::bytes(const std::string& flag) const {
  if (!has(flag)) return 0;
  const auto parsed = integers_.find(flag);
  return parsed != integers_.end() ? parsed->second : memory::parse_bytes(text(flag));
}

bool Args::on(const std::string& flag) const { return has(flag) && text(flag) == "true"; }

std::vector<std::string> Args::list(const std::string& flag) const {
  std::vector<std::string> out;
  if (!has(flag)) return out;
  std::stringstream lines(text(flag));
  for (std::string line; std::getline(lines, line);) out.push_back(line);
  return out;
}

namespace {

CLI::Validator integer_at_least(int64_t min, bool or_auto = false) {
  return CLI::Validator(
      [min, or_auto](std::string& value) -> std::string {
        if (or_auto && value == "auto") return "";
        size_t used = 0;
        long long v = 0;
        try {
          v = std::stoll(value, &used);
        } catch (const std::out_of_range&) {
          return "'" + value + "' is out of range";
        } catch (const std::exception&) {
          used = 0;
        }
        const std::string expected = or_auto ? "'auto' or an integer" : "an integer";
        if (used == 0 || used != value.size()) return "'" + value + "' is not " + expected;
        if (v < min) {
          return "must be " + std::string(or_auto ? "'auto' or " : "") + "at least " +
                 std::to_string(min) + ", got " + value;
        }
        return "";
      },
      (or_auto ? "auto|INT>=" : "INT>=") + std::to_string(min));
}

// Checked before the command runs, so that hours of work do not end in "cannot write".
CLI::Validator output_file(bool folder_allowed) {
  return CLI::Validator(
      [folder_allowed](std::string& value) -> std::string {
        // "masks/" (predict's folder of masks, created if missing) is in the folder ".".
        const auto end = value.find_last_not_of('/');
        const auto slash = end == std::string::npos ? 0 : value.rfind('/', end);
        const std::string folder =
            slash == std::string::npos ? "." : value.substr(0, std::max<size_t>(slash, 1));
        struct stat info {};
        if (::stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
          return "cannot write '" + value + "': the folder " + folder + " does not exist";
        }
        if (::access(folder.c_str(), W_OK) != 0) {
          return "cannot write '" + value + "': the folder " + folder + " is not writable";
        }
        const bool exists = ::stat(value.c_str(), &info) == 0;
        if (!folder_allowed && (value.back() == '/' || (exists && S_ISDIR(info.st_mode)))) {
          return "cannot write '" + value + "': it is a folder; give a file name";
        }
        if (exists && !S_ISDIR(info.st_mode) && ::access(value.c_str(), W_OK) != 0) {
          return "cannot write '" + value + "': the file is not writable";
        }
        return "";
      },
      folder_allowed ? "FILE|FOLDER" : "FILE");
}

CLI::Validator device_name() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        return is_device_name(value) ? "" : "expected cpu, cuda or cuda:N, got '" + value + "'";
      },
      "DEVICE");
}

CLI::Validator fraction() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        size_t used = 0;
        double v = -1;
        try {
          v = std::stod(value, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != value.size() || !(v >= 0 && v < 1)) {
          return "'" + value + "' is not a fraction in [0, 1), e.g. 0.1";
        }
        return "";
      },
      "FRACTION");
}

CLI::Validator byte_size() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          memory::parse_bytes(value);
        } catch (const c10::Error& e) {
          return e.msg();
        }
        return "";
      },
      "SIZE");
}

// A command that also takes an optional --config (doctor) needs its required flags only when no
// config is given: they are checked after parsing.
bool config_replaces_required(const std::string& command) {
  for (const auto& flag : flag_table()) {
    for (const auto& c : flag.commands) {
      if (c == command && flag.name == "config" && !flag.required) return true;
    }
  }
  return false;
}

void add_flag(CLI::App& app, const Flag& flag, std::map<std::string, std::string>& values,
              bool required) {
  const std::string name = "--" + flag.name;
  if (flag.type == FlagType::Switch) {
    app.add_flag_callback(
           name, [&values, flag] { values[flag.name] = "true"; }, flag.help)
        ->multi_option_policy(CLI::MultiOptionPolicy::Throw);
    return;
  }
  if (flag.type == FlagType::Repeated) {  // one value per occurrence, kept in order
    app.add_option_function<std::vector<std::string>>(
           name,
           [&values, flag](const std::vector<std::string>& v) {
             std::string joined;
             for (const auto& item : v) joined += (joined.empty() ? "" : "\n") + item;
             values[flag.name] = joined;
           },
           flag.help)
        ->allow_extra_args(false)
        ->take_all();
    return;
  }
  auto* option = app.add_option_function<std::string>(
      name, [&values, flag](const std::string& v) { values[flag.name] = v; }, flag.help);
  option->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  if (required) option->required();
  if (!flag.default_value.empty()) option->default_str(flag.default_value);
  switch (flag.type) {
    case FlagType::ExistingFile: option->check(CLI::ExistingFile); break;
    case FlagType::Int: option->check(integer_at_least(flag.min_value)); break;
    case FlagType::IntOrAuto: option->check(integer_at_least(flag.min_value, true)); break;
    case FlagType::Bytes: option->check(byte_size()); break;
    case FlagType::Fraction: option->check(fraction()); break;
    case FlagType::Device: option->check(device_name()); break;
    case FlagType::Choice: option->check(CLI::IsMember(flag.choices)); break;
    case FlagType::Path:
    case FlagType::InputPath: option->type_name("PATH"); break;
    case FlagType::OutputFile: option->check(output_file(false)); break;
    case FlagType::OutputFileOrFolder: option->check(output_file(true)); break;
    default: break;
  }
}

// Two flags of one command line naming one file where one of them writes it: two outputs (predict
// --out and --segments), or an output over an input (export --out over its --checkpoint), which
// would lose a result or the input without an error. "" when there is none.
std::string clashing_paths(const std::string& command,
                           const std::map<std::string, std::string>& given) {
  namespace fs = std::filesystem;
  struct Named {
    std::string flag;
    fs::path path;
    bool output;
  };
  std::vector<Named> named;
  for (const auto& flag : flag_table()) {
    const bool output = flag.type == FlagType::OutputFile ||
                        flag.type == FlagType::OutputFileOrFolder || flag.type == FlagType::Path;
    const bool input = flag.type == FlagType::ExistingFile || flag.type == FlagType::InputPath;
    const auto value = given.find(flag.name);
    if (!(output || input) || value == given.end() || value->second.empty() ||
        std::find(flag.commands.begin(), flag.commands.end(), command) == flag.commands.end()) {
      continue;
    }
    std::error_code error;
    auto path = fs::weakly_canonical(value->second, error);
    named.push_back({flag.name, error ? fs::path(value->second) : path, output});
  }
  for (size_t i = 0; i < named.size(); ++i) {
    for (size_t j = i + 1; j < named.size(); ++j) {
      const auto& a = named[i];
      const auto& b = named[j];
      // Hard links are one file under two names.
      std::error_code unknown;
      const bool same = a.path == b.path || fs::equivalent(a.path, b.path, unknown);
      if (!(a.output || b.output) || !same) continue;
      const auto& input = a.output ? b : a;
      const auto& output = a.output ? a : b;
      if (a.output && b.output) {
        return "--" + a.flag + " and --" + b.flag + " both name " + a.path.string() +
               ": give each output its own file";
      }
      return "--" + output.flag + " names " + output.path.string() + ", which --" + input.flag +
             " reads: writing it would replace it; give --" + output.flag + " another file";
    }
  }
  return "";
}

}  // namespace

ParseResult parse_command_line(const std::vector<std::string>& argv) {
  CLI::App app{
      "framefit: train video models end to end on whole, long videos within a memory "
      "budget."};
  app.name("framefit");
  app.require_subcommand(1);
  std::map<std::string, std::map<std::string, std::string>> values;
  for (const auto& command : command_table()) {
    auto* sub = app.add_subcommand(command.name, command.help);
    const bool deferred = config_replaces_required(command.name);
    for (const auto& flag : flag_table()) {
      for (const auto& c : flag.commands) {
        if (c == command.name) {
          add_flag(*sub, flag, values[command.name], flag.required && !deferred);
        }
      }
    }
  }

  ParseResult result;
  if (!argv.empty() && !argv.front().empty() && argv.front()[0] != '-') {
    bool known = false;
    std::string names;
    for (const auto& command : command_table()) {
      known = known || command.name == argv.front();
      names += (names.empty() ? "" : ", ") + command.name;
    }
    if (!known) {
      result.output = "unknown command '" + argv.front() + "'; commands: " + names +
                      ". Run framefit --help for more information.\n";
      result.exit_code = static_cast<int>(CLI::ExitCodes::ExtrasError);
      return result;
    }
  }
  std::vector<const char*> raw;
  raw.push_back("framefit");
  for (const auto& a : argv) raw.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(raw.size()), raw.data());
  } catch (const CLI::ParseError& e) {
    std::ostringstream out, err;
    result.exit_code = app.exit(e, out, err);
    result.output = out.str() + err.str();
    return result;
  }
  const auto chosen = app.get_subcommands();
  const std::string command = chosen.front()->get_name();
  auto given = values[command];
  if (config_replaces_required(command) && !given.count("config") && !given.count("checkpoint")) {
    for (const auto& flag : flag_table()) {
      const bool mine =
          std::find(flag.commands.begin(), flag.commands.end(), command) != flag.commands.end();
      if (mine && flag.required && !given.count(flag.name)) {
        const bool checkpoint =
            std::any_of(flag_table().begin(), flag_table().end(), [&](const Flag& f) {
              return f.name == "checkpoint" &&
                     std::count(f.commands.begin(), f.commands.end(), command) > 0;
            });
        result.output = "--" + flag.name + " is required (or give --config" +
                        (checkpoint ? " or --checkpoint" : "") +
                        ")\nRun with --help for more information.\n";
        result.exit_code = static_cast<int>(CLI::ExitCodes::RequiredError);
        return result;
      }
    }
  }
  for (const auto& flag : flag_table()) {
    for (const auto& c : flag.commands) {
      if (c == command && !flag.default_value.empty() && !given.count(flag.name)) {
        given[flag.name] = flag.default_value;
      }
    }
  }
  const auto clash = clashing_paths(command, given);
  if (!clash.empty()) {
    result.output = clash + "\nRun with --help for more information.\n";
    result.exit_code = static_cast<int>(CLI::ExitCodes::ValidationError);
    return result;
  }
  result.args = Args(command, std::move(given));
  return result;
}

}  // namespace framefit::cli
