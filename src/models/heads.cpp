#include "framefit/models/heads.h"

#include <torch/torch.h>

namespace framefit::models {

void TemporalHead::check_features(const torch::Tensor& features, int64_t input_dim) const {
  TORCH_CHECK(features.dim() == 2, "a temporal head takes one video's features [T,D]; got ",
              features.sizes());
  TORCH_CHECK(features.size(1) == input_dim, "the head expects ", input_dim,
              "-d features per frame; got ", features.size(1),
              ". Set the head's input_dim to the encoder's feature_dim().");
  TORCH_CHECK(features.size(0) > 0, "the video has no frames");
}

// ---------------------------------------------------------------------------------------------

LinearHeadImpl::LinearHeadImpl(const LinearHeadOptions& options) : options_(options) {
  fc = register_module("fc", torch::nn::Linear(options.input_dim(), options.num_classes()));
}

torch::Tensor LinearHeadImpl::forward(const torch::Tensor& features) {
  check_features(features, options_.input_dim());
  return fc(features).unsqueeze(0);
}

// ---------------------------------------------------------------------------------------------

LSTMHeadImpl::LSTMHeadImpl(const LSTMHeadOptions& options) : options_(options) {
  TORCH_CHECK(options.hidden() > 0 && options.layers() > 0, "LSTM head needs hidden > 0 and layers > 0");
  lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(options.input_dim(),
                                                                         options.hidden())
                                                     .num_layers(options.layers())
                                                     .bidirectional(options.bidirectional())
                                                     .batch_first(true)));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
  const int64_t out = options.hidden() * (options.bidirectional() ? 2 : 1);
  fc = register_module("fc", torch::nn::Linear(out, options.num_classes()));
}

torch::Tensor LSTMHeadImpl::forward(const torch::Tensor& features) {
  check_features(features, options_.input_dim());
  auto out = std::get<0>(lstm(features.unsqueeze(0)));  // [1,T,H]
  return fc(dropout(out));                              // [1,T,C]
}

// ---------------------------------------------------------------------------------------------

namespace {

class DilatedResidualImpl : public torch::nn::Module {
 public:
  DilatedResidualImpl(int64_t channels, int64_t dilation, bool causal, double dropout)
      : dilation_(dilation), causal_(causal) {
    conv_dilated = register_module(
        "conv_dilated",
        torch::nn::Conv1d(torch::nn::Conv1dOptions(channels, channels, 3).dilation(dilation)));
    conv_1x1 = register_module("conv_1x1", torch::nn::Conv1d(channels, channels, 1));
    drop = register_module("dropout", torch::nn::Dropout(dropout));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    // Causal: all padding on the left, so frame t sees frames t-2d..t only.
    const int64_t left = causal_ ? 2 * dilation_ : dilation_;
    const int64_t right = causal_ ? 0 : dilation_;
    auto out = torch::relu(conv_dilated(torch::constant_pad_nd(x, {left, right})));
    return x + drop(conv_1x1(out));
  }
  torch::nn::Conv1d conv_dilated{nullptr}, conv_1x1{nullptr};
  torch::nn::Dropout drop{nullptr};

