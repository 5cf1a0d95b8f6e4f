#pragma once
// Temporal heads: per-frame features of one video [T,D] -> per-frame class logits [S,T,C],
// where S is the number of stages (1 except for the multi-stage TCN, whose later stages refine
// the earlier ones and are all trained).
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>

namespace framefit::models {

class TemporalHead : public torch::nn::Module {
 public:
  // features [T,D] -> logits [S,T,C]
  virtual torch::Tensor forward(const torch::Tensor& features) = 0;
  virtual int64_t num_classes() const = 0;

 protected:
  void check_features(const torch::Tensor& features, int64_t input_dim) const;
};

struct LinearHeadOptions {
  LinearHeadOptions(int64_t input_dim, int64_t num_classes)
      : input_dim_(input_dim), num_classes_(num_classes) {}
  TORCH_ARG(int64_t, input_dim);
  TORCH_ARG(int64_t, num_classes);
};

// Each frame on its own: the baseline without temporal context.
class LinearHeadImpl : public TemporalHead {
 public:
  explicit LinearHeadImpl(const LinearHeadOptions& options);
  torch::Tensor forward(const torch::Tensor& features) override;
  int64_t num_classes() const override { return options_.num_classes(); }
  torch::nn::Linear fc{nullptr};

 private:
  LinearHeadOptions options_;
};
TORCH_MODULE(LinearHead);

struct LSTMHeadOptions {
  LSTMHeadOptions(int64_t input_dim, int64_t num_classes)
      : input_dim_(input_dim), num_classes_(num_classes) {}
  TORCH_ARG(int64_t, input_dim);
  TORCH_ARG(int64_t, num_classes);
  TORCH_ARG(int64_t, hidden) = 512;
  TORCH_ARG(int64_t, layers) = 1;
  TORCH_ARG(bool, bidirectional) = false;  // false: online (causal) recognition
  TORCH_ARG(double, dropout) = 0.0;
};

// seeds/000's head: LSTM(D -> hidden) -> Linear(hidden -> classes) per frame.
class LSTMHeadImpl : public TemporalHead {
 public:
  explicit LSTMHeadImpl(const LSTMHeadOptions& options);
  torch::Tensor forward(const torch::Tensor& features) override;
  int64_t num_classes() const override { return options_.num_classes(); }
  const LSTMHeadOptions& options() const { return options_; }
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Dropout dropout{nullptr};
  torch::nn::Linear fc{nullptr};

 private:
  LSTMHeadOptions options_;
};
TORCH_MODULE(LSTMHead);

struct TCNHeadOptions {
  TCNHeadOptions(int64_t input_dim, int64_t num_classes)
      : input_dim_(input_dim), num_classes_(num_classes) {}
  TORCH_ARG(int64_t, input_dim);
  TORCH_ARG(int64_t, num_classes);
  TORCH_ARG(int64_t, stages) = 2;    // MS-TCN stages
  TORCH_ARG(int64_t, layers) = 8;    // dilated residual layers per stage (dilation 1..2^(L-1))
  TORCH_ARG(int64_t, channels) = 64;
  TORCH_ARG(bool, causal) = true;    // only past frames (TeCNO, online recognition)
  TORCH_ARG(double, dropout) = 0.5;
};

// MS-TCN / TeCNO: a stack of dilated residual temporal convolutions; stage s > 1 refines the
// softmax of stage s-1.
class TCNHeadImpl : public TemporalHead {
 public:
  explicit TCNHeadImpl(const TCNHeadOptions& options);
  torch::Tensor forward(const torch::Tensor& features) override;
  int64_t num_classes() const override { return options_.num_classes(); }
  const TCNHeadOptions& options() const { return options_; }
  // How many past frames (or past and future, when not causal) one output sees.
  int64_t receptive_field() const { return receptive_field(options_); }
  // Frames each output sees, from the options alone (the doctor checks it without building).
  static int64_t receptive_field(const TCNHeadOptions& options);

 private:
  TCNHeadOptions options_;
  torch::nn::ModuleList stages_{nullptr};
};
TORCH_MODULE(TCNHead);

// A head's size as a config sets it (model.lstm_*, model.tcn_*, model.bidirectional,
// model.causal). The defaults are seeds/000's LSTM 512 and TeCNO's two-stage causal TCN; MS-TCN
// on GTEA/50Salads/Breakfast is tcn_stages 4, tcn_layers 10, causal false.
struct HeadSettings {
  int64_t lstm_hidden = 512;
  int64_t lstm_layers = 1;
  bool bidirectional = false;
  int64_t tcn_stages = 2;
  int64_t tcn_layers = 8;
  int64_t tcn_channels = 64;
  bool causal = true;
  LSTMHeadOptions lstm(int64_t input_dim, int64_t num_classes) const;
  TCNHeadOptions tcn(int64_t input_dim, int64_t num_classes) const;
  // What differs from the defaults, e.g. "tcn 4x10x64 acausal" ("" at the defaults).
  std::string describe(const std::string& kind) const;
};

// Parameter elements of make_head(kind, input_dim, num_classes, settings), without building it;
// `largest` (optional) receives the largest single parameter tensor's elements.
int64_t head_parameter_count(const std::string& kind, int64_t input_dim, int64_t num_classes,
                             int64_t* largest = nullptr, const HeadSettings& settings = {});

// "linear" | "lstm" | "tcn" of the given sizes.
std::shared_ptr<TemporalHead> make_head(const std::string& kind, int64_t input_dim,
                                        int64_t num_classes, const HeadSettings& settings = {});

}  // namespace framefit::models
