#include "framefit/engine/chunked.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <optional>

#include "framefit/engine/amp.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/resnet.h"
#include "replay.h"

namespace framefit::engine {

namespace {
// The trained parameters and the mutable state (BatchNorm statistics) of `module`.
void collect_state(const torch::nn::Module& module, FrameEncoder& encoder) {
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) encoder.parameters.push_back(p);
  }
  encoder.buffers = module.buffers();
}
}  // namespace

FrameEncoder frame_encoder(const std::shared_ptr<models::ResNetImpl>& resnet) {
  TORCH_CHECK(resnet != nullptr, "frame_encoder: no ResNet");
  const int64_t frozen = resnet->frozen_stage_count();
  const auto stages = static_cast<int64_t>(resnet->stage_names().size());
  FrameEncoder encoder;
  if (frozen > 0) {
    encoder.frozen = [resnet, frozen](const torch::Tensor& x) {
      return resnet->forward_stages(x, 0, frozen);
    };
  }
  encoder.trainable = [resnet, frozen, stages](const torch::Tensor& x) {
    return resnet->forward_stages(x, frozen, stages);
  };
  collect_state(*resnet, encoder);
  return encoder;
}

FrameEncoder frame_encoder(const std::shared_ptr<torch::nn::Module>& module,
                           std::function<torch::Tensor(const torch::Tensor&)> forward) {
  TORCH_CHECK(module != nullptr && forward, "frame_encoder: no module or forward function");
  FrameEncoder encoder;
  encoder.trainable = std::move(forward);
  collect_state(*module, encoder);
  return encoder;
}

namespace {

// The memory phase `name` on the options' tracker while the result lives; none without one.
std::optional<memory::PeakWindow> memory_phase(const ChunkedOptions& options, const char* name) {
  if (options.tracker == nullptr) return std::nullopt;
  return options.tracker->phase(name);
}

// Frames [N,3,H,W] as the trainable stages take them: converted, normalised, on the device, and
// through the frozen stages, which never need grad (their output is never differentiated).
torch::Tensor frozen_output(const FrameEncoder& encoder, const torch::Tensor& frames,
                            const ChunkedOptions& options) {
  auto x = frames_to_input(frames, options.device, options.dtype, options.channels_last,
                           options.normalization);
  if (!encoder.frozen) return x;
  torch::NoGradGuard no_grad;
  return encoder.frozen(x);
}

// Everything backward needs, carried through the autograd context as a capsule.
struct ChunkedState : torch::CustomClassHolder {
  FrameEncoder encoder;
  ChunkedOptions options;
  torch::Tensor frames;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [begin, end) frame ranges
  std::vector<detail::RngState> rng;                // generator states before each chunk
  std::vector<torch::Tensor> frozen_cache;          // per chunk, when options.cache_frozen
  std::vector<torch::Tensor> kept;                  // per chunk: output with its graph, or empty
  AutocastState autocast;

