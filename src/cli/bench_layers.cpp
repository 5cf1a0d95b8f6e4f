// framefit bench-layers: training steps of batch networks (clip classifiers, video ResNets,
// UNets) with and without layer checkpointing, and the largest batch a budget allows.
#include <fmt/core.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "commands.h"
#include "framefit/core/runtime.h"
#include "framefit/engine/amp.h"
#include "framefit/engine/checkpoint.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/network.h"
#include "framefit/models/norm_relu_conv.h"
#include "framefit/models/resnet.h"
#include "framefit/models/unet.h"
#include "framefit/models/video_resnet.h"
#include "framefit/plan/calibration.h"
#include "framefit/plan/planner.h"

namespace framefit::cli {

namespace {

std::vector<int64_t> parse_shape(const std::string& text) {
  std::vector<int64_t> shape;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    try {
      shape.push_back(std::stoll(item, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used > 0 && used == item.size(), "--input ", text,
                ": expected sizes separated by commas, e.g. 3,60,230,230");
    TORCH_CHECK(shape.back() > 0, "--input ", text, ": sizes must be positive");
  }
  return shape;
}

// The benchmarked network and whether its labels are per pixel.
struct LayerNet {
  engine::ChainNetwork chain;
  bool dense = false;
  int64_t time_slices = 0;  // as run (0 for networks it does not apply to)
};

LayerNet build_net(const Args& args, const std::vector<int64_t>& input) {
  const auto name = args.text("net");
  const int64_t classes = args.integer("classes");
  LayerNet net;
  if (name == "unet") {
    TORCH_CHECK(input.size() == 3, "--net unet takes --input C,H,W");
    net.chain = engine::chain_network(models::UNet(models::UNetOptions()
                                                       .in_channels(input[0])
                                                       .classes(classes)
                                                       .width(args.integer("width"))
                                                       .depth(args.integer("depth")))
                                          .ptr());
    net.dense = true;
  } else if (name == "resnet18" || name == "resnet50") {
    TORCH_CHECK(input.size() == 3 && input[0] == 3, "--net ", name, " takes --input 3,H,W");
    net.chain = engine::chain_network(
        models::ResNet(models::ResNetOptions(models::parse_resnet_name(name)).num_classes(classes))
            .ptr());
  } else if (name == "r3d_18" || name == "r2plus1d_18") {
    TORCH_CHECK(input.size() == 4 && input[0] == 3, "--net ", name, " takes --input 3,T,H,W");
    models::VideoResNet model(models::VideoResNetOptions(name).num_classes(classes).lean_backward(
        !args.on("onednn-backward")));
    if (args.on("onednn-backward")) models::set_split_backward(*model, false);
    net.chain = engine::chain_network(model.ptr());
  } else {
    net.chain = engine::chain_network(
        models::Network(models::NetworkOptions(
                            models::clip3d_layers(classes, name == "clip3d_separable"), input)
                            .lean_pooling(!args.on("plain-pooling")))
            .ptr());
  }
  const auto recompute_norm = args.text("recompute-norm");
  models::set_recompute_norm(
      *net.chain.module,
      recompute_norm == "on" || (recompute_norm == "auto" && args.text("checkpoint") != "off"));
  const auto slices = args.text("time-slices");
  const bool sliced = slices == "on" || (slices == "auto" && args.text("checkpoint") != "off");
  if (models::set_time_slices(*net.chain.module, sliced ? models::kTimeSlices : 0) > 0 && sliced) {
    net.time_slices = models::kTimeSlices;
  }
  return net;
}

struct StepResult {
  bool fits = true;
  int64_t peak_bytes = 0;  // tracked, every tensor
  double seconds = 0;
  std::string error;
};

class Bench {
 public:
  Bench(const Args& args)
      : args_(args),
        device_(args.text("device")),
        precision_(engine::parse_precision(args.text("precision"))),
        input_(parse_shape(args.text("input"))),
        net_(build_net(args, input_)),
        tracker_(memory::Tracker::of(device_)) {
    net_.chain.module->to(device_);
    net_.chain.module->train();
    optimizer_ = std::make_unique<torch::optim::Adam>(net_.chain.module->parameters(),
                                                      torch::optim::AdamOptions(1e-4));
  }

  // One training step (forward, cross-entropy, backward, Adam) under the budget.
  StepResult step(int64_t batch, const std::vector<engine::ChainSegment>& segments,
                  int repeat = 1) {
    StepResult result;
    std::vector<double> times;
    tracker_.set_budget(args_.bytes("budget"));
    try {
      for (int r = 0; r < repeat; ++r) {
        tracker_.reset_peak();
        const auto start = std::chrono::steady_clock::now();
        auto [x, labels] = batch_of(batch);
        optimizer_->zero_grad();
        torch::Tensor loss;
        {
          engine::AutocastGuard autocast(device_, precision_);
          auto out = net_.chain.forward(x, segments);
          loss = torch::nn::functional::cross_entropy(out.to(torch::kFloat32), labels);
        }
        loss.backward();
        optimizer_->step();
        if (device_.is_cuda()) torch::cuda::synchronize();
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        result.peak_bytes = std::max(result.peak_bytes, tracker_.peak_bytes());
      }
    } catch (const c10::Error& e) {
      // framefit's budget error, CUDA's, or either passed on by the autograd engine.
      if (!memory::is_out_of_memory(e)) throw;
      result.fits = false;
      result.error = e.what_without_backtrace();
    }
    tracker_.set_budget(0);
    if (!times.empty()) {
      std::sort(times.begin(), times.end());
      result.seconds = times[times.size() / 2];
    }
    return result;
  }

  // Static memory after a first step (parameters, gradients, Adam state), and stage costs
  // calibrated on the way to the budget.
  plan::BatchCosts costs() {
    step(1, engine::store_all(net_.chain.stage_count()));
    auto [x, labels] = batch_of(1);
    return plan::calibrate_batch(
        net_.chain, [&](int64_t batch) { return batch_of(batch).first; }, tracker_.current_bytes(),
        static_cast<int64_t>(x.nbytes() + labels.nbytes()), args_.bytes("budget"), tracker_,
        precision_);
  }

  int64_t stage_count() const { return net_.chain.stage_count(); }
  int64_t time_slices() const { return net_.time_slices; }
  const std::vector<int64_t>& input() const { return input_; }

 private:
  std::pair<torch::Tensor, torch::Tensor> batch_of(int64_t batch) {
    std::vector<int64_t> shape = {batch};
    shape.insert(shape.end(), input_.begin(), input_.end());
    auto x = torch::randn(shape, torch::TensorOptions().device(device_));
    std::vector<int64_t> label_shape = {batch};
    if (net_.dense) label_shape.insert(label_shape.end(), input_.begin() + 1, input_.end());
    auto labels = torch::randint(0, args_.integer("classes"), label_shape,
                                 torch::TensorOptions().dtype(torch::kLong).device(device_));
    return {x, labels};
  }

  const Args& args_;
  torch::Device device_;
  engine::Precision precision_;
  std::vector<int64_t> input_;
  LayerNet net_;
  memory::Tracker& tracker_;
  std::unique_ptr<torch::optim::Adam> optimizer_;
};

// [begin, end) of the segments recomputed, or of those among them that are nested.
nlohmann::json segments_json(const std::vector<engine::ChainSegment>& segments, bool nested) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : segments) {
    if (s.recompute && (!nested || s.nested)) out.push_back({s.begin, s.end});
  }
  return out;
}

bool result_fits(const nlohmann::json& out) { return out.value("fits", true); }

}  // namespace

