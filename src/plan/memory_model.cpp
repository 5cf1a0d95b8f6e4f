#include "framefit/plan/memory_model.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "framefit/core/runtime.h"
#include "framefit/models/heads.h"
#include "framefit/models/resnet.h"

namespace framefit::plan {

std::string ModelSpec::calibration_key(engine::Precision precision) const {
  const auto caps = cpu_kernel_caps();
  return c10::str(model, "/", norm, norm == "group_norm" ? c10::str(groups) : "",
                  "/freeze=", freeze.empty() ? "none" : freeze, drop_layer4 ? "/no-layer4" : "",
                  channels_last ? "/channels-last" : "",
                  channels_last && !nchw_from.empty() ? "/nchw-from-" + nchw_from : "",
                  recompute_norm ? "/norm-recomputed" : "", "/", head,
                  head_settings.describe(head).empty() ? "" : " " + head_settings.describe(head),
                  "/", size, "px/", dtype, "/", engine::to_string(precision), "/",
                  device.type() == torch::kCPU
                      ? "cpu" + (caps.empty() ? "" : " " + caps)
                      : "cuda");
}

models::ResNetOptions ModelSpec::encoder_options() const {
  return models::ResNetOptions(models::parse_resnet_name(model))
      .num_classes(0)
      .norm(models::parse_norm_kind(norm))
      .groups(groups)
      .freeze(freeze)
      .drop_layer4(drop_layer4)
      .channels_last(channels_last)
      .nchw_from(nchw_from)
      .recompute_norm(recompute_norm);
}

namespace {

// Adds the head, the optimizer state and the per-frame sizes to an encoder's sizes.
StaticSizes with_head(StaticSizes sizes, const ModelSpec& spec, int64_t feature_dim,
                      int64_t encoder_largest_trained) {
  int64_t head_largest = 0;
  const int64_t head = models::head_parameter_count(spec.head, feature_dim, spec.classes,
                                                    &head_largest, spec.head_settings) +
                       spec.tools * (feature_dim + 1);
  const int64_t element = static_cast<int64_t>(c10::elementSize(spec.dtype));
  sizes.parameter_bytes += head * element;
  sizes.trained_head_bytes = head * element;
  sizes.largest_trained_bytes = std::max(encoder_largest_trained, head_largest * element);
  TORCH_CHECK(spec.optimizer == "sgd" || spec.optimizer == "adam" || spec.optimizer == "adamw",
              "unknown optimizer '", spec.optimizer, "': use sgd, adam or adamw");
  // SGD keeps one momentum buffer per parameter, Adam(W) two moments.
  sizes.optimizer_state_bytes = (spec.optimizer == "sgd" ? 1 : 2) * sizes.trained_bytes();
  sizes.frame_bytes = 3 * spec.size * spec.size;
  sizes.frames_in_host_memory = !spec.device.is_cpu();
  sizes.feature_dim = feature_dim;
  sizes.feature_bytes = feature_dim * (spec.dtype == torch::kFloat64 ? 8 : 4);
  return sizes;
}

}  // namespace

StaticSizes static_sizes(const ModelSpec& spec) {
  const auto encoder = models::resnet_size(spec.encoder_options());
  const int64_t element = static_cast<int64_t>(c10::elementSize(spec.dtype));
  StaticSizes sizes;
  sizes.parameter_bytes =
      (encoder.parameters + encoder.buffer_elements) * element + encoder.buffer_counters * 8;
  sizes.trained_encoder_bytes = encoder.trained_parameters * element;
  sizes.min_input_size = encoder.min_input_size;
  sizes.frozen_stages = encoder.frozen_stages;
  return with_head(sizes, spec, encoder.feature_dim, encoder.largest_trained * element);
}

StaticSizes static_sizes(const ModelSpec& spec, const torch::nn::Module& encoder,
                         int64_t feature_dim) {
  StaticSizes sizes;
  int64_t largest = 0;
  for (const auto& p : encoder.parameters()) {
    const auto bytes = static_cast<int64_t>(p.nbytes());
    sizes.parameter_bytes += bytes;
    if (!p.requires_grad()) continue;
    sizes.trained_encoder_bytes += bytes;
    largest = std::max(largest, bytes);
  }
  for (const auto& b : encoder.buffers()) sizes.parameter_bytes += static_cast<int64_t>(b.nbytes());
  sizes.min_input_size = 1;
  return with_head(sizes, spec, feature_dim, largest);
}

Linear Linear::through(double n1, double y1, double n2, double y2) {
  TORCH_CHECK(n1 != n2, "a line needs two different frame counts; got ", n1, " twice");
  Linear line;
  line.slope = (y2 - y1) / (n2 - n1);
  line.intercept = y1 - line.slope * n1;
  return line;
}

namespace {

// Memory at one moment of the step, by kind.
struct Moment {
  std::string phase;
  int64_t features = 0;
  double activations = 0;
  double workspace = 0;
  int64_t extra_gradients = 0;
  int64_t extra_workspace = 0;
};

// Splits a linear cost into its per-frame part (activations) and constant part (workspace).
void add(Moment& m, const Linear& cost, int64_t frames, double sign = 1) {
  m.activations += sign * cost.slope * static_cast<double>(frames);
  m.workspace += sign * cost.intercept;
}

}  // namespace

ChunkSeconds ChunkCosts::seconds_at(int64_t n) const {
  const bool measured = one_frame.nograd > 0 || one_frame.grad > 0;
  if (n == 1 && measured) return one_frame;
  const auto x = static_cast<double>(n);
  return {nograd_seconds.at(x), grad_seconds.at(x), backward_seconds.at(x), frozen_seconds.at(x)};
}

namespace {
Breakdown predict_one_length(const StaticSizes& sizes, const ChunkCosts& costs,
                             const StepSettings& s) {
  TORCH_CHECK(s.frames >= 1 && s.videos_per_call >= 1 && s.chunk >= 0 && s.keep >= 0,
              "predict: frames and videos per call must be >= 1, chunk and keep >= 0");
  const int64_t T = s.frames;
  const int64_t features = T * sizes.feature_bytes;
  const bool cache = s.cache_frozen && sizes.frozen_stages > 0;
  std::vector<Moment> moments;
  Breakdown result;
  double seconds = 0;

  if (s.naive()) {
    Moment encode{"encode"};
    add(encode, costs.grad_peak, T);
    moments.push_back(encode);
    Moment head{"head"};
    add(head, costs.saved, T);
    add(head, costs.head_peak, T);
    // Under autocast the encoder's low-precision output is cast to float32 features.
    if (s.precision != engine::Precision::FP32) head.features += features;
    moments.push_back(head);
    Moment backward{"recompute"};  // the encoder's backward; no recomputation in naive training
    backward.features = features;  // the features' gradient
    add(backward, costs.accumulate_peak, T);
    moments.push_back(backward);
    const auto pass = costs.seconds_at(T);
    seconds = pass.grad + pass.backward;
  } else {
    std::vector<int64_t> chunk_frames;
    for (int64_t begin = 0; begin < T; begin += s.chunk) {
      chunk_frames.push_back(std::min(T, begin + s.chunk) - begin);
    }
    const size_t n = chunk_frames.size();
    const size_t first_kept = n - std::min<size_t>(static_cast<size_t>(s.keep), n);
    Moment cached{"encode"};      // frozen outputs cached so far
    Moment kept_saved{"encode"};  // graphs of kept chunks so far
    for (size_t i = 0; i < n; ++i) {
      Moment m{"encode"};
      m.features = features;
      m.activations = cached.activations + kept_saved.activations;
      m.workspace = cached.workspace + kept_saved.workspace;
      const auto pass = costs.seconds_at(chunk_frames[i]);
      if (i < first_kept) {
        add(m, costs.nograd_peak, chunk_frames[i]);
        seconds += pass.nograd;
      } else {
        add(m, costs.grad_peak, chunk_frames[i]);
        add(kept_saved, costs.saved, chunk_frames[i]);
        seconds += pass.grad + pass.backward;
      }
      moments.push_back(m);
      if (cache) add(cached, costs.frozen_output, chunk_frames[i]);
    }
    Moment head{"head"};
    head.features = features;
    head.activations = cached.activations + kept_saved.activations;
    head.workspace = cached.workspace + kept_saved.workspace;
    add(head, costs.head_peak, T);
    moments.push_back(head);

    // Backward, last chunk first: kept chunks differentiate their saved graph, the others are
    // recomputed with grad. After the first chunk the summed parameter gradients stay allocated.
    Moment remaining = kept_saved;  // kept graphs not yet differentiated, frozen cache left
    remaining.activations += cached.activations;
    remaining.workspace += cached.workspace;
    for (size_t i = n; i-- > 0;) {
      Moment m{"recompute"};
      m.features = 2 * features;  // the features and their gradient
      m.extra_gradients = i + 1 < n ? sizes.trained_encoder_bytes : 0;
      m.activations = remaining.activations;
      m.workspace = remaining.workspace;
      if (i >= first_kept) {
        add(m, costs.saved, chunk_frames[i], -1);  // counted in backward_peak
        add(m, costs.backward_peak, chunk_frames[i]);
        add(remaining, costs.saved, chunk_frames[i], -1);
      } else {
        const auto& bigger =
            costs.backward_peak.at(chunk_frames[i]) >= costs.grad_peak.at(chunk_frames[i])
                ? costs.backward_peak
                : costs.grad_peak;
        add(m, bigger, chunk_frames[i]);
        // An encoder with nothing to train has no backward to recompute for; otherwise the
        // recompute less the cached frozen stages, which measured lines must not make negative
        // (an all-frozen encoder's noise once made every extra chunk "save" time).
        if (sizes.trained_encoder_bytes > 0) {
          const auto pass = costs.seconds_at(chunk_frames[i]);
          seconds += std::max(0.0, pass.grad + pass.backward - (cache ? pass.frozen : 0.0));
        }
      }
      if (cache) {
        // A cached chunk's frozen output is read, then released.
        add(m, costs.frozen_output, chunk_frames[i], -1);
        add(remaining, costs.frozen_output, chunk_frames[i], -1);
      }
      moments.push_back(m);
    }
  }
  seconds += costs.head_seconds.at(T);

  Moment optimizer{"optimizer"};
  // Adam's update makes two temporaries the size of the parameter it updates.
  optimizer.extra_workspace = 2 * sizes.largest_trained_bytes;
  moments.push_back(optimizer);

  const int64_t frames_in = s.videos_per_call * T * sizes.resident_bytes_per_frame();
  for (const auto& m : moments) {
    const int64_t activations = std::max<int64_t>(0, std::llround(m.activations));
    const int64_t workspace =
        std::max<int64_t>(0, std::llround(m.workspace)) + m.extra_workspace + sizes.library_bytes;
    const int64_t total = sizes.parameter_bytes + sizes.trained_bytes() + m.extra_gradients +
                          sizes.optimizer_state_bytes + frames_in + m.features + activations +
                          workspace;
    auto& phase_peak = result.phase_peaks[m.phase];
    phase_peak = std::max(phase_peak, total);
    if (total > result.peak_bytes) {
      result.peak_bytes = total;
      result.peak_phase = m.phase;
      result.parameters = sizes.parameter_bytes;
      result.gradients = sizes.trained_bytes() + m.extra_gradients;
      result.gradient_sums = m.extra_gradients;
      result.optimizer_state = sizes.optimizer_state_bytes;
      result.input_frames = frames_in;
      result.features = m.features;
      result.activations = activations;
      result.workspace = workspace;
    }
  }
  result.seconds = std::max(0.0, seconds) * static_cast<double>(s.videos_per_call);
  return result;
}
}  // namespace

Breakdown predict(const StaticSizes& sizes, const ChunkCosts& costs, const StepSettings& s) {
  auto longest = predict_one_length(sizes, costs, s);
  if (!s.shorter_videos || s.naive() || s.frames % s.chunk == 0) return longest;
  // Every term grows with the length but the kept chunks' frames, which are most where the last
  // chunk is whole: of the shorter lengths, the longest such one has the largest peak.
  auto whole_chunks = s;
  whole_chunks.frames = s.frames / s.chunk * s.chunk;
  auto shorter = predict_one_length(sizes, costs, whole_chunks);
  if (shorter.peak_bytes <= longest.peak_bytes) return longest;
  shorter.seconds = longest.seconds;
  return shorter;
}

int64_t NetworkMemory::largest_batch(int64_t budget_bytes) const {
  const int64_t per_sample = bytes_per_sample();
  if (budget_bytes < static_bytes() + per_sample || per_sample <= 0) return 0;
  return (budget_bytes - static_bytes()) / per_sample;
}

NetworkMemory network_memory(const models::NetworkShapes& shapes, const std::vector<int64_t>& input,
                             const NetworkTraining& training) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(training.dtype));
  NetworkMemory m;
  m.parameter_bytes = (shapes.parameters() + shapes.buffers()) * element;
  m.gradient_bytes = shapes.parameters() * element;
  m.optimizer_state_bytes = (training.optimizer == "sgd" ? 1 : 2) * m.gradient_bytes;
  int64_t input_elements = 1;
  for (int64_t d : input) input_elements *= d;
  m.input_bytes_per_sample = input_elements * training.input_element_bytes;
  // The converted input is kept by the first layer; the rest is what each layer saves. Backward
  // runs last layer first: when it reaches a layer, what that layer and the earlier ones saved
  // is still held, beside the gradients the layer's backward holds.
  int64_t saved = 0, peak = 0;
  for (const auto& l : shapes.layers) {
    saved += l.saved_elements * element + l.saved_index_bytes;
    peak = std::max(peak, saved + l.backward_elements * element);
  }
  m.activation_bytes_per_sample = saved;
  m.backward_bytes_per_sample = std::max<int64_t>(0, peak - saved);
  return m;
}

}  // namespace framefit::plan