  // Chunk i through the frozen stages: recomputed, or cached.
  torch::Tensor frozen_output(size_t i) const {
    if (!frozen_cache.empty() && frozen_cache[i].defined()) return frozen_cache[i];
    const auto [begin, end] = chunks[i];
    return engine::frozen_output(encoder, frames.slice(0, begin, end), options);
  }
};

class ChunkedEncodeFunction : public torch::autograd::Function<ChunkedEncodeFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               c10::intrusive_ptr<ChunkedState> state, at::TensorList parameters) {
    auto& s = *state;
    const auto phase = memory_phase(s.options, "encode");
    const int64_t total = s.frames.size(0);
    const size_t n = s.chunks.size();
    const size_t first_kept = n - static_cast<size_t>(std::min<int64_t>(s.options.keep, n));
    s.kept.assign(n, torch::Tensor());
    if (s.options.cache_frozen && s.encoder.frozen) s.frozen_cache.assign(n, torch::Tensor());
    torch::Tensor features;
    for (size_t i = 0; i < n; ++i) {
      s.rng.push_back(detail::RngState::capture(s.options.device));
      auto h = s.frozen_output(i);
      if (!s.frozen_cache.empty()) s.frozen_cache[i] = h;
      torch::Tensor out;
      if (i >= first_kept) {
        // Autocast caches the bf16/fp16 copies of the weights; copies made during the no-grad
        // chunks carry no grad_fn, and reusing them would silently cut the weights' gradients.
        if (i == first_kept) at::autocast::clear_cache();
        torch::AutoGradMode grad(true);
        out = s.encoder.trainable(h);
        s.kept[i] = out;
      } else {
        out = s.encoder.trainable(h);
      }
      TORCH_CHECK(out.dim() == 2 && out.size(0) == h.size(0),
                  "the encoder must map [N,3,H,W] to [N,D] features; got ", out.sizes());
      if (!features.defined()) {
        const auto dtype = out.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
        features = torch::empty({total, out.size(1)},
                                torch::TensorOptions().dtype(dtype).device(s.options.device));
      }
      const auto [begin, end] = s.chunks[i];
      features.slice(0, begin, end).copy_(out.detach());
    }
    at::autocast::clear_cache();  // no no-grad weight copies may leak to the caller's code
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return features;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<ChunkedState>(ctx->saved_data["state"].toCapsule());
    auto& s = *state;
    const auto phase = memory_phase(s.options, "recompute");
    const auto& grad = grad_outputs.at(0);
    const auto& params = s.encoder.parameters;
    std::vector<torch::Tensor> sums(params.size());
    auto accumulate = [&](const torch::Tensor& out, size_t i) {
      const auto [begin, end] = s.chunks[i];
      // torch::autograd::grad, not backward(): a re-entrant backward() would write .grad and
      // break callers that use torch::autograd::grad on the loss.
      auto grads =
          torch::autograd::grad({out}, params, {grad.slice(0, begin, end).to(out.scalar_type())},
                                /*retain_graph=*/false, /*create_graph=*/false,
                                /*allow_unused=*/true);
      for (size_t p = 0; p < params.size(); ++p) {
        if (!grads[p].defined()) continue;
        sums[p] = sums[p].defined() ? sums[p].add_(grads[p]) : grads[p];
      }
    };
    at::autocast::clear_cache();  // see forward: cached casts may lack grad_fn
    for (size_t i = s.chunks.size(); i-- > 0;) {
      if (s.kept[i].defined()) {
        auto out = std::move(s.kept[i]);
        accumulate(out, i);
        continue;
      }
      detail::RngReplay replay(s.rng[i]);
      detail::BufferSnapshot snapshot(s.encoder.buffers);
      AutocastGuard autocast(s.autocast);
      auto h = s.frozen_output(i);
      if (!s.frozen_cache.empty()) s.frozen_cache[i] = torch::Tensor();
      torch::AutoGradMode grad_mode(true);
      accumulate(s.encoder.trainable(h), i);
    }
    s.frozen_cache.clear();
    // One entry per forward argument: none for the state, then each parameter's gradient.
    torch::autograd::variable_list result{torch::Tensor()};
    result.insert(result.end(), sums.begin(), sums.end());
    return result;
  }
};

void check_options(const ChunkedOptions& options) {
  TORCH_CHECK(options.chunk >= 0, "chunk must be >= 0 frames (0 = naive, all frames at once); got ",
              options.chunk);
  TORCH_CHECK(options.keep >= 0, "keep must be >= 0 chunks; got ", options.keep);
}

}  // namespace

torch::Tensor chunked_encode(const FrameEncoder& encoder, const torch::Tensor& frames,
                             const ChunkedOptions& options) {
  check_video_frames(frames, "chunked_encode");
  check_options(options);
  TORCH_CHECK(encoder.trainable, "chunked_encode: the encoder has no trainable part");
  const int64_t total = frames.size(0);
  const bool differentiable = torch::GradMode::is_enabled() && !encoder.parameters.empty();

  if (!differentiable || options.chunk == 0 || options.chunk >= total) {
    // Naive training (one pass with grad), or a pass without grad (inference, evaluation): that
    // one runs chunk by chunk too, so it holds one chunk's activations, not the video's.
    const auto phase = memory_phase(options, "encode");
    const int64_t step = differentiable || options.chunk == 0 ? total : options.chunk;
    torch::Tensor features;
    for (int64_t begin = 0; begin < total; begin += step) {
      const int64_t end = std::min(total, begin + step);
      auto out = encoder.trainable(frozen_output(encoder, frames.slice(0, begin, end), options));
      if (out.scalar_type() != torch::kFloat64) out = out.to(torch::kFloat32);
      if (end - begin == total) return out;
      if (!features.defined()) features = torch::empty({total, out.size(1)}, out.options());
      features.slice(0, begin, end).copy_(out);
    }
    return features;
  }

  auto state = c10::make_intrusive<ChunkedState>();
  state->encoder = encoder;
  state->options = options;
  state->frames = frames;
  state->autocast = AutocastState::current();
  for (int64_t begin = 0; begin < total; begin += options.chunk) {
    state->chunks.emplace_back(begin, std::min(total, begin + options.chunk));
  }
  return ChunkedEncodeFunction::apply(state, at::TensorList(encoder.parameters));
}

}  // namespace framefit::engine
