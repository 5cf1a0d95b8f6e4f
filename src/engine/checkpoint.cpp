#include "framefit/engine/checkpoint.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "framefit/engine/amp.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/network.h"
#include "framefit/models/resnet.h"
#include "framefit/models/unet.h"
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
  std::vector<Stage> stages;
  const auto children = network->named_children();
  for (int64_t i = 0; i < network->layer_count(); ++i) {
    const auto& child = children[static_cast<size_t>(i)];
    stages.push_back(make_stage(child.key(), *child.value(), [network, i](const torch::Tensor& x) {
      return network->forward_layers(x, i, i + 1);
    }));
  }
  return stages;
}

namespace {

struct CheckpointState : torch::CustomClassHolder {
  MultiStage stage;
  detail::RngState rng;
  AutocastState autocast;
  std::vector<bool> input_requires_grad;
};

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
      const auto& grad = grad_outputs.at(0);
      grads = torch::autograd::grad({out}, wrt, {grad.to(out.scalar_type())},
                                    /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
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
  return CheckpointFunction::apply(state, at::TensorList(inputs), at::TensorList(stage.parameters));
}

torch::Tensor checkpoint(const Stage& stage, const torch::Tensor& input) {
  TORCH_CHECK(stage.forward, "checkpoint: stage ", stage.name, " has no forward function");
  MultiStage multi;
  multi.name = stage.name;
  multi.forward = [f = stage.forward](const std::vector<torch::Tensor>& x) { return f(x[0]); };
  multi.parameters = stage.parameters;
  multi.buffers = stage.buffers;
  return checkpoint(multi, {input});
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
      x = checkpoint(merge(stages, seg.begin, seg.end), x);
    } else {
      for (int64_t i = seg.begin; i < seg.end; ++i) x = stages[static_cast<size_t>(i)].forward(x);
    }
  }
  TORCH_CHECK(expected == static_cast<int64_t>(stages.size()), "run_chain: the segments cover ",
              expected, " of ", stages.size(), " stages");
  return x;
}

