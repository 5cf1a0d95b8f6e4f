// The doctor's checks of a task's config, nothing trained or allocated: the label and train.*
// settings of every task, and a clips or segmentation config's network and data.
#include <torch/torch.h>

#include "../run_files.h"
#include "batch_data.h"
#include "framefit/models/torchscript.h"
#include "framefit/models/unet.h"
#include "framefit/models/video_resnet.h"
#include "framefit/train/tasks.h"
#include "plans.h"

namespace framefit::train {

using namespace detail;

std::vector<plan::Finding> diagnose_batch_task(const Config& config, int64_t budget_bytes,
                                               int64_t* static_bytes) {
  using Severity = plan::Finding::Severity;
  auto findings = diagnose_task_settings(config);
  auto add = [&](Severity severity, std::string problem, std::string fix) {
    findings.push_back({severity, std::move(problem), std::move(fix)});
  };
  TORCH_CHECK(is_batch_task(config), "diagnose_batch_task is for task clips or segmentation");
  const auto kind = network_kind(config);
  const bool clips = config.task == "clips";
  const int64_t classes = static_cast<int64_t>(config.data.classes.size());
  if (classes < 2) {
    add(Severity::Error, "data.classes lists " + std::to_string(classes) + " classes",
        "list at least two class names in label order");
  }
  int64_t parameters = 0, parameter_bytes = 0, buffer_bytes = 0;
  const int64_t side = config.data.crop > 0 ? config.data.crop : config.data.resize;
  if (kind == "r3d_18" || kind == "r2plus1d_18") {
    if (!clips) {
      add(Severity::Error, "model.network " + kind + " classifies clips, not pixels",
          "use task clips, or model.network unet for segmentation");
    }
    const auto size =
        models::video_resnet_size(models::VideoResNetOptions(kind).num_classes(classes));
    parameters = size.parameters;
    buffer_bytes = 4 * size.buffer_elements + 8 * size.buffer_counters;
    if (side > 0 && side < size.min_input_size) {
      add(Severity::Error,
          c10::str("frames of ", side, " pixels are smaller than ", kind, "'s spatial stride of ",
                   size.min_input_size),
          c10::str("set data.resize / data.crop to at least ", size.min_input_size));
    }
  } else if (kind == "unet") {
    if (clips) {
      add(Severity::Error, "model.network unet segments images, it does not classify clips",
          "use task segmentation, or model.network r3d_18 for clips");
    }
    const auto size =
        models::unet_size(models::UNetOptions()
                              .classes(std::max<int64_t>(classes, 1))
                              .width(config.model.width)
                              .depth(config.model.depth)
                              .norm(models::parse_norm_kind(config.model.norm))
                              .groups(std::min(config.model.groups, config.model.width))
                              .bilinear(config.model.bilinear));
    parameters = size.parameters;
    buffer_bytes = 4 * size.buffer_elements + 8 * size.buffer_counters;
    if (config.data.resize == 0) {
      add(Severity::Warning, "data.resize is 0: images keep their own size",
          c10::str("every image's height and width must be a multiple of ", size.size_multiple,
                   " (2^model.depth); set data.resize to one"));
    } else if (config.data.resize % size.size_multiple != 0) {
      add(Severity::Error,
          c10::str("data.resize ", config.data.resize, " is not a multiple of ", size.size_multiple,
                   ": a UNet of depth ", config.model.depth, " halves the image ",
                   config.model.depth, " times"),
          c10::str("set data.resize to ",
                   (config.data.resize / size.size_multiple + 1) * size.size_multiple,
                   " or lower model.depth"));
    }
  } else if (kind == "torchscript") {
    // Its tensors as the file holds them, read into host memory: nothing runs, nothing is
    // allocated on the device.
    try {
      const models::TorchScriptEncoder script(config.model.script, torch::kCPU);
      for (const auto& p : script->parameters()) {
        parameters += p.numel();
        parameter_bytes += static_cast<int64_t>(p.nbytes());
      }
      for (const auto& b : script->buffers()) buffer_bytes += static_cast<int64_t>(b.nbytes());
    } catch (const c10::Error& e) {
      add(Severity::Error, e.what_without_backtrace(),
          "set model.script to a module saved with torch.jit.save");
      return findings;
    }
  } else {
    add(Severity::Warning, "model.network " + kind + ": no static sizes without building it",
        "set model.input and run framefit doctor --config for the layer list");
    return findings;
  }
  if (parameter_bytes == 0) parameter_bytes = 4 * parameters;  // framefit's networks: float32
  const int64_t copies = 1 + 1 + (config.train.optimizer == "sgd" ? 1 : 2);
  const int64_t bytes = parameter_bytes * copies + buffer_bytes;
  if (static_bytes) *static_bytes = bytes;
  if (budget_bytes > 0 && bytes >= budget_bytes) {
    add(Severity::Error,
        c10::str(kind, " has ", models::format_count(parameters),
                 " parameters: with gradients and ", config.train.optimizer, " state they take ",
                 memory::format_bytes(bytes), ", not less than train.budget ",
                 memory::format_bytes(budget_bytes)),
        "raise train.budget, or use sgd or a smaller network");
  }
  return findings;
}

std::vector<plan::Finding> diagnose_batch_data(const Config& config, std::string* summary) {
  TORCH_CHECK(is_batch_task(config), "diagnose_batch_data is for task clips or segmentation");
  std::vector<plan::Finding> findings;
  const auto error = [&](const std::string& problem, const std::string& fix) {
    add_error_once(findings, problem, fix);
  };
  const std::string fix_file =
      "fix or replace the file, or set data.on_error: skip to train without it";
  // Every bad video named, not only the first: probed as training probes, skipping.
  auto probing = config;
  probing.data.on_error = "skip";
  const bool images = config.task == "segmentation";
  std::vector<std::string> described;
  for (const auto& split : distinct_splits(config)) {
    try {
      const auto set = batch_data(probing, split, false, skipped_as_errors(findings, fix_file));
      if (split == config.data.train_split && set->samples() == 0) {
        error(set->no_samples(split),
              "set data.train_split to a split with data, or add training data to it");
      }
      // Images and masks are read whole, as training reads them: a corrupt image, a mask of
      // another size or an id outside the classes would otherwise stop a run part way.
      for (int64_t unit = 0; images && unit < set->units(); ++unit) {
        try {
          set->load(unit, 0, 0);
        } catch (const c10::Error& e) {
          error(e.what_without_backtrace(), fix_file);
        }
      }
      if (set->units() > 0) described.push_back(c10::str(split, " ", set->describe()));
    } catch (const c10::Error& e) {
      error(e.what_without_backtrace(), "fix the config or the data");
    }
  }
  if (summary) {
    *summary = "data: ";
    for (size_t i = 0; i < described.size(); ++i) *summary += (i ? ", " : "") + described[i];
    if (described.empty()) *summary += "none";
    if (images) *summary += " (every image and mask read)";
  }
  return findings;
}

std::vector<plan::Finding> diagnose_label_settings(const Config& config) {
  std::vector<plan::Finding> findings;
  const int64_t ignore = config.data.ignore_id;
  if (ignore >= 0 && config.task != "segmentation") {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("data.ignore_id ", ignore, " leaves mask pixels out; task ",
                                 config.task, " has no masks"),
                        "set data.ignore_id to -1"});
  } else if (ignore >= 0 && ignore < static_cast<int64_t>(config.data.classes.size())) {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("data.ignore_id ", ignore, " is the id of class '",
                                 config.data.classes[static_cast<size_t>(ignore)],
                                 "': its pixels would never be learnt"),
                        c10::str("use an id of no class (at least ", config.data.classes.size(),
                                 ", e.g. 255) or -1 for none")});
  }
  const auto& values = config.data.mask_values;
  if (!values.empty() && config.task != "segmentation") {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("data.mask_values maps mask values to classes; task ", config.task,
                                 " has no masks"),
                        "remove data.mask_values"});
  } else if (!values.empty() && values.size() != config.data.classes.size()) {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("data.mask_values lists ", values.size(), " values for ",
                                 config.data.classes.size(), " classes"),
                        "give one value (or colour) per class of data.classes, in its order"});
  } else if (!values.empty() && values.front().size() == 3 && ignore >= 0) {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("data.ignore_id ", ignore,
                                 " is a mask value, but data.mask_values lists colours: no pixel "
                                 "can have it"),
                        "set data.ignore_id to -1, or map the masks to gray ids"});
  }
  if (config.model.encoder == "features" && config.task != "phases") {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("model.encoder features trains a temporal head on per-frame "
                                 "features; task ",
                                 config.task, " trains model.network on pixels"),
                        "use model.encoder features with task phases"});
  }
  const std::string best_by = config.train.best_by.value_or("auto");
  if (config.task != "phases" && (best_by == "edit" || best_by.rfind("f1@", 0) == 0)) {
    findings.push_back(
        {plan::Finding::Severity::Error,
         c10::str("train.best_by ", best_by, " scores segments of frame sequences; task ",
                  config.task, " has none"),
         "choose accuracy, macro_f1, macro_jaccard or auto"});
  }
  const auto& tools = config.data.tools;
  if (best_by == "tool_map" && tools.empty()) {
    findings.push_back({plan::Finding::Severity::Error,
                        "train.best_by tool_map scores tool presence, which nothing learns",
                        "list the tools in data.tools, or choose another metric"});
  }
  if (!tools.empty() && config.task != "phases") {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("data.tools learns tool presence per video frame; task ",
                                 config.task, " has no frame sequences"),
                        "remove data.tools"});
  }
  for (size_t i = 0; i < tools.size(); ++i) {
    if (std::find(tools.begin(), tools.begin() + i, tools[i]) != tools.begin() + i) {
      findings.push_back({plan::Finding::Severity::Error,
                          c10::str("data.tools names '", tools[i], "' twice"),
                          "name each tool once"});
    }
  }
  const auto& classes = config.data.classes;
  for (const auto& name : config.data.background) {
    if (config.task != "phases") {
      findings.push_back({plan::Finding::Severity::Error,
                          c10::str("data.background leaves classes out of segmental metrics; task ",
                                   config.task, " has no frame sequences"),
                          "remove data.background"});
      break;
    }
    if (std::find(classes.begin(), classes.end(), name) == classes.end()) {
      findings.push_back({plan::Finding::Severity::Error,
                          c10::str("data.background names '", name, "', which is not a class"),
                          c10::str("name classes of data.classes: ", c10::Join(", ", classes))});
    }
  }
  return findings;
}

std::vector<plan::Finding> diagnose_task_settings(const Config& config) {
  std::vector<plan::Finding> findings;
  if (is_batch_task(config) && config.train.smoothing != 0) {
    findings.push_back({plan::Finding::Severity::Error,
                        c10::str("train.smoothing ", config.train.smoothing,
                                 " is MS-TCN's smoothing between consecutive frames, for task "
                                 "phases; task ",
                                 config.task, " has no frame sequence to smooth"),
                        "set train.smoothing to 0"});
  }
  const auto masks = diagnose_label_settings(config);
  findings.insert(findings.end(), masks.begin(), masks.end());
  if (config.train.eval_batch == int64_t{0}) {
    findings.push_back({plan::Finding::Severity::Error,
                        "train.eval_batch 0: evaluation needs at least one sample per batch",
                        "set train.eval_batch to auto or a count of at least 1"});
  }
  return findings;
}

}  // namespace framefit::train
