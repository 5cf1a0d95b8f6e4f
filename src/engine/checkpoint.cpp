#include "framefit/engine/checkpoint.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <utility>

#include "framefit/engine/amp.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/network.h"
#include "framefit/models/resnet.h"
#include "framefit/models/unet.h"
#include "framefit/models/video_resnet.h"
#include "replay.h"

namespace framefit::engine {

Stage make_stage(std::string name, const torch::nn::Module& module,
                 std::function<torch::Tensor(const torch::Tensor&)> forward) {
  Stage stage;
  stage.name = std::move(name);
  stage.forward = std::move(forward);
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) stage.parameters.push_back(p);
  }
  stage.buffers = module.buffers();
  return stage;
}

std::vector<Stage> resnet_stages(const std::shared_ptr<models::ResNetImpl>& resnet) {
  TORCH_CHECK(resnet != nullptr, "resnet_stages: no ResNet");
  TORCH_CHECK(resnet->frozen_stage_count() == 0,
              "resnet_stages: checkpoint the trained stages only; run frozen stages without grad "
              "(the chunked encoder does) and build the chain from an unfrozen ResNet");
  std::vector<Stage> stages;
  stages.push_back(make_stage("stem", *resnet->conv1, [resnet](const torch::Tensor& x) {
    return resnet->forward_stages(x, 0, 1);
  }));
  // The stem's norm is a separate child of the ResNet: give the stage its parameters too.
  for (const auto& p : resnet->bn1->parameters()) {
    if (p.requires_grad()) stages.back().parameters.push_back(p);
  }
  for (const auto& b : resnet->bn1->buffers()) stages.back().buffers.push_back(b);
  const std::vector<std::pair<std::string, torch::nn::Sequential>> layers = {
      {"layer1", resnet->layer1}, {"layer2", resnet->layer2}, {"layer3", resnet->layer3}};
  auto all_layers = layers;
  if (!resnet->options().drop_layer4()) all_layers.emplace_back("layer4", resnet->layer4);
  for (const auto& [name, layer] : all_layers) {
    for (size_t i = 0; i < layer->size(); ++i) {
      auto block = layer->ptr(i);
      stages.push_back(
          make_stage(name + "." + std::to_string(i), *block, [block](const torch::Tensor& x) {
            return block->as<models::ResidualBlockImpl>()->forward(x);
          }));
    }
  }
  const int64_t count = static_cast<int64_t>(resnet->stage_names().size());
  Stage head;
  head.name = "pool";
  head.forward = [resnet, count](const torch::Tensor& x) {
    auto f = resnet->forward_stages(x, count, count);
    return resnet->fc ? resnet->fc->forward(f) : f;
  };
  if (resnet->fc) head = make_stage("pool+fc", *resnet->fc, head.forward);
  stages.push_back(std::move(head));
  return stages;
}

std::vector<Stage> network_stages(const std::shared_ptr<models::NetworkImpl>& network) {
  TORCH_CHECK(network != nullptr, "network_stages: no network");
  // One stage per convolution or linear layer with the layers after it (norm, activation,
  // pooling): measured as a block, the intermediates that are freed inside it are not counted
  // as kept, and a boundary falls where one tensor is handed on.
  const auto& layers = network->options().layers();
  const auto children = network->named_children();
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t i = 0; i < network->layer_count(); ++i) {
    const auto& type = layers[static_cast<size_t>(i)].type;
    const bool starts = type.find("conv") != std::string::npos || type == "linear";
    if (ranges.empty() || starts) {
      ranges.emplace_back(i, i + 1);
    } else {
      ranges.back().second = i + 1;
    }
  }
  std::vector<Stage> stages;
  for (const auto& [begin, end] : ranges) {
    Stage stage;
    stage.name = children[static_cast<size_t>(begin)].key();
    const auto b = begin, e = end;
    stage.forward = [network, b, e](const torch::Tensor& x) {
      return network->forward_layers(x, b, e);
    };
    for (int64_t i = begin; i < end; ++i) {
      const auto& module = *children[static_cast<size_t>(i)].value();
      for (const auto& p : module.parameters()) {
        if (p.requires_grad()) stage.parameters.push_back(p);
      }
      for (const auto& buffer : module.buffers()) stage.buffers.push_back(buffer);
    }
    stages.push_back(std::move(stage));
  }
  return stages;
}

