#pragma once
// Sequential networks written down as a list of layers (in a config file), so that a model
// like seeds/001's 3D CNN can be described as its author wrote it, checked before anything is
// allocated, and then built with the same parameter names as the author's PyTorch module.
//
// Shapes are per sample, without the batch dimension: [C,H,W] for images and frames,
// [C,T,H,W] for clips. Every layer's output shape, parameter count and activation size follow
// from the input shape alone (infer_shapes), with PyTorch's size rules.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace framefit::models {

// One layer. Which fields matter depends on `type`:
//   conv2d, conv3d        out, kernel, stride (1), padding (0), groups (1), bias; `in` optional
//   sepconv2d, sepconv3d  depthwise conv (groups = in channels) then a 1x1 pointwise conv to
//                         `out`; children <name>.depthwise and <name>.pointwise
//   bn                    BatchNorm over the channels (2d or 3d from the input's rank)
//   gn                    GroupNorm with `groups` groups (a bf16/fp16 input under autocast is
//                         normalised in float32 and cast back)
//   relu, flatten, dropout (p)
//   maxpool, avgpool      kernel, stride (= kernel), padding (0); 2d or 3d from the rank
//   global_avgpool        average over every position: [C,...] -> [C,1,...,1]
//   linear                out; `in` as written (0: inferred from the flattened input)
// Spatial fields take one value for every dimension or one per dimension.
struct LayerSpec {
  std::string type;
  std::string name;  // child module name ("conv1", "fc1"); empty: <type><index>
  int64_t in = 0;
  int64_t out = 0;
  std::vector<int64_t> kernel;
  std::vector<int64_t> stride;
  std::vector<int64_t> padding;
  int64_t groups = 0;  // conv: 1 when 0; gn: required
  double p = 0.5;      // dropout probability
  bool bias = true;
};

// The layer types LayerSpec accepts, for error messages and help.
const std::vector<std::string>& layer_types();

struct LayerShape {
  std::string name;
  std::string type;
  std::vector<int64_t> output;  // per sample
  int64_t parameters = 0;
  int64_t largest_parameter = 0;       // elements of the layer's largest parameter tensor
  std::string largest_parameter_name;  // "fc1.weight"
  int64_t buffers = 0;                 // running statistics (float elements)
  // Elements kept for backward per sample (inputs or outputs the layer's gradient needs),
  // counted in the network's dtype, and bytes of integer indices (max pooling).
  int64_t saved_elements = 0;
  int64_t saved_index_bytes = 0;
  // Elements the layer's backward holds at once per sample: its output's gradient, its input's
  // (when an earlier layer has parameters to train) and its kernels' temporaries (a convolution:
  // oneDNN's reordered output gradient and input). 0 for a ReLU fused into the lean max pooling
  // after it, whose backward is the pool's.
  int64_t backward_elements = 0;
};

// A problem found while inferring shapes, naming the layer and both sizes.
struct ShapeProblem {
  std::string layer;    // the layer's name
  std::string problem;  // "Linear expects 25,392,000 input features but ..."
  std::string fix;
  // For a Linear whose `in` is wrong: the size as written and the real flattened size.
  int64_t expected_inputs = 0;
  int64_t actual_inputs = 0;
};

struct NetworkShapes {
  std::vector<LayerShape> layers;  // up to the first layer that cannot run
  std::vector<ShapeProblem> problems;
  std::vector<int64_t> output;  // the network's output per sample, when there are no problems
  int64_t parameters() const;
  int64_t buffers() const;
  bool ok() const { return problems.empty(); }
};

// Pure arithmetic: allocates no tensor. A Linear whose written `in` differs from its real input
// is reported and inference carries on with the size as written, so later problems (and the
// parameter count the author's code would allocate) are still found.
// `lean_pooling` as NetworkOptions::lean_pooling: what max pooling keeps for backward.
NetworkShapes infer_shapes(const std::vector<LayerSpec>& layers, const std::vector<int64_t>& input,
                           bool lean_pooling = true);

// "64 x 15 x 57 x 57"
std::string format_shape(const std::vector<int64_t>& shape);
// "25,392,000"
std::string format_count(int64_t n);