std::vector<StageCost> measure_stages(const std::vector<Stage>& stages,
                                      const torch::Tensor& input) {
  auto& tracker = memory::Tracker::of(input.device());
  std::vector<StageCost> costs;
  std::vector<torch::Tensor> outputs;  // the whole graph stays alive, as without checkpointing
  torch::AutoGradMode grad_mode(true);
  auto x = input;
  for (const auto& stage : stages) {
    const int64_t before = tracker.current_bytes();
    const auto start = std::chrono::steady_clock::now();
    auto y = stage.forward(x);
    if (y.is_cuda()) torch::cuda::synchronize();
    StageCost cost;
    cost.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    cost.kept_bytes = std::max<int64_t>(0, tracker.current_bytes() - before);
    cost.output_bytes = static_cast<int64_t>(y.nbytes());
    costs.push_back(cost);
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
    c.seconds *= factor;
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

int64_t ChainPlan::recomputed_stages() const {
  int64_t n = 0;
  for (const auto& s : segments) n += s.recompute ? s.end - s.begin : 0;
  return n;
}

namespace {

int64_t transient_bytes(const std::vector<StageCost>& costs) {
  int64_t largest = 0;
  for (const auto& c : costs) largest = std::max(largest, c.output_bytes);
  return 2 * largest;
}

// Prefix sums so a segment's kept bytes and time are O(1).
struct Prefix {
  std::vector<int64_t> kept;
  std::vector<double> seconds;
  explicit Prefix(const std::vector<StageCost>& costs)
      : kept(costs.size() + 1), seconds(costs.size() + 1) {
    for (size_t i = 0; i < costs.size(); ++i) {
      kept[i + 1] = kept[i] + costs[i].kept_bytes;
      seconds[i + 1] = seconds[i] + costs[i].seconds;
    }
  }
  int64_t segment_kept(int64_t b, int64_t e) const { return kept[e] - kept[b]; }
  double segment_seconds(int64_t b, int64_t e) const { return seconds[e] - seconds[b]; }
};

}  // namespace

ChainPlan evaluate_chain(const std::vector<StageCost>& costs, std::vector<ChainSegment> segments) {
  const Prefix prefix(costs);
  ChainPlan plan;
  int64_t kept = 0, largest_recompute = 0;
  for (const auto& s : segments) {
    if (s.recompute) {
      kept += costs[static_cast<size_t>(s.end - 1)].output_bytes;
      largest_recompute = std::max(largest_recompute, prefix.segment_kept(s.begin, s.end));
      plan.recompute_seconds += prefix.segment_seconds(s.begin, s.end);
    } else {
      kept += prefix.segment_kept(s.begin, s.end);
    }
  }
  plan.segments = std::move(segments);
  plan.predicted_bytes = kept + largest_recompute + transient_bytes(costs);
  return plan;
}

ChainPlan plan_chain(const std::vector<StageCost>& costs, int64_t budget_bytes,
                     int64_t max_segment_stages) {
  TORCH_CHECK(!costs.empty(), "plan_chain: no stages");
  TORCH_CHECK(budget_bytes >= 0, "plan_chain: the budget must not be negative");
  const auto n = static_cast<int64_t>(costs.size());
  const Prefix prefix(costs);
  const int64_t transient = transient_bytes(costs);
  const int64_t longest = max_segment_stages > 0 ? max_segment_stages : n;

  // The least memory any plan reaches: for each cap on the recomputed segment, the cheapest
  // cover in kept bytes (exact, O(n^2) per cap).
  std::vector<int64_t> caps = {0};
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t e = b + 1; e <= std::min(n, b + longest); ++e) {
      caps.push_back(prefix.segment_kept(b, e));
    }
  }
  std::sort(caps.begin(), caps.end());
  caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
  const auto least_kept = [&](int64_t cap, std::vector<ChainSegment>* out) {
    const int64_t inf = std::numeric_limits<int64_t>::max() / 4;
    std::vector<int64_t> best(n + 1, inf);
    std::vector<int64_t> from(n + 1, -1);
    std::vector<bool> recompute(n + 1, false);
    best[0] = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (best[i] >= inf) continue;
      const int64_t store = best[i] + costs[i].kept_bytes;
      if (store < best[i + 1]) best[i + 1] = store, from[i + 1] = i, recompute[i + 1] = false;
      for (int64_t e = i + 1; e <= std::min(n, i + longest) && prefix.segment_kept(i, e) <= cap;
           ++e) {
        const int64_t v = best[i] + costs[e - 1].output_bytes;
        if (v < best[e]) best[e] = v, from[e] = i, recompute[e] = true;
      }
    }
    if (out) {
      out->clear();
      for (int64_t e = n; e > 0; e = from[e]) out->push_back({from[e], e, recompute[e]});
      std::reverse(out->begin(), out->end());
    }
    return best[n];
  };
  int64_t minimum = std::numeric_limits<int64_t>::max();
  int64_t minimum_cap = 0;
  for (int64_t cap : caps) {
    const int64_t total = least_kept(cap, nullptr) + cap;
    if (total < minimum) minimum = total, minimum_cap = cap;
  }
  minimum += transient;

  const auto no_recompute = evaluate_chain(costs, store_all(n));
  if (budget_bytes == 0 || no_recompute.predicted_bytes <= budget_bytes) {
    auto plan = no_recompute;
    plan.fits = true;
    plan.minimum_bytes = minimum;
    return plan;
  }
  if (minimum > budget_bytes) {
    std::vector<ChainSegment> segments;
    least_kept(minimum_cap, &segments);
    auto plan = evaluate_chain(costs, segments);
    plan.fits = false;
    plan.minimum_bytes = minimum;
    return plan;
  }

  // Least recompute time within the budget: for each cap on the recomputed segment, a DP over
  // (stage, kept memory in units of the budget / kUnits) minimising time. Sizes are rounded up,
  // so every plan it returns fits; it may miss plans within n units of the budget.
  constexpr int64_t kUnits = 256;
  const double unit = static_cast<double>(budget_bytes) / kUnits;
  const auto units = [&](int64_t bytes) {
    return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) / unit));
  };
  ChainPlan best_plan;
  double best_seconds = std::numeric_limits<double>::infinity();
  const double inf = std::numeric_limits<double>::infinity();
  int64_t previous_cap_units = -1;
  for (int64_t cap : caps) {
    const int64_t room = units(budget_bytes - transient - cap);
    if (budget_bytes - transient - cap < 0) break;
    const int64_t cap_units = units(cap);
    if (cap_units == previous_cap_units) continue;  // same rounded problem
    previous_cap_units = cap_units;
    // time[i][m]: least recompute seconds covering stages [0, i) keeping m units.
    std::vector<std::vector<double>> time(n + 1, std::vector<double>(room + 1, inf));
    struct Step {
      int64_t begin = -1, units = -1;
      bool recompute = false;
    };
    std::vector<std::vector<Step>> from(n + 1, std::vector<Step>(room + 1));
    time[0][0] = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t m = 0; m <= room; ++m) {
        if (time[i][m] == inf) continue;
        const int64_t stored = m + units(costs[i].kept_bytes);
        if (stored <= room && time[i][m] < time[i + 1][stored]) {
          time[i + 1][stored] = time[i][m];
          from[i + 1][stored] = {i, m, false};
        }
        for (int64_t e = i + 1; e <= std::min(n, i + longest) && prefix.segment_kept(i, e) <= cap;
             ++e) {
          const int64_t kept = m + units(costs[e - 1].output_bytes);
          const double t = time[i][m] + prefix.segment_seconds(i, e);
          if (kept <= room && t < time[e][kept]) {
            time[e][kept] = t;
            from[e][kept] = {i, m, true};
          }
        }
      }
    }
    int64_t end_units = -1;
    for (int64_t m = 0; m <= room; ++m) {
      if (time[n][m] < inf && (end_units < 0 || time[n][m] < time[n][end_units])) end_units = m;
    }
    if (end_units < 0 || time[n][end_units] >= best_seconds) continue;
    std::vector<ChainSegment> segments;
    for (int64_t e = n, m = end_units; e > 0;) {
      const auto step = from[e][m];
      if (!step.recompute && !segments.empty() && !segments.back().recompute) {
        segments.back().begin = step.begin;  // consecutive stored stages: one segment
      } else {
        segments.push_back({step.begin, e, step.recompute});
      }
      e = step.begin;
      m = step.units;
    }
    std::reverse(segments.begin(), segments.end());
    auto plan = evaluate_chain(costs, segments);
    if (plan.predicted_bytes > budget_bytes) continue;  // rounding never allows this; be safe
    best_seconds = time[n][end_units];
    best_plan = plan;
  }
  if (best_plan.segments.empty()) {  // only the least-memory plan fits
    std::vector<ChainSegment> segments;
    least_kept(minimum_cap, &segments);
    best_plan = evaluate_chain(costs, segments);
  }
  best_plan.fits = best_plan.predicted_bytes <= budget_bytes;
  best_plan.minimum_bytes = minimum;
  return best_plan;
}

