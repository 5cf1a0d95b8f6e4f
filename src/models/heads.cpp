#include "framefit/models/heads.h"

#include <torch/torch.h>

#include <cmath>

#include "framefit/core/runtime.h"

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

namespace {

// ---------------------------------------------------------------------------------------------
// LSTM layer for the CPU with a batched weight gradient.
//
// LibTorch's CPU LSTM backward runs through one autograd node per time step, and each step adds
// a rank-1 update to the full [4H,H] recurrent weight gradient: at T = 1024 and H = 512 that is
// 1024 passes over a 4 MiB matrix, nine times the forward's time. Here backward keeps the
// per-step gate gradients [T,4H] and forms every weight gradient with one matrix product at the
// end; the recurrence itself is one matrix-vector product per step, as in forward. Same
// function, same parameters (PyTorch's gate order i, f, g, o), gradients equal up to rounding.

template <typename T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

class LstmLayerFunction : public torch::autograd::Function<LstmLayerFunction> {
 public:
  // x [T,I], w_ih [4H,I], w_hh [4H,H], b_ih/b_hh [4H] -> hidden states [T,H], from zero initial
  // state, run from the last frame to the first when `reverse`.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w_ih, const torch::Tensor& w_hh,
                               const torch::Tensor& b_ih, const torch::Tensor& b_hh, bool reverse) {
    const int64_t frames = x.size(0), hidden = w_hh.size(1);
    // Activated gates [T,4H] and cell states [T,H]: all backward needs besides x and the output.
    auto gates = torch::addmm(b_ih + b_hh, x, w_ih.t());
    auto cells = torch::empty({frames, hidden}, x.options());
    auto out = torch::empty({frames, hidden}, x.options());
    auto h_prev = torch::zeros({hidden}, x.options());
    auto c_prev = torch::zeros({hidden}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "lstm_forward", [&] {
      for (int64_t step = 0; step < frames; ++step) {
        const int64_t t = reverse ? frames - 1 - step : step;
        auto row = gates[t];
        row.addmv_(w_hh, h_prev);
        auto* g = row.data_ptr<scalar_t>();
        const auto* cp = c_prev.data_ptr<scalar_t>();
        auto* c = cells[t].data_ptr<scalar_t>();
        auto* h = out[t].data_ptr<scalar_t>();
        for (int64_t k = 0; k < hidden; ++k) {
          const scalar_t i = sigmoid(g[k]), f = sigmoid(g[hidden + k]);
          const scalar_t gg = std::tanh(g[2 * hidden + k]), o = sigmoid(g[3 * hidden + k]);
          g[k] = i, g[hidden + k] = f, g[2 * hidden + k] = gg, g[3 * hidden + k] = o;
          c[k] = f * cp[k] + i * gg;
          h[k] = o * std::tanh(c[k]);
        }
        h_prev = out[t];
        c_prev = cells[t];
      }
    });
    ctx->saved_data["reverse"] = reverse;
    ctx->save_for_backward({x, w_ih, w_hh, gates, cells, out});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const bool reverse = ctx->saved_data["reverse"].toBool();
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w_ih = saved[1], &w_hh = saved[2];
    const auto &gates = saved[3], &cells = saved[4], &out = saved[5];
    const int64_t frames = x.size(0), hidden = w_hh.size(1);
    auto grad_out = grad_outputs.at(0);
    if (!grad_out.defined()) grad_out = torch::zeros_like(out);
    grad_out = grad_out.contiguous();
    auto grad_gates = torch::empty_like(gates);         // pre-activation gate gradients
    auto grad_h = torch::zeros({hidden}, x.options());  // from the next step
    auto grad_c = torch::zeros({hidden}, x.options());
    const auto w_hh_t = w_hh.t();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "lstm_backward", [&] {
      const auto zero = torch::zeros({hidden}, x.options());
      for (int64_t step = frames - 1; step >= 0; --step) {
        const int64_t t = reverse ? frames - 1 - step : step;
        const int64_t prev = reverse ? t + 1 : t - 1;
        const bool first = step == 0;
        const auto* a = gates[t].data_ptr<scalar_t>();
        const auto* c = cells[t].data_ptr<scalar_t>();
        const auto* cp = first ? zero.data_ptr<scalar_t>() : cells[prev].data_ptr<scalar_t>();
        const auto* gy = grad_out[t].data_ptr<scalar_t>();
        auto* gh = grad_h.data_ptr<scalar_t>();
        auto* gc = grad_c.data_ptr<scalar_t>();
        auto* d = grad_gates[t].data_ptr<scalar_t>();
        for (int64_t k = 0; k < hidden; ++k) {
          const scalar_t i = a[k], f = a[hidden + k], g = a[2 * hidden + k], o = a[3 * hidden + k];
          const scalar_t tc = std::tanh(c[k]);
          const scalar_t dh = gy[k] + gh[k];
          const scalar_t dc = gc[k] + dh * o * (scalar_t(1) - tc * tc);
          d[k] = dc * g * i * (scalar_t(1) - i);
          d[hidden + k] = dc * cp[k] * f * (scalar_t(1) - f);
          d[2 * hidden + k] = dc * i * (scalar_t(1) - g * g);
          d[3 * hidden + k] = dh * tc * o * (scalar_t(1) - o);
          gc[k] = dc * f;
        }
        at::mv_out(grad_h, w_hh_t, grad_gates[t]);
      }
    });
    // h_{t-1} for every step (zero before the first): the recurrent weight's gradient in one
    // product.
    auto h_prev = torch::zeros_like(out);
    if (frames > 1) {
      if (reverse) {
        h_prev.narrow(0, 0, frames - 1).copy_(out.narrow(0, 1, frames - 1));
      } else {
        h_prev.narrow(0, 1, frames - 1).copy_(out.narrow(0, 0, frames - 1));
      }
    }
    // b_ih and b_hh enter as their sum: the same gradient; `reverse` has none.
    const auto grad_bias = grad_gates.sum(0);
    const auto grad_x = grad_gates.mm(w_ih);
    return {grad_x,    grad_gates.t().mm(x), grad_gates.t().mm(h_prev),
            grad_bias, grad_bias.clone(),    {}};
  }
};

}  // namespace

