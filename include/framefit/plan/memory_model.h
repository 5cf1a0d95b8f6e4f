#pragma once
// Predicting a training step's peak memory and time before running it.
//
// Static parts (parameters, gradients, optimizer state, input frames, features) are computed
// from the model's description. What depends on the network's kernels (activations saved per
// frame, workspace, the temporal head's cost per frame, seconds per frame) is measured by short
// probe runs (calibration.h) as linear functions of the frames in a chunk. predict() then walks
// the step the way the engine runs it (encode, head, recompute chunk by chunk, optimizer) and
// takes the largest total.
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "framefit/engine/amp.h"
#include "framefit/models/heads.h"
#include "framefit/models/network.h"
#include "framefit/models/resnet.h"

namespace framefit::plan {

// The model and frame shape being trained, as the CLI flags (and configs) describe them.
struct ModelSpec {
  std::string model = "resnet18";  // resnet18 | resnet34 | resnet50
  std::string head = "lstm";       // lstm | tcn | linear
  models::HeadSettings head_settings;
  int64_t classes = 7;
  int64_t tools = 0;        // a tool presence head (Linear features -> tools) beside the phase head
  std::string norm = "bn";  // bn | frozen_bn | group_norm
  int64_t groups = 32;
  std::string freeze;  // last frozen stage, "" for none
  bool drop_layer4 = false;
  bool channels_last = false;  // NHWC activations (models::StageLayout) ...
  std::string nchw_from;       // ... up to this stage
  bool recompute_norm = false;  // the blocks' BatchNorm and ReLU recomputed (ResNetOptions)
  int64_t size = 112;  // frame height and width
  torch::ScalarType dtype = torch::kFloat32;
  std::string optimizer = "adamw";  // sgd | adam | adamw
  torch::Device device = torch::kCPU;