std::vector<bool> recomputed(const ChainPlan& plan) {
  std::vector<bool> flags;
  for (const auto& s : plan.segments) flags.insert(flags.end(), s.end - s.begin, s.recompute);
  return flags;
}

std::vector<std::string> unet_stage_names(const models::UNetImpl& unet) {
  std::vector<std::string> names;
  for (int64_t i = 0; i <= unet.depth(); ++i) names.push_back("down" + std::to_string(i));
  for (int64_t j = 0; j < unet.depth(); ++j) names.push_back("up" + std::to_string(j));
  names.push_back("out");
  return names;
}

torch::Tensor unet_forward(const std::shared_ptr<models::UNetImpl>& unet, const torch::Tensor& x,
                           const std::vector<bool>& recompute, std::vector<StageCost>* costs) {
  TORCH_CHECK(unet != nullptr, "unet_forward: no UNet");
  const auto names = unet_stage_names(*unet);
  TORCH_CHECK(recompute.empty() || recompute.size() == names.size(),
              "unet_forward: ", recompute.size(), " recompute flags for the ", names.size(),
              " stages of this UNet");
  TORCH_CHECK(costs == nullptr || recompute.empty(),
              "unet_forward: measure costs without checkpointing");
  const int64_t depth = unet->depth();
  auto& tracker = memory::Tracker::of(x.device());
  size_t index = 0;
  // Runs stage `index` over `inputs`, checkpointed when flagged, measured when asked.
  const auto run = [&](const torch::nn::Module& module,
                       std::function<torch::Tensor(const std::vector<torch::Tensor>&)> forward,
                       const std::vector<torch::Tensor>& inputs) {
    const size_t i = index++;
    if (!recompute.empty() && recompute[i]) {
      const auto stage = make_stage(names[i], module, {});
      return checkpoint(MultiStage{names[i], std::move(forward), stage.parameters, stage.buffers},
                        inputs);
    }
    if (costs == nullptr) return forward(inputs);
    const int64_t before = tracker.current_bytes();
    const auto start = std::chrono::steady_clock::now();
    auto y = forward(inputs);
    if (y.is_cuda()) torch::cuda::synchronize();
    costs->push_back(
        {std::max<int64_t>(0, tracker.current_bytes() - before), static_cast<int64_t>(y.nbytes()),
         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()});
    return y;
  };
  std::vector<torch::Tensor> skips;
  auto h = x;
  for (int64_t i = 0; i <= depth; ++i) {
    h = run(
        *unet->down[static_cast<size_t>(i)],
        [unet, i](const std::vector<torch::Tensor>& in) { return unet->encoder_stage(i, in[0]); },
        {h});
    if (i < depth) skips.push_back(h);
  }
  for (int64_t j = 0; j < depth; ++j) {
    h = run(*unet->up[static_cast<size_t>(j)],
            [unet, j](const std::vector<torch::Tensor>& in) {
              return unet->decoder_stage(j, in[0], in[1]);
            },
            {h, skips[static_cast<size_t>(depth - 1 - j)]});
  }
  return run(*unet->out, [unet](const std::vector<torch::Tensor>& in) { return unet->head(in[0]); },
             {h});
}

}  // namespace framefit::engine