std::vector<Stage> video_resnet_stages(const std::shared_ptr<models::VideoResNetImpl>& video) {
  TORCH_CHECK(video != nullptr, "video_resnet_stages: no model");
  const auto names = video->block_names();
  std::vector<Stage> stages;
  for (size_t i = 0; i < names.size(); ++i) {
    Stage stage;
    stage.name = names[i];
    const auto b = static_cast<int64_t>(i);
    stage.forward = [video, b](const torch::Tensor& x) {
      return video->forward_blocks(x, b, b + 1);
    };
    // The block's parameters by name: "layer2.1." is block layer2.1, "fc." the head's.
    const std::string prefix = names[i] == "head" ? "fc." : names[i] + ".";
    for (const auto& p : video->named_parameters()) {
      if (p.key().rfind(prefix, 0) == 0 && p.value().requires_grad()) {
        stage.parameters.push_back(p.value());
      }
    }
    for (const auto& p : video->named_buffers()) {
      if (p.key().rfind(prefix, 0) == 0) stage.buffers.push_back(p.value());
    }
    stages.push_back(std::move(stage));
  }
  return stages;
}

namespace {

MultiStage as_multi(const Stage& stage) {
  return {stage.name, [f = stage.forward](const std::vector<torch::Tensor>& x) { return f(x[0]); },
          stage.parameters, stage.buffers};
}

// Gradients of `output` (seeded with `grad`) for `wrt`, as torch::autograd::grad with
// allow_unused, but holding neither `output` nor `grad` while backward runs: autograd::grad holds
// both until it returns, and each is as large as the stage's output. Released, the output is
// freed as soon as the graph is done with it, and the seed once the output's node has used it.
torch::autograd::variable_list grad_releasing_output(torch::Tensor output, torch::Tensor grad,
                                                     const std::vector<torch::Tensor>& wrt) {
  using namespace torch::autograd;
  TORCH_CHECK(output.requires_grad(), "checkpoint: the recomputed stage's output needs no grad");
  const edge_list roots{impl::gradient_edge(output)};
  edge_list wanted;
  for (const auto& w : wrt) {
    auto node = w.grad_fn() ? w.grad_fn() : impl::try_get_grad_accumulator(w);
    // A tensor the graph does not reach: its gradient comes back undefined.
    wanted.emplace_back(node ? Edge(node, w.output_nr()) : Edge(std::make_shared<Identity>(), 0));
  }
  // The engine reads the seed list once, when it starts, and keeps the caller's list alive
  // until it returns; a hook on the output's node, which runs after that read, empties it.
  auto seeds = std::make_shared<variable_list>(variable_list{std::move(grad)});
  output.register_hook([seeds](const torch::Tensor&) {
    seeds->clear();
    return torch::Tensor();  // the gradient unchanged
  });
  output.reset();
  return Engine::get_default_engine().execute(roots, *seeds, /*keep_graph=*/false,
                                              /*create_graph=*/false, /*accumulate_grad=*/false,
                                              wanted);
}

struct CheckpointState : torch::CustomClassHolder {
  MultiStage stage;
  detail::RngState rng;
  AutocastState autocast;
  std::vector<bool> input_requires_grad;
  // The gradient of the checkpoint's output, taken from the engine by a hook (take_incoming).
  torch::Tensor incoming;
};

// A recomputed stage needs its output's gradient only for its last operation, but a custom
// autograd function's backward() gets it from a list its node holds until backward returns:
// through the whole recompute, one output's bytes more than a stored stage holds. A hook on
// the output (run by the engine just before the node) takes the gradient and hands the node a
// stand-in of one element's storage, so backward holds the only reference and can let it go.
void take_incoming(torch::Tensor& output, const c10::intrusive_ptr<CheckpointState>& state) {
  output.register_hook([state](const torch::Tensor& grad) {
    if (!grad.defined()) return torch::Tensor();
    state->incoming = grad;
    return torch::zeros({}, grad.options()).expand(grad.sizes());
  });
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               c10::intrusive_ptr<CheckpointState> state, at::TensorList inputs,
                               at::TensorList parameters) {
    state->rng = detail::RngState::capture(inputs.front().device());
    state->autocast = AutocastState::current();
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      out = state->stage.forward(inputs.vec());
    }
    // Weight casts cached by autocast under no-grad carry no grad_fn: never reuse them.
    at::autocast::clear_cache();
    for (const auto& input : inputs) {
      if (out.is_alias_of(input)) out = out.clone();  // an output may not view a saved input
    }
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    auto& s = *state;
    const auto saved = ctx->get_saved_variables();
    std::vector<torch::Tensor> inputs, wrt;
    for (size_t i = 0; i < saved.size(); ++i) {
      inputs.push_back(saved[i].detach());
      if (s.input_requires_grad[i]) wrt.push_back(inputs.back().requires_grad_(true));
    }
    wrt.insert(wrt.end(), s.stage.parameters.begin(), s.stage.parameters.end());
    torch::autograd::variable_list grads;
    {
      detail::RngReplay replay(s.rng);
      detail::BufferSnapshot snapshot(s.stage.buffers);
      AutocastGuard autocast(s.autocast);
      torch::AutoGradMode grad_mode(true);
      at::autocast::clear_cache();
      auto out = s.stage.forward(inputs);
      // The hook's gradient (the node's is a stand-in) unless the hook did not run.
      auto grad = std::exchange(s.incoming, torch::Tensor());
      if (!grad.defined()) grad = grad_outputs.at(0);
      grad = grad.to(out.scalar_type());
      grads = grad_releasing_output(std::move(out), std::move(grad), wrt);
    }
    // One entry per forward argument, lists flattened: the state, each input, each parameter.
    torch::autograd::variable_list result{torch::Tensor()};
    size_t next = 0;
    for (size_t i = 0; i < saved.size(); ++i) {
      result.push_back(s.input_requires_grad[i] ? grads[next++] : torch::Tensor());
    }
    for (size_t p = 0; p < s.stage.parameters.size(); ++p) result.push_back(grads[next++]);
    return result;
  }
};