  // Identifies what calibration measures: everything above but the head's classes, the tools
  // and the optimizer, plus the precision.
  std::string calibration_key(engine::Precision precision) const;
  // The encoder this describes, in feature mode (what static sizes, probes and the CLI build).
  models::ResNetOptions encoder_options() const;
  // Whether recompute_norm changes anything: its blocks have a BatchNorm (not group_norm).
  bool takes_recompute_norm() const { return norm != "group_norm"; }
};

// Sizes known from the description alone (no allocation).
struct StaticSizes {
  int64_t parameter_bytes = 0;  // encoder and head, trained or not, plus norm buffers
  int64_t trained_encoder_bytes = 0;
  int64_t trained_head_bytes = 0;
  int64_t largest_trained_bytes = 0;
  int64_t optimizer_state_bytes = 0;  // after the first step (Adam: two moments per parameter)
  int64_t frame_bytes = 0;            // one uint8 frame, 3 x size x size
  // CUDA: a video's uint8 frames stay in host memory, outside the device's budget; each chunk is
  // copied over when it runs (counted in its probes). Only the labels are on the device.
  bool frames_in_host_memory = false;
  int64_t resident_bytes_per_frame() const { return (frames_in_host_memory ? 0 : frame_bytes) + 8; }
  int64_t feature_bytes = 0;          // one frame's features
  int64_t feature_dim = 0;
  int64_t min_input_size = 0;
  int64_t frozen_stages = 0;
  // What the device's math libraries hold for the process's life (memory::Tracker::
  // library_bytes: cuBLAS workspaces on CUDA, 32 MiB each on Hopper): in the budget, in no
  // tensor of the step. Set by who plans for a device (from the device's tracker; its backend
  // runs the libraries once when it is made); 0 for the doctor.
  int64_t library_bytes = 0;
  int64_t trained_bytes() const { return trained_encoder_bytes + trained_head_bytes; }
};
StaticSizes static_sizes(const ModelSpec& spec);
// The same for an encoder given as a module (a TorchScript network) of `feature_dim` features per
// frame, counted from its tensors; spec supplies the head, frame size, optimizer and dtype.
StaticSizes static_sizes(const ModelSpec& spec, const torch::nn::Module& encoder,
                         int64_t feature_dim);

// y = intercept + slope * n.
struct Linear {
  double intercept = 0;
  double slope = 0;
  double at(double n) const { return intercept + slope * n; }
  // Through two measurements (n1, y1), (n2, y2) with n1 != n2.
  static Linear through(double n1, double y1, double n2, double y2);
};

// An encoder pass's seconds for one chunk.
struct ChunkSeconds {
  double nograd = 0, grad = 0, backward = 0, frozen = 0;
};

// What the probes measure for one (model, size, precision, device), per chunk of n frames:
// bytes above the bytes in use when the chunk starts, and seconds.
struct ChunkCosts {
  Linear nograd_peak;      // forward without grad (frozen and trained stages)
  Linear grad_peak;        // forward with grad of the trained stages
  Linear saved;            // left allocated by that forward: the graph's saved tensors and output
  Linear backward_peak;    // forward with grad then gradients of the trained parameters returned
                           // (the engine's recompute: torch::autograd::grad)
  Linear accumulate_peak;  // ... then backward() adding into existing .grad (naive training)
  Linear frozen_output;    // the frozen stages' output (what --cache-frozen keeps per chunk)
  Linear head_peak;        // head forward, loss and backward over n frames' features
  Linear nograd_seconds, grad_seconds, backward_seconds, frozen_seconds, head_seconds;
  // The encoder's seconds measured at a one-frame chunk, which no line through larger chunks
  // gives: LibTorch runs a convolution with a kernel of at most 3x3 on a single sample whose
  // input has at most 20,480 elements (a ResNet's layer3 and layer4 at 112 px) through its slow
  // non-oneDNN path (ConvParams::use_mkldnn: "for some case, native is faster"), and
  // ResNet-18 at 112 x 112 took 131 ms a frame in one-frame chunks against 27 in two-frame ones
  // (2 threads). All 0: not measured; the lines hold there too.
  ChunkSeconds one_frame;
  // The encoder's seconds for a chunk of n frames.
  ChunkSeconds seconds_at(int64_t n) const;
};

// One way to run the step: the settings the planner chooses.
struct StepSettings {
  int64_t frames = 0;           // per video
  int64_t videos_per_call = 1;  // videos whose frames are in memory together
  int64_t chunk = 0;            // 0 or >= frames: naive (one pass with grad)
  int64_t keep = 1;
  bool cache_frozen = false;
  engine::Precision precision = engine::Precision::FP32;
  // The encoder's BatchNorm and ReLU recomputed (ModelSpec::recompute_norm): the costs the plan
  // was made with, which the encoder must be built with.
  bool recompute_norm = false;
  // Videos of any length up to `frames` are trained (a data set's, not one length): the peak is
  // the largest over them. Not the longest's alone: a shorter video whose last chunk is whole
  // keeps more frames' graphs (5 x 96 + 13 frames keep 3 chunks of 96, 96 and 13 frames; 274
  // keep all three of 96, 96 and 82), which was 19% above the longest one's on the demo.
  bool shorter_videos = false;
  bool naive() const { return chunk == 0 || chunk >= frames; }
};

// The predicted peak and what it is made of at the moment it happens.
struct Breakdown {
  int64_t parameters = 0;  // parameters and norm buffers
  int64_t gradients = 0;   // .grad of trained parameters, plus partial sums in recompute
  // Of gradients, the partial sums: while a recomputed chunk's backward writes the encoder's
  // gradients, those summed over the later chunks are held beside them (one more copy).
  int64_t gradient_sums = 0;
  int64_t optimizer_state = 0;
  int64_t input_frames = 0;  // uint8 frames (CPU) and labels of the videos in memory
  int64_t features = 0;      // per-frame features and their gradient
  int64_t activations = 0;   // per-frame terms: the chunks' saved activations
  int64_t workspace = 0;     // per-chunk constant terms (kernels' buffers, head), library_bytes
  int64_t peak_bytes = 0;    // the sum of the above
  std::string peak_phase;    // encode | head | recompute | optimizer
  std::map<std::string, int64_t> phase_peaks;
  double seconds = 0;  // predicted step time
};
// With settings.shorter_videos, the breakdown of the video length up to settings.frames whose
// peak is largest, and the time of the longest.
Breakdown predict(const StaticSizes& sizes, const ChunkCosts& costs, const StepSettings& settings);

// A network from a layer list (models/network.h) trained on batches of samples: its static
// memory from the inferred shapes alone. Activations are what the layers keep for backward
// (their saved inputs or outputs), which is what grows with the batch.
struct NetworkTraining {
  int64_t batch = 1;
  torch::ScalarType dtype = torch::kFloat32;  // parameters and activations
  std::string optimizer = "adam";             // sgd (momentum: one copy) | adam | adamw (two)
  int64_t input_element_bytes = 1;            // uint8 samples (images, clips) before conversion
};
struct NetworkMemory {
  int64_t parameter_bytes = 0;  // parameters and norm buffers
  int64_t gradient_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  int64_t input_bytes_per_sample = 0;
  int64_t activation_bytes_per_sample = 0;
  // Backward's transient on top of all the saved activations: at its peak layer, the gradients
  // that layer's backward holds (models::LayerShape::backward_elements) beside what it and the
  // earlier layers saved, less what all layers saved (the later layers' is freed by then).
  int64_t backward_bytes_per_sample = 0;
  int64_t static_bytes() const { return parameter_bytes + gradient_bytes + optimizer_state_bytes; }
  int64_t bytes_per_sample() const {
    return input_bytes_per_sample + activation_bytes_per_sample + backward_bytes_per_sample;
  }
  int64_t peak_bytes(int64_t batch) const { return static_bytes() + batch * bytes_per_sample(); }
  // The largest batch whose peak stays within `budget_bytes` (0 when not even one sample fits).
  int64_t largest_batch(int64_t budget_bytes) const;
};
NetworkMemory network_memory(const models::NetworkShapes& shapes, const std::vector<int64_t>& input,
                             const NetworkTraining& training);

}  // namespace framefit::plan