struct NetworkOptions {
  NetworkOptions(std::vector<LayerSpec> layers, std::vector<int64_t> input)
      : layers_(std::move(layers)), input_(std::move(input)) {}
  TORCH_ARG(std::vector<LayerSpec>, layers);
  TORCH_ARG(std::vector<int64_t>, input);  // per sample: [C,H,W] or [C,T,H,W]
  // conv3d layers (one group) are LeanConv3d (models/conv3d.h): on the CPU, one with few output
  // positions runs its backward without oneDNN's weight-sized workspace; false: oneDNN's.
  TORCH_ARG(bool, lean_backward) = true;
  // maxpool layers keep only their indices for backward, and a relu right before one runs on the
  // pooled output (models/pooling.h): same values and gradients, far less kept memory after a
  // convolution; false: PyTorch's max pooling, which keeps its input.
  TORCH_ARG(bool, lean_pooling) = true;
};

// The network as a module whose children carry the layers' names, so its state_dict matches a
// PyTorch module with the same attribute names ("conv1.weight", "fc1.bias"). Construction
// checks the shapes first: a layer that does not fit its input is an error before any
// parameter is allocated.
class NetworkImpl : public torch::nn::Module {
 public:
  explicit NetworkImpl(const NetworkOptions& options);
  // [N, input...] -> [N, output...]
  torch::Tensor forward(const torch::Tensor& x);
  const NetworkOptions& options() const { return options_; }
  const NetworkShapes& shapes() const { return shapes_; }
  // Layers [begin, end) only: each maps one activation to the next, so a chain of them can be
  // checkpointed (engine/checkpoint.h).
  torch::Tensor forward_layers(torch::Tensor x, int64_t begin, int64_t end);
  int64_t layer_count() const { return static_cast<int64_t>(layers_.size()); }

  // Time slicing: each convolution, with the ReLU and pooling layers after it, runs over up to
  // `slices` slices of its output along the first spatial dimension (time for clips, rows for
  // images), each slice reading its input rows and the few around them its kernel needs.
  // Layers that act on nearby rows only compute each output row once either way, so values and
  // gradients are those of the whole tensor (up to the order of floating-point sums), but a
  // full-resolution convolution's output and its gradient - the largest tensors of seeds/001's
  // step, passed to pooling or ReLU and freed - exist one slice at a time, in forward and in
  // backward (autograd runs the slices' backward one after the other, last first). A
  // convolution followed by BatchNorm, GroupNorm or dropout is not sliced (their statistics or
  // random masks span the whole tensor), nor pooling that pads the sliced dimension.
  // 0 or 1: off.
  void set_time_slices(int64_t slices);
  int64_t time_slices() const { return time_slices_; }
  // Whether any convolution here is sliced when time slicing is on.
  bool sliceable() const;

 private:
  // The layers [begin, end) one after the other (forward_layers without slicing).
  torch::Tensor forward_unsliced(torch::Tensor x, int64_t begin, int64_t end);
  // Where the sliced run headed by convolution `head` ends (head + 1 when nothing follows it
  // that slices), within `end`.
  int64_t sliced_run_end(int64_t head, int64_t end) const;
  torch::Tensor forward_sliced(const torch::Tensor& x, int64_t head, int64_t run_end);
  // Convolution layer `index` on x with `padding` in place of its own.
  torch::Tensor conv_padded(int64_t index, const torch::Tensor& x, at::IntArrayRef padding);

  NetworkOptions options_;
  NetworkShapes shapes_;
  std::vector<torch::nn::AnyModule> layers_;
  int64_t time_slices_ = 0;
};
TORCH_MODULE(Network);

// Sets time slicing (NetworkImpl::set_time_slices) on every layer-list network in `module`;
// returns how many of them have a convolution it slices.
int64_t set_time_slices(torch::nn::Module& module, int64_t slices);
// The number of slices framefit uses when it slices: full-resolution outputs held an eighth at
// a time (the step time measured unchanged, bench/results/layers.md).
constexpr int64_t kTimeSlices = 8;

// seeds/001's clip classifier: conv3d(32) relu maxpool conv3d(64) relu maxpool, then the
// author's flatten + fc1 (`as_written`: in_features 64*30*115*115, which do not match) or the
// fix, global average pooling before fc1 (64 -> 512) and fc2 (512 -> classes). `separable`
// uses depthwise-separable 3D convolutions (the proposed slimmer variant).
std::vector<LayerSpec> clip3d_layers(int64_t classes = 20, bool separable = false,
                                     bool as_written = false);

}  // namespace framefit::models