Stage merge(const std::vector<Stage>& stages, int64_t begin, int64_t end) {
  if (end - begin == 1) return stages[static_cast<size_t>(begin)];
  Stage merged;
  merged.name =
      stages[static_cast<size_t>(begin)].name + ".." + stages[static_cast<size_t>(end - 1)].name;
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> parts;
  for (int64_t i = begin; i < end; ++i) {
    const auto& s = stages[static_cast<size_t>(i)];
    parts.push_back(s.forward);
    merged.parameters.insert(merged.parameters.end(), s.parameters.begin(), s.parameters.end());
    merged.buffers.insert(merged.buffers.end(), s.buffers.begin(), s.buffers.end());
  }
  merged.forward = [parts](const torch::Tensor& input) {
    auto x = input;
    for (const auto& f : parts) x = f(x);
    return x;
  };
  return merged;
}

// A nested segment as one stage: its forward checkpoints every stage but the last, so when the
// outer checkpoint recomputes it with grad, only the stages' inputs are kept and each stage is
// recomputed again in its own backward.
Stage nest(const std::vector<Stage>& stages, int64_t begin, int64_t end) {
  Stage nested = merge(stages, begin, end);
  std::vector<Stage> inner(stages.begin() + begin, stages.begin() + end);
  nested.forward = [inner](const torch::Tensor& input) {
    auto x = input;
    for (size_t i = 0; i + 1 < inner.size(); ++i) x = checkpoint(inner[i], x);
    return inner.back().forward(x);
  };
  return nested;
}

}  // namespace

