#pragma once
// Max pooling that keeps only where each maximum was for backward.
//
// PyTorch's max pooling keeps its whole input for backward as well as the indices, though its
// gradient only scatters into the argmax positions. After a convolution (whose backward needs its
// input, not its output) that input is kept for nothing: on seeds/001's clips, conv1's output is
// 32 x 60 x 230 x 230 floats, 406 MB per clip. Pooling first and applying a preceding ReLU to the
// pooled output instead (max and ReLU commute: ReLU does not decrease) keeps each maximum's offset
// in its window (a byte for windows of up to 256 positions, where PyTorch keeps int64 indices)
// and ReLU's mask (a byte): 2 bytes per pooled output, a sixteenth of the input's floats for
// 2 x 2 x 2 windows.
//
// Values and gradients equal PyTorch's conv -> relu -> maxpool exactly for finite inputs:
// each input position receives the gradient of the windows whose argmax it is, and ReLU's mask
// is the same (a window's maximum is positive exactly where its ReLU is).
//
// LibTorch 1.13's CPU 3d max pooling has no bfloat16 or half kernel; both variants pool such
// inputs in float32 (the same maxima: the conversions are exact), so bf16 autocast runs.
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <vector>

namespace framefit::models {

struct MaxPoolOptions {
  explicit MaxPoolOptions(std::vector<int64_t> kernel) : kernel_(std::move(kernel)) {}
  TORCH_ARG(std::vector<int64_t>, kernel);   // one value per spatial dimension (2 or 3)
  TORCH_ARG(std::vector<int64_t>, stride);   // empty: the kernel
  TORCH_ARG(std::vector<int64_t>, padding);  // empty: 0
  // false: PyTorch's max pooling (keeps its input), for comparison.
  TORCH_ARG(bool, lean) = true;
};

// max_pool{2,3}d of x [N,C,H,W] or [N,C,T,H,W]; with `relu_first`, the result of
// max_pool(relu(x)), computed as relu(max_pool(x)). When lean, the backward keeps the window
// offsets (and, with relu_first, ReLU's mask).
torch::Tensor max_pool(const torch::Tensor& x, const MaxPoolOptions& options,
                       bool relu_first = false);

// Bytes the lean pooling keeps per output for where its maximum was in a window of `kernel`
// (one value per spatial dimension): 1 up to 256 window positions, 2 up to 32,768, else 8.
int64_t max_pool_offset_bytes(at::IntArrayRef kernel);

// MaxPool2d / MaxPool3d by the input's rank, with no parameters (state_dict unchanged).
class MaxPoolImpl : public torch::nn::Module {
 public:
  explicit MaxPoolImpl(MaxPoolOptions options) : options(std::move(options)) {}
  torch::Tensor forward(const torch::Tensor& x) { return max_pool(x, options); }
  MaxPoolOptions options;
};
TORCH_MODULE(MaxPool);

}  // namespace framefit::models
