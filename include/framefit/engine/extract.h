#pragma once
// Per-frame features of a whole video without grad, one chunk of frames at a time, so memory
// is bounded by the chunk and not by the video's length (two-stage methods such as TeCNO
// train their temporal model on exactly these features).
#include <torch/types.h>

#include <array>
#include <functional>
#include <string>

namespace framefit::engine {

// How stored frames become network input.
struct FrameNormalization {
  // ImageNet statistics, the ones torchvision's pretrained weights expect.
  std::array<double, 3> mean{0.485, 0.456, 0.406};
  std::array<double, 3> std{0.229, 0.224, 0.225};
};

// Converts frames [N,3,H,W] to network input on `device` with `dtype`: uint8 frames are scaled
// to [0,1] and normalised; floating-point frames are taken as already normalised and only cast.
// Only these N frames are converted, so a whole video can stay uint8 in host memory.
torch::Tensor frames_to_input(const torch::Tensor& frames, torch::Device device,
                              torch::ScalarType dtype, bool channels_last = false,
                              const FrameNormalization& normalization = {});

struct ExtractOptions {
  int64_t chunk = 64;  // frames per forward pass
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;
  bool channels_last = false;
  FrameNormalization normalization;
  // Called after each chunk with (frames done, frames total).
  std::function<void(int64_t, int64_t)> on_progress;
};

// encoder: [N,3,H,W] input -> [N,D] features. frames: [T,3,H,W] uint8 or float, any device.
// Returns [T,D] float32 features on the CPU.
torch::Tensor extract_features(const std::function<torch::Tensor(const torch::Tensor&)>& encoder,
                               const torch::Tensor& frames, const ExtractOptions& options = {});

// Checks that `frames` is a video [T,3,H,W] with T >= 1 and a supported dtype; `what` names it
// in the message (a file name, say).
void check_video_frames(const torch::Tensor& frames, const std::string& what);
// Float frames with a NaN or infinite pixel, which extraction would turn into NaN features of
// that frame without a word, are an error naming the frame. (A training step keeps them: its
// loss is then not finite, and the step is skipped.)
void check_frames_finite(const torch::Tensor& frames, const std::string& what);

}  // namespace framefit::engine