torch::Tensor checkpoint(const MultiStage& stage, const std::vector<torch::Tensor>& inputs) {
  TORCH_CHECK(stage.forward, "checkpoint: stage ", stage.name, " has no forward function");
  TORCH_CHECK(!inputs.empty(), "checkpoint: stage ", stage.name, " has no input");
  bool any_input_grad = false;
  for (const auto& x : inputs) any_input_grad = any_input_grad || x.requires_grad();
  const bool differentiable =
      torch::GradMode::is_enabled() && (any_input_grad || !stage.parameters.empty());
  if (!differentiable) return stage.forward(inputs);
  auto state = c10::make_intrusive<CheckpointState>();
  state->stage = stage;
  for (const auto& x : inputs) state->input_requires_grad.push_back(x.requires_grad());
  auto out =
      CheckpointFunction::apply(state, at::TensorList(inputs), at::TensorList(stage.parameters));
  take_incoming(out, state);
  return out;
}

torch::Tensor checkpoint(const Stage& stage, const torch::Tensor& input) {
  TORCH_CHECK(stage.forward, "checkpoint: stage ", stage.name, " has no forward function");
  return checkpoint(as_multi(stage), {input});
}

torch::Tensor run_chain(const std::vector<Stage>& stages, const std::vector<ChainSegment>& segments,
                        torch::Tensor x) {
  int64_t expected = 0;
  for (const auto& seg : segments) {
    TORCH_CHECK(seg.begin == expected && seg.end > seg.begin &&
                    seg.end <= static_cast<int64_t>(stages.size()),
                "run_chain: segments must cover the ", stages.size(),
                " stages in order without gaps; got [", seg.begin, ", ", seg.end, ") after ",
                expected);
    expected = seg.end;
    if (seg.recompute) {
      x = checkpoint(
          seg.nested ? nest(stages, seg.begin, seg.end) : merge(stages, seg.begin, seg.end), x);
    } else {
      for (int64_t i = seg.begin; i < seg.end; ++i) x = stages[static_cast<size_t>(i)].forward(x);
    }
  }
  TORCH_CHECK(expected == static_cast<int64_t>(stages.size()), "run_chain: the segments cover ",
              expected, " of ", stages.size(), " stages");
  return x;
}

namespace {

// Runs `stage` with grad (its graph stays alive in `output`), measuring what it keeps and its
// time; then runs it again alone, forward and backward, for its peak. The second run changes
// nothing: BatchNorm statistics are restored, the random stream replayed, and gradients are
// returned (torch::autograd::grad), not accumulated.
StageCost measure_stage(const MultiStage& stage, const std::vector<torch::Tensor>& inputs,
                        torch::Tensor& output, bool held_gradient, memory::Tracker& tracker) {
  TORCH_CHECK(tracker.device().type() == inputs.front().device().type(), "a stage on ",
              inputs.front().device(), " is measured on that device's tracker, not ",
              tracker.device(), "'s");
  torch::AutoGradMode grad_mode(true);
  const auto rng = detail::RngState::capture(inputs.front().device());
  StageCost cost;
  for (const auto& p : stage.parameters) cost.parameter_grad_bytes += p.numel() * p.element_size();
  {
    const int64_t before = tracker.current_bytes();
    const auto start = std::chrono::steady_clock::now();
    output = stage.forward(inputs);
    if (output.is_cuda()) torch::cuda::synchronize();
    cost.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    cost.kept_bytes = std::max<int64_t>(0, tracker.current_bytes() - before);
    cost.output_bytes = static_cast<int64_t>(output.nbytes());
  }
  detail::RngReplay replay(rng);
  detail::BufferSnapshot snapshot(stage.buffers);
  auto window = tracker.mark();
  // As a stored stage in training: gradients only for the inputs that need one (not the
  // network's input). Unless `held_gradient`, the output is released before backward (only what
  // the graph saved of it stays) and the incoming gradient freed once the stage's last operation
  // has used it: it comes as the product's gradient, whose factor only the graph holds.
  std::vector<torch::Tensor> alone, wrt;
  for (const auto& x : inputs) {
    alone.push_back(x.detach());
    if (x.requires_grad()) wrt.push_back(alone.back().requires_grad_(true));
  }
  wrt.insert(wrt.end(), stage.parameters.begin(), stage.parameters.end());
  auto y = stage.forward(alone);
  cost.forward_peak_bytes = window.peak_bytes() - window.entry_bytes();
  if (!wrt.empty() && y.requires_grad()) {
    if (held_gradient) {
      torch::autograd::grad({y}, wrt, {torch::ones_like(y)}, false, false, /*allow_unused=*/true);
    } else {
      auto seeded = (y * torch::ones_like(y)).sum();
      y.reset();
      grad_releasing_output(std::move(seeded), torch::ones_like(seeded), wrt);
    }
  }
  cost.peak_bytes = window.peak_bytes() - window.entry_bytes();
  return cost;
}

}  // namespace

