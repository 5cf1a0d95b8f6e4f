#include "framefit/engine/extract.h"

#include <torch/torch.h>

namespace framefit::engine {

void check_video_frames(const torch::Tensor& frames, const std::string& what) {
  TORCH_CHECK(frames.defined(), what, ": no frames");
  TORCH_CHECK(frames.dim() == 4 && frames.size(1) == 3, what,
              ": expected video frames shaped [T,3,H,W]; got ", frames.sizes(),
              frames.dim() == 4 && frames.size(3) == 3 ? " (looks like [T,H,W,3]: permute to [T,3,H,W])" : "");
  TORCH_CHECK(frames.size(0) > 0, what, ": the video has no frames (T = 0)");
  TORCH_CHECK(frames.scalar_type() == torch::kUInt8 || frames.is_floating_point(), what,
              ": frames must be uint8 (0..255) or floating point (already normalised); got ",
              frames.scalar_type());
}

void check_frames_finite(const torch::Tensor& frames, const std::string& what) {
  if (!frames.is_floating_point()) return;
  const auto finite = torch::isfinite(frames).flatten(1).all(1);
  if (finite.all().item<bool>()) return;
  const int64_t frame = torch::logical_not(finite).nonzero()[0][0].item<int64_t>();
  TORCH_CHECK(false, what, ": frame ", frame, " has pixels that are not finite (NaN or infinity)");
}

torch::Tensor frames_to_input(const torch::Tensor& frames, torch::Device device,
                              torch::ScalarType dtype, bool channels_last,
                              const FrameNormalization& normalization) {
  torch::NoGradGuard no_grad;
  auto x = frames.to(device, /*non_blocking=*/true);
  if (x.scalar_type() == torch::kUInt8) {
    const auto opts = torch::TensorOptions().dtype(dtype).device(device);
    auto mean = torch::tensor({normalization.mean[0], normalization.mean[1], normalization.mean[2]},
                              opts.dtype(torch::kFloat64)).to(dtype).view({1, 3, 1, 1}) * 255.0;
    auto inv_std = (1.0 / (torch::tensor({normalization.std[0], normalization.std[1],
                                           normalization.std[2]}, opts.dtype(torch::kFloat64)) * 255.0))
                       .to(dtype).view({1, 3, 1, 1});
    x = (x.to(dtype) - mean) * inv_std;
  } else {
    x = x.to(dtype);
  }
  return channels_last ? x.contiguous(torch::MemoryFormat::ChannelsLast) : x.contiguous();
}

torch::Tensor extract_features(const std::function<torch::Tensor(const torch::Tensor&)>& encoder,
                               const torch::Tensor& frames, const ExtractOptions& options) {
  check_video_frames(frames, "extract_features");
  check_frames_finite(frames, "extract_features");
  TORCH_CHECK(options.chunk >= 1, "chunk must be >= 1 frame; got ", options.chunk);
  torch::NoGradGuard no_grad;
  const int64_t total = frames.size(0);
  torch::Tensor out;
  for (int64_t start = 0; start < total; start += options.chunk) {
    const int64_t end = std::min(total, start + options.chunk);
    auto input = frames_to_input(frames.slice(0, start, end), options.device, options.dtype,
                                 options.channels_last, options.normalization);
    auto features = encoder(input);
    TORCH_CHECK(features.dim() == 2 && features.size(0) == end - start,
                "the encoder must map [N,3,H,W] to [N,D] features; got ", features.sizes(),
                " for ", end - start, " frames");
    if (!out.defined()) out = torch::empty({total, features.size(1)}, torch::kFloat32);
    out.slice(0, start, end).copy_(features.to(torch::kCPU, torch::kFloat32));
    if (options.on_progress) options.on_progress(end, total);
  }
  return out;
}

}  // namespace framefit::engine
