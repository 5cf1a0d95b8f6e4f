#include "framefit/plan/doctor.h"

#include <torch/torch.h>

#include <optional>
#include <unordered_map>

#include "framefit/core/runtime.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/heads.h"
#include "framefit/models/resnet.h"

namespace framefit::plan {

namespace {
// Below this many frames per chunk, BatchNorm's batch statistics are too noisy to train with.
constexpr int64_t kMinBatchNormFrames = 16;

Finding error(std::string problem, std::string fix) {
  return {Finding::Severity::Error, std::move(problem), std::move(fix)};
}
Finding warning(std::string problem, std::string fix) {
  return {Finding::Severity::Warning, std::move(problem), std::move(fix)};
}

std::string parameter_fix(const models::LayerShape& layer) {
  if (layer.type == "linear") {
    return "check its in_features against the layer before it; put global average pooling before "
           "the classifier so its input is the channel count, not every position";
  }
  return "use fewer channels or a smaller kernel in " + layer.name;
}
}  // namespace

bool has_errors(const std::vector<Finding>& findings) {
  return std::any_of(findings.begin(), findings.end(),
                     [](const Finding& f) { return f.severity == Finding::Severity::Error; });
}

void refuse_errors(const std::vector<Finding>& findings) {
  for (const auto& f : findings) {
    TORCH_CHECK(f.severity != Finding::Severity::Error, f.problem, ": ", f.fix);
  }
}

std::vector<Finding> diagnose(const PlanRequest& request, int64_t budget_bytes) {
  std::vector<Finding> findings;
  if (request.frames > kMaxFramesPerVideo) {
    findings.push_back(error(c10::str(request.frames, " frames per video are more than the ",
                                      kMaxFramesPerVideo, " the memory model takes"),
                             "split the video"));
    return findings;
  }
  const auto& spec = request.model;
  StaticSizes sizes;
  try {
    sizes = static_sizes(spec);
  } catch (const c10::Error& e) {
    findings.push_back(error(e.msg(), "fix the model settings"));
    return findings;
  }
  if (spec.size < sizes.min_input_size) {
    findings.push_back(
        error(c10::str(spec.size, "x", spec.size, " frames are too small for ", spec.model,
                       ": it downsamples by ", sizes.min_input_size),
              c10::str("use frames of at least ", sizes.min_input_size, "x", sizes.min_input_size,
                       spec.drop_layer4 ? "" : ", or drop layer4 (16x16 minimum)")));
  }
  if (spec.norm == "group_norm") {
    const int64_t widths[] = {64, 128, 256, 512};
    for (int64_t w : widths) {
      if (spec.groups <= 0 || w % spec.groups != 0) {
        findings.push_back(error(
            c10::str("group_norm with ", spec.groups, " groups cannot split ", w, " channels"),
            "choose a group count that divides 64 (e.g. 32, 16 or 8)"));
        break;
      }
    }
  }
  if (budget_bytes > 0) {
    const int64_t minimum = static_minimum_bytes(sizes, request.frames);
    if (minimum > budget_bytes) {
      findings.push_back(error(
          c10::str("the budget of ", memory::format_bytes(budget_bytes),
                   " is below the static minimum of ", memory::format_bytes(minimum),
                   " (parameters and buffers ", memory::format_bytes(sizes.parameter_bytes),
                   ", gradients ", memory::format_bytes(sizes.trained_bytes()), ", ",
                   spec.optimizer, " state ", memory::format_bytes(sizes.optimizer_state_bytes),
                   ", ", request.frames, " frames and their features ",
                   memory::format_bytes(minimum - sizes.parameter_bytes - sizes.trained_bytes() -
                                        sizes.optimizer_state_bytes),
                   ") that no chunk size can reduce"),
          c10::str("raise the budget to at least ", memory::format_bytes(minimum),
                   ", freeze early stages (--freeze layer2), use --optimizer sgd (half Adam's "
                   "state), or shorter videos")));
    }
  }
  const bool trained_bn = spec.norm == "bn";
  if (trained_bn && request.chunk) {
    const int64_t effective =
        *request.chunk == 0 ? request.frames : std::min(*request.chunk, request.frames);
    if (effective < kMinBatchNormFrames && sizes.trained_encoder_bytes > 0) {
      findings.push_back(warning(
          c10::str("BatchNorm computes its statistics from each chunk: ", effective,
                   " frame(s) per chunk give noisy statistics and poor training"),
          c10::str("use --norm frozen_bn (pretrained statistics) or --norm group_norm, or a chunk "
                   "of at least ",
                   kMinBatchNormFrames, " frames")));
    }
  }
  for (const auto precision : request.precisions) {
    if (precision == engine::Precision::FP16 && spec.device.is_cpu()) {
      findings.push_back(error("fp16 autocast runs on CUDA only; LibTorch's CPU autocast uses bf16",
                               "use --precision bf16 on the CPU"));
    }
    if (precision == engine::Precision::BF16 && spec.device.is_cpu()) {
      const auto& bf16 = cpu_bf16();
      if (bf16.kernels == Bf16Kernels::Unavailable) {
        findings.push_back(error("bf16 cannot run here: " + bf16.reason, "use fp32 here"));
      } else if (bf16.kernels == Bf16Kernels::Emulated) {
        findings.push_back(warning("bf16 runs emulated here (" + bf16.reason +
                                       "): a step takes several times as long as in fp32",
                                   "use fp32 here unless memory alone matters"));
      }
    }
  }
  if (sizes.trained_encoder_bytes == 0) {
    findings.push_back(warning(
        "the whole encoder is frozen: only the head trains, and every epoch runs the encoder "
        "again (without grad) unless its features are cached",
        "freeze less to train end to end, or train with data.augment false: framefit train then "
        "keeps each video's features after the first epoch (train.cache_features)"));
  }
  if (spec.head == "tcn") {
    const auto tcn = spec.head_settings.tcn(sizes.feature_dim, spec.classes);
    const int64_t field = models::TCNHeadImpl::receptive_field(tcn);
    if (field > request.frames) {
      findings.push_back(warning(c10::str("the TCN head sees ", field, " frames but videos have ",
                                          request.frames, ": its deepest layers see only padding"),
                                 "use longer videos or the lstm head"));
    }
  }
  if (request.chunk && request.keep && *request.chunk > 0 && *request.chunk < request.frames) {
    const int64_t chunks = (request.frames + *request.chunk - 1) / *request.chunk;
    if (*request.keep > chunks) {
      findings.push_back(warning(c10::str("keep ", *request.keep, " is more than the ", chunks,
                                          " chunks of a ", request.frames, "-frame video"),
                                 c10::str("keep at most ", chunks, " (or leave keep to auto)")));
    }
  }
  return findings;
}

namespace {
// diagnose_network_weights' findings, and the shapes they came from (none where the layer list
// cannot be read).
std::vector<Finding> diagnose_weights(const std::vector<models::LayerSpec>& layers,
                                      const std::vector<int64_t>& input,
                                      const NetworkTraining& training, int64_t budget_bytes,
                                      std::optional<models::NetworkShapes>& inferred) {
  std::vector<Finding> findings;
  models::NetworkShapes shapes;
  try {
    shapes = models::infer_shapes(layers, input);
  } catch (const c10::Error& e) {
    findings.push_back(error(e.msg(), "fix the layer list"));
    return findings;
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(training.dtype));
  const std::string dtype_name = training.dtype == torch::kFloat64    ? "float64"
                                 : training.dtype == torch::kBFloat16 ? "bfloat16"
                                 : training.dtype == torch::kHalf     ? "float16"
                                                                      : "float32";
  const auto layer_shape = [&](const std::string& name) -> const models::LayerShape* {
    for (const auto& l : shapes.layers) {
      if (l.name == name) return &l;
    }
    return nullptr;
  };
  for (const auto& p : shapes.problems) {
    std::string problem = p.layer + ": " + p.problem;
    const auto* shape = layer_shape(p.layer);
    if (p.expected_inputs > 0 && shape != nullptr) {
      problem +=
          c10::str("; as written ", shape->largest_parameter_name, " holds ",
                   models::format_count(shape->largest_parameter), " values, ",
                   memory::format_bytes(shape->largest_parameter * element), " in ", dtype_name);
    }
    findings.push_back(error(problem, p.fix));
  }
  if (budget_bytes <= 0) return findings;
  for (const auto& l : shapes.layers) {
    const int64_t bytes = l.largest_parameter * element;
    if (bytes > budget_bytes) {
      findings.push_back(error(
          c10::str(l.largest_parameter_name, " alone is ", memory::format_bytes(bytes), " (",
                   models::format_count(l.largest_parameter), " ", dtype_name,
                   " values), more than the whole budget of ", memory::format_bytes(budget_bytes),
                   ": allocating it fails before training starts"),
          parameter_fix(l)));
    }
  }
  inferred = shapes;
  if (!shapes.ok()) return findings;
  const auto m = network_memory(shapes, input, training);
  if (m.static_bytes() >= budget_bytes) {
    findings.push_back(
        error(c10::str("the network's ", models::format_count(shapes.parameters()),
                       " parameters with their gradients and ", training.optimizer, " state take ",
                       memory::format_bytes(m.static_bytes()), " (parameters ",
                       memory::format_bytes(m.parameter_bytes), ", gradients ",
                       memory::format_bytes(m.gradient_bytes), ", ", training.optimizer, " state ",
                       memory::format_bytes(m.optimizer_state_bytes),
                       "), not less than the budget of ", memory::format_bytes(budget_bytes)),
              "raise the budget, use sgd, or a slimmer network (fewer channels, global average "
              "pooling before the classifier)"));
  }
  return findings;
}
}  // namespace

std::vector<Finding> diagnose_network_weights(const std::vector<models::LayerSpec>& layers,
                                              const std::vector<int64_t>& input,
                                              const NetworkTraining& training,
                                              int64_t budget_bytes) {
  std::optional<models::NetworkShapes> shapes;
  return diagnose_weights(layers, input, training, budget_bytes, shapes);
}

std::vector<Finding> diagnose_network(const std::vector<models::LayerSpec>& layers,
                                      const std::vector<int64_t>& input,
                                      const NetworkTraining& training, int64_t budget_bytes) {
  std::optional<models::NetworkShapes> shapes;
  auto findings = diagnose_weights(layers, input, training, budget_bytes, shapes);
  if (!shapes || !shapes->ok() || budget_bytes <= 0 || has_errors(findings)) return findings;
  const auto m = network_memory(*shapes, input, training);
  if (m.peak_bytes(1) > budget_bytes) {
    findings.push_back(error(
        c10::str("one sample needs ", memory::format_bytes(m.peak_bytes(1)), " (parameters ",
                 memory::format_bytes(m.parameter_bytes), ", gradients ",
                 memory::format_bytes(m.gradient_bytes), ", ", training.optimizer, " state ",
                 memory::format_bytes(m.optimizer_state_bytes), ", activations and backward ",
                 memory::format_bytes(m.activation_bytes_per_sample + m.backward_bytes_per_sample),
                 "), more than the budget of ", memory::format_bytes(budget_bytes)),
        "use bf16 activations, layer checkpointing, smaller inputs, or a slimmer network "
        "(depthwise-separable convolutions, global average pooling before the classifier)"));
  } else if (m.peak_bytes(training.batch) > budget_bytes) {
    findings.push_back(error(
        c10::str("batch ", training.batch, " needs ",
                 memory::format_bytes(m.peak_bytes(training.batch)), " (",
                 memory::format_bytes(m.static_bytes()), " static + ", training.batch, " x ",
                 memory::format_bytes(m.bytes_per_sample()),
                 " per sample), more than the budget of ", memory::format_bytes(budget_bytes)),
        c10::str("use a batch of at most ", m.largest_batch(budget_bytes),
                 " and accumulate gradients to reach ", training.batch)));
  }
  return findings;
}

std::vector<Finding> check_optimizer(const torch::nn::Module& model,
                                     const torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& p : model.named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  std::vector<std::string> frozen;
  int64_t frozen_elements = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.requires_grad()) continue;
      const auto it = names.find(p.unsafeGetTensorImpl());
      frozen.push_back(it != names.end() ? it->second : "(a tensor outside the model)");
      frozen_elements += p.numel();
    }
  }
  if (frozen.empty()) return {};
  std::string list;
  for (size_t i = 0; i < frozen.size() && i < 5; ++i) list += (i ? ", " : "") + frozen[i];
  if (frozen.size() > 5) list += c10::str(" and ", frozen.size() - 5, " more");
  return {error(c10::str(frozen.size(), " frozen parameter(s) were handed to the optimizer (", list,
                         "; ", frozen_elements,
                         " elements): they are never trained yet may cost "
                         "optimizer state"),
                "pass only parameters with requires_grad (e.g. framefit::engine::frame_encoder's "
                "parameters) to the optimizer")};
}

}  // namespace framefit::plan