LSTMHeadImpl::LSTMHeadImpl(const LSTMHeadOptions& options) : options_(options) {
  TORCH_CHECK(options.hidden() > 0 && options.layers() > 0,
              "LSTM head needs hidden > 0 and layers > 0");
  lstm = register_module(
      "lstm", torch::nn::LSTM(torch::nn::LSTMOptions(options.input_dim(), options.hidden())
                                  .num_layers(options.layers())
                                  .bidirectional(options.bidirectional())
                                  .batch_first(true)));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
  const int64_t out = options.hidden() * (options.bidirectional() ? 2 : 1);
  fc = register_module("fc", torch::nn::Linear(out, options.num_classes()));
}

torch::Tensor LSTMHeadImpl::forward(const torch::Tensor& features) {
  check_features(features, options_.input_dim());
  const auto params = lstm->named_parameters();
  const auto dtype = params["weight_ih_l0"].scalar_type();
  const bool own_layer = features.device().is_cpu() && features.scalar_type() == dtype &&
                         (dtype == torch::kFloat || dtype == torch::kDouble) &&
                         !autocast_enabled(/*cuda=*/false);
  if (!own_layer) {  // CUDA (cuDNN fuses the recurrence), autocast, other dtypes
    auto out = std::get<0>(lstm(features.unsqueeze(0)));  // [1,T,H]
    return fc(dropout(out));                              // [1,T,C]
  }
  auto x = features.contiguous();
  for (int64_t layer = 0; layer < options_.layers(); ++layer) {
    std::vector<torch::Tensor> directions;
    for (const bool reverse : {false, true}) {
      if (reverse && !options_.bidirectional()) break;
      const auto name = [&](const char* kind) {
        return std::string(kind) + "_l" + std::to_string(layer) + (reverse ? "_reverse" : "");
      };
      directions.push_back(
          LstmLayerFunction::apply(x, params[name("weight_ih")], params[name("weight_hh")],
                                   params[name("bias_ih")], params[name("bias_hh")], reverse));
    }
    x = directions.size() == 1 ? directions[0] : torch::cat(directions, 1);
  }
  return fc(dropout(x)).unsqueeze(0);  // [1,T,C]
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

LSTMHeadOptions HeadSettings::lstm(int64_t input_dim, int64_t num_classes) const {
  return LSTMHeadOptions(input_dim, num_classes)
      .hidden(lstm_hidden)
      .layers(lstm_layers)
      .bidirectional(bidirectional);
}

TCNHeadOptions HeadSettings::tcn(int64_t input_dim, int64_t num_classes) const {
  return TCNHeadOptions(input_dim, num_classes)
      .stages(tcn_stages)
      .layers(tcn_layers)
      .channels(tcn_channels)
      .causal(causal);
}

std::string HeadSettings::describe(const std::string& kind) const {
  const HeadSettings defaults;
  if (kind == "lstm" && (lstm_hidden != defaults.lstm_hidden ||
                         lstm_layers != defaults.lstm_layers || bidirectional)) {
    return c10::str("lstm ", lstm_hidden, "x", lstm_layers, bidirectional ? " bidirectional" : "");
  }
  if (kind == "tcn" && (tcn_stages != defaults.tcn_stages || tcn_layers != defaults.tcn_layers ||
                        tcn_channels != defaults.tcn_channels || !causal)) {
    return c10::str("tcn ", tcn_stages, "x", tcn_layers, "x", tcn_channels,
                    causal ? "" : " acausal");
  }
  return "";
}

std::shared_ptr<TemporalHead> make_head(const std::string& kind, int64_t input_dim,
                                        int64_t num_classes, const HeadSettings& settings) {
  if (kind == "linear") return LinearHead(LinearHeadOptions(input_dim, num_classes)).ptr();
  if (kind == "lstm") return LSTMHead(settings.lstm(input_dim, num_classes)).ptr();
  if (kind == "tcn") return TCNHead(settings.tcn(input_dim, num_classes)).ptr();
  TORCH_CHECK(false, "unknown head '", kind, "': use linear, lstm or tcn");
}

}  // namespace framefit::models

namespace framefit::models {

int64_t head_parameter_count(const std::string& kind, int64_t input_dim, int64_t num_classes,
                             int64_t* largest, const HeadSettings& settings) {
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
    const auto o = settings.lstm(input_dim, num_classes);
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
    const auto o = settings.tcn(input_dim, num_classes);
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