int run_bench_layers(const Args& args) {
  torch::manual_seed(static_cast<uint64_t>(args.integer("seed")));
  Bench bench(args);
  const auto mode = args.text("checkpoint");  // off | auto | all
  const auto recompute = plan::parse_recompute(mode);
  const int64_t budget = args.bytes("budget");
  TORCH_CHECK(mode != "auto" || budget > 0, "--checkpoint auto plans for a budget: give --budget");
  // Plans leave the allocator's margin of a CUDA budget; the steps run under all of it.
  const int64_t plan_budget =
      budget - plan::allocator_margin_bytes(budget, torch::Device(args.text("device")));
  const int64_t n = bench.stage_count();
  const auto costs = bench.costs();
  nlohmann::json out = {{"net", args.text("net")},
                        {"input", bench.input()},
                        {"precision", args.text("precision")},
                        {"checkpoint", mode},
                        {"budget_bytes", budget},
                        {"plan_budget_bytes", plan_budget},
                        {"stages", n},
                        {"time_slices", bench.time_slices()},
                        {"static_bytes", costs.static_bytes},
                        {"library_bytes", costs.library_bytes},
                        {"machine", machine_info().describe()}};
  int64_t batch = args.integer("batch");
  int64_t predicted = 0;
  // What the mode recomputes at a batch: nothing, what the budget needs, or every stage.
  const auto plan_for = [&](int64_t b) {
    return plan::plan_batch_chain(costs, b, plan_budget, recompute).segments;
  };
  if (batch == 0) {
    // The largest batch: the planner's answer, then checked by real steps under the budget.
    TORCH_CHECK(budget > 0, "--batch 0 finds the largest batch for --budget: give one");
    const auto planned = plan::plan_batch(costs, plan_budget, recompute);
    out["planned_batch"] = planned.batch;
    if (planned.batch == 0) {
      out["fits"] = false;
      out["minimum_bytes"] = planned.minimum_bytes_one_sample;
      fmt::print("{}\n", out.dump());
      return 2;
    }
    batch = planned.batch;
    nlohmann::json tries = nlohmann::json::array();
    auto run = [&](int64_t b) {
      auto r = bench.step(b, plan_for(b));
      tries.push_back({{"batch", b}, {"fits", r.fits}, {"peak_bytes", r.peak_bytes}});
      return r;
    };
    auto result = run(batch);
    if (!result.fits) {  // the largest that runs lies below: bisection
      int64_t low = 0, high = batch;
      while (high - low > 1) {
        const int64_t mid = (low + high) / 2;
        auto r = run(mid);
        if (r.fits) {
          low = mid;
          result = r;
        } else {
          high = mid;
        }
      }
      batch = low;
    } else {
      for (int up = 0; up < 3; ++up) {  // the planner may be conservative
        if (!run(batch + 1).fits) break;
        ++batch;
      }
    }
    out["tries"] = tries;
    out["largest_batch"] = batch;
  }
  std::vector<engine::ChainSegment> segments;  // what the measured steps recompute
  if (batch > 0) {
    segments = plan_for(batch);
    predicted =
        plan::batch_peak_bytes(costs, batch, plan::evaluate_chain(costs.at(batch), segments));
    bench.step(batch, segments);  // untimed: kernels for this batch's shapes are set up once
    memory::reset_rss_peak();
    const auto result = bench.step(batch, segments, static_cast<int>(args.integer("repeat")));
    const auto rss = memory::process_memory();
    out["batch"] = batch;
    // Whether the plan fits by the model: a step that ran out of memory with a plan that did not
    // is the budget being too small, one with a plan that did is the model being wrong.
    out["plan_fits"] = budget <= 0 || predicted <= plan_budget;
    out["fits"] = result.fits;
    out["recomputed"] = segments_json(segments, false);
    out["nested"] = segments_json(segments, true);
    out["predicted_peak_bytes"] = predicted;
    out["peak_bytes"] = result.peak_bytes;
    out["activation_bytes"] = result.peak_bytes - costs.static_bytes - costs.library_bytes;
    out["rss_peak_bytes"] = rss.rss_peak_bytes;
    out["step_seconds"] = result.seconds;
    out["samples_per_second"] = result.seconds > 0 ? batch / result.seconds : 0.0;
    if (!result.fits) out["error"] = result.error;
  }
  if (args.on("json")) {
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print("framefit bench-layers: {} on {} per sample, {}, checkpointing {}{}\n",
               args.text("net"), models::format_shape(bench.input()), args.text("precision"), mode,
               bench.time_slices() > 0 ? fmt::format(", {} time slices", bench.time_slices())
                                       : std::string());
    if (out.contains("largest_batch")) {
      fmt::print("  budget {}: planner's batch {}, largest batch that ran {}\n",
                 memory::format_bytes(budget), out["planned_batch"].get<int64_t>(),
                 out["largest_batch"].get<int64_t>());
    }
    if (out.contains("peak_bytes")) {
      const auto flags = engine::recomputed(segments);
      const auto recomputed_stages = std::count(flags.begin(), flags.end(), true);
      fmt::print(
          "  batch {}: peak {} tracked (predicted {}), RSS {}, {:.3f} s per step, {} of {} "
          "stages recomputed\n",
          batch, memory::format_bytes(out["peak_bytes"].get<int64_t>()),
          memory::format_bytes(predicted),
          memory::format_bytes(out["rss_peak_bytes"].get<int64_t>()),
          out["step_seconds"].get<double>(), recomputed_stages, n);
      if (!out["plan_fits"].get<bool>()) {
        fmt::print("  no plan fits {} (the least predicted peak at batch {}): run anyway\n",
                   memory::format_bytes(plan_budget), batch);
      }
      if (!result_fits(out)) fmt::print("  out of memory: {}\n", out.value("error", ""));
    }
    fmt::print("  {}\n", machine_info().describe());
  }
  return result_fits(out) ? 0 : 2;
}

}  // namespace framefit::cli