std::vector<StageCost> measure_stages(const std::vector<Stage>& stages, const torch::Tensor& input,
                                      memory::Tracker& tracker) {
  std::vector<StageCost> costs;
  std::vector<torch::Tensor> outputs;  // the whole graph stays alive, as without checkpointing
  auto x = input;
  for (const auto& stage : stages) {
    torch::Tensor y;
    costs.push_back(measure_stage(as_multi(stage), {x}, y, /*held_gradient=*/false, tracker));
    outputs.push_back(y);
    x = y;
  }
  return costs;
}

std::vector<StageCost> scale_costs(const std::vector<StageCost>& costs, double factor) {
  auto scaled = costs;
  for (auto& c : scaled) {
    c.kept_bytes = static_cast<int64_t>(static_cast<double>(c.kept_bytes) * factor);
    c.output_bytes = static_cast<int64_t>(static_cast<double>(c.output_bytes) * factor);
    c.peak_bytes = static_cast<int64_t>(static_cast<double>(c.peak_bytes) * factor);
    c.forward_peak_bytes = static_cast<int64_t>(static_cast<double>(c.forward_peak_bytes) * factor);
    c.seconds *= factor;  // parameter_grad_bytes: the same at any batch
  }
  return scaled;
}

std::vector<ChainSegment> store_all(int64_t stages) { return {{0, stages, false}}; }

std::vector<ChainSegment> recompute_every(int64_t stages, int64_t every) {
  TORCH_CHECK(every >= 1, "recompute_every: segments of at least one stage; got ", every);
  std::vector<ChainSegment> segments;
  for (int64_t b = 0; b < stages; b += every)
    segments.push_back({b, std::min(stages, b + every), true});
  return segments;
}

std::vector<bool> recomputed(const std::vector<ChainSegment>& segments) {
  std::vector<bool> flags;
  for (const auto& s : segments) flags.insert(flags.end(), s.end - s.begin, s.recompute);
  return flags;
}

std::vector<std::string> unet_stage_names(const models::UNetImpl& unet) {
  std::vector<std::string> names;
  for (int64_t i = 0; i <= unet.depth(); ++i) names.push_back("down" + std::to_string(i));
  for (int64_t j = 0; j < unet.depth(); ++j) names.push_back("up" + std::to_string(j));
  names.push_back("out");
  return names;
}