 private:
  int64_t dilation_;
  bool causal_;
};
TORCH_MODULE(DilatedResidual);

class TCNStageImpl : public torch::nn::Module {
 public:
  TCNStageImpl(int64_t in, const TCNHeadOptions& o) {
    conv_in = register_module("conv_in", torch::nn::Conv1d(in, o.channels(), 1));
    layers = register_module("layers", torch::nn::Sequential());
    for (int64_t i = 0; i < o.layers(); ++i) {
      layers->push_back(DilatedResidual(o.channels(), int64_t(1) << i, o.causal(), o.dropout()));
    }
    conv_out = register_module("conv_out", torch::nn::Conv1d(o.channels(), o.num_classes(), 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return conv_out(layers->forward(conv_in(x))); }
  torch::nn::Conv1d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(TCNStage);

}  // namespace

TCNHeadImpl::TCNHeadImpl(const TCNHeadOptions& options) : options_(options) {
  TORCH_CHECK(options.stages() >= 1 && options.layers() >= 1 && options.channels() >= 1,
              "TCN head needs stages >= 1, layers >= 1 and channels >= 1");
  stages_ = register_module("stages", torch::nn::ModuleList());
  for (int64_t s = 0; s < options.stages(); ++s) {
    stages_->push_back(TCNStage(s == 0 ? options.input_dim() : options.num_classes(), options));
  }
}

int64_t TCNHeadImpl::receptive_field(const TCNHeadOptions& options) {
  // Each layer with dilation d adds 2d frames; stages stack.
  const int64_t per_stage = 2 * ((int64_t(1) << options.layers()) - 1);
  return options.stages() * per_stage + 1;
}

torch::Tensor TCNHeadImpl::forward(const torch::Tensor& features) {
  check_features(features, options_.input_dim());
  auto x = features.t().unsqueeze(0);  // [1,D,T]
  std::vector<torch::Tensor> outputs;
  for (size_t s = 0; s < stages_->size(); ++s) {
    auto logits = stages_[s]->as<TCNStage>()->forward(s == 0 ? x : torch::softmax(x, 1));
    outputs.push_back(logits.squeeze(0).t());  // [T,C]
    x = logits;
  }
  return torch::stack(outputs);  // [S,T,C]
}

std::shared_ptr<TemporalHead> make_head(const std::string& kind, int64_t input_dim,
                                        int64_t num_classes) {
  if (kind == "linear") return LinearHead(LinearHeadOptions(input_dim, num_classes)).ptr();
  if (kind == "lstm") return LSTMHead(LSTMHeadOptions(input_dim, num_classes)).ptr();
  if (kind == "tcn") return TCNHead(TCNHeadOptions(input_dim, num_classes)).ptr();
  TORCH_CHECK(false, "unknown head '", kind, "': use linear, lstm or tcn");
}

}  // namespace framefit::models

namespace framefit::models {

int64_t head_parameter_count(const std::string& kind, int64_t input_dim, int64_t num_classes,
                             int64_t* largest) {
  int64_t total = 0, big = 0;
  auto add = [&](int64_t elements) {
    total += elements;
    big = std::max(big, elements);
  };
  auto linear = [&](int64_t in, int64_t out, int64_t kernel = 1) {
    add(in * out * kernel);
    add(out);
  };
  if (kind == "linear") {
    linear(input_dim, num_classes);
  } else if (kind == "lstm") {
    const LSTMHeadOptions o(input_dim, num_classes);
    const int64_t directions = o.bidirectional() ? 2 : 1;
    for (int64_t layer = 0; layer < o.layers(); ++layer) {
      const int64_t in = layer == 0 ? input_dim : o.hidden() * directions;
      for (int64_t d = 0; d < directions; ++d) {
        add(4 * o.hidden() * in);          // weight_ih
        add(4 * o.hidden() * o.hidden());  // weight_hh
        add(4 * o.hidden());               // bias_ih
        add(4 * o.hidden());               // bias_hh
      }
    }
    linear(o.hidden() * directions, num_classes);
  } else if (kind == "tcn") {
    const TCNHeadOptions o(input_dim, num_classes);
    for (int64_t s = 0; s < o.stages(); ++s) {
      linear(s == 0 ? input_dim : num_classes, o.channels());
      for (int64_t l = 0; l < o.layers(); ++l) {
        linear(o.channels(), o.channels(), 3);
        linear(o.channels(), o.channels());
      }
      linear(o.channels(), num_classes);
    }
  } else {
    TORCH_CHECK(false, "unknown head '", kind, "': use linear, lstm or tcn");
  }
  if (largest != nullptr) *largest = big;
  return total;
}

}  // namespace framefit::models