namespace {

// Where a UNet's plain forward measures each stage's cost on the way.
struct StageMeasure {
  std::vector<StageCost>& costs;
  memory::Tracker& tracker;
};

torch::Tensor unet_pass(const std::shared_ptr<models::UNetImpl>& unet, const torch::Tensor& x,
                        const std::vector<bool>& recompute, const StageMeasure* measure) {
  TORCH_CHECK(unet != nullptr, "unet_forward: no UNet");
  const auto names = unet_stage_names(*unet);
  TORCH_CHECK(recompute.empty() || recompute.size() == names.size(),
              "unet_forward: ", recompute.size(), " recompute flags for the ", names.size(),
              " stages of this UNet");
  TORCH_CHECK(measure == nullptr || recompute.empty(),
              "unet_forward: measure costs without checkpointing");
  unet->check_input(x);
  const int64_t depth = unet->depth();
  size_t index = 0;
  // Runs stage `index` over `inputs`, checkpointed when flagged, measured when asked.
  // `held_gradient`: the output has two consumers (an encoder stage's, pooled and skipped), so
  // the first part of its gradient waits for the second; the others' comes whole and is freed
  // once used.
  const auto run = [&](const torch::nn::Module& module, bool held_gradient,
                       std::function<torch::Tensor(const std::vector<torch::Tensor>&)> forward,
                       const std::vector<torch::Tensor>& inputs) {
    const size_t i = index++;
    if (!recompute.empty() && recompute[i]) {
      const auto stage = make_stage(names[i], module, {});
      return checkpoint(MultiStage{names[i], std::move(forward), stage.parameters, stage.buffers},
                        inputs);
    }
    if (measure == nullptr) return forward(inputs);
    const auto stage = make_stage(names[i], module, {});
    torch::Tensor y;
    measure->costs.push_back(
        measure_stage(MultiStage{names[i], std::move(forward), stage.parameters, stage.buffers},
                      inputs, y, held_gradient, measure->tracker));
    return y;
  };
  std::vector<torch::Tensor> skips;
  auto h = x;
  for (int64_t i = 0; i <= depth; ++i) {
    h = run(
        *unet->down[static_cast<size_t>(i)], /*held_gradient=*/i < depth,
        [unet, i](const std::vector<torch::Tensor>& in) { return unet->encoder_stage(i, in[0]); },
        {h});
    if (i < depth) skips.push_back(h);
  }
  for (int64_t j = 0; j < depth; ++j) {
    h = run(*unet->up[static_cast<size_t>(j)], /*held_gradient=*/false,
            [unet, j](const std::vector<torch::Tensor>& in) {
              return unet->decoder_stage(j, in[0], in[1]);
            },
            {h, skips[static_cast<size_t>(depth - 1 - j)]});
  }
  return run(*unet->out, /*held_gradient=*/false,
             [unet](const std::vector<torch::Tensor>& in) { return unet->head(in[0]); }, {h});
}

}  // namespace

torch::Tensor unet_forward(const std::shared_ptr<models::UNetImpl>& unet, const torch::Tensor& x,
                           const std::vector<bool>& recompute) {
  return unet_pass(unet, x, recompute, nullptr);
}

int64_t ChainNetwork::stage_count() const {
  return unet ? static_cast<int64_t>(unet_stage_names(*unet).size())
              : static_cast<int64_t>(stages.size());
}

torch::Tensor ChainNetwork::forward(const torch::Tensor& x,
                                    const std::vector<ChainSegment>& segments) const {
  if (unet) return unet_forward(unet, x, recomputed(segments));
  return run_chain(stages, segments, x);
}

std::vector<StageCost> ChainNetwork::measure(const torch::Tensor& x,
                                             memory::Tracker& tracker) const {
  if (!unet) return measure_stages(stages, x, tracker);
  std::vector<StageCost> costs;
  torch::AutoGradMode grad(true);
  const StageMeasure measure{costs, tracker};
  unet_pass(unet, x, {}, &measure);
  return costs;
}

namespace {

ChainNetwork chain_of(std::shared_ptr<torch::nn::Module> module, std::vector<Stage> stages) {
  ChainNetwork net;
  net.module = std::move(module);
  net.stages = std::move(stages);
  return net;
}

}  // namespace

ChainNetwork chain_network(const std::shared_ptr<models::NetworkImpl>& network) {
  return chain_of(network, network_stages(network));
}

ChainNetwork chain_network(const std::shared_ptr<models::VideoResNetImpl>& video) {
  return chain_of(video, video_resnet_stages(video));
}

ChainNetwork chain_network(const std::shared_ptr<models::ResNetImpl>& resnet) {
  return chain_of(resnet, resnet_stages(resnet));
}

ChainNetwork chain_network(const std::shared_ptr<models::UNetImpl>& unet) {
  ChainNetwork net;
  net.module = unet;
  net.unet = unet;
  return net;
}

ChainNetwork chain_network(const std::shared_ptr<torch::nn::Module>& module,
                           std::function<torch::Tensor(const torch::Tensor&)> forward) {
  return chain_of(module, {make_stage("network", *module, std::move(forward))});
}

}  // namespace framefit::engine
