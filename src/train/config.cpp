#include "framefit/train/config.h"

#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <map>
#include <sstream>
#include <type_traits>

#include "framefit/core/runtime.h"
#include "framefit/memory/tracker.h"
#include "framefit/plan/planner.h"

namespace framefit::train {

namespace {

struct Entry {
  ConfigKey key;
  std::function<void(Config&, const YAML::Node&, const std::string&)> set;
  std::function<YAML::Node(const Config&)> get;
};

template <class T>
T convert(const YAML::Node& node, const std::string& where, const char* expected) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (node.IsNull()) return "";  // `freeze:` with no value, as `--set model.freeze=`
  }
  TORCH_CHECK(node.IsScalar(), where, ": expected ", expected, ", got a ",
              node.IsSequence() ? "list"
              : node.IsMap()    ? "mapping"
                                : "null");
  T value{};
  try {
    value = node.as<T>();
  } catch (const YAML::Exception&) {
    TORCH_CHECK(false, where, ": expected ", expected, ", got \"", node.Scalar(), "\"");
  }
  if constexpr (std::is_floating_point_v<T>) {
    // YAML's .inf and .nan are numbers to yaml-cpp; no setting here means anything by them.
    TORCH_CHECK(std::isfinite(value), where, ": expected a finite number, got ", node.Scalar());
  }
  return value;
}

template <class T>
Entry field(std::string name, std::string help, T& (*member)(Config&), const char* expected,
            std::function<void(const T&, const std::string&)> check = {}) {
  Entry e;
  e.key = {std::move(name), std::move(help)};
  e.set = [member, expected, check](Config& c, const YAML::Node& n, const std::string& where) {
    T value = convert<T>(n, where, expected);
    if (check) check(value, where);
    member(c) = value;
  };
  e.get = [member](const Config& c) { return YAML::Node(member(const_cast<Config&>(c))); };
  return e;
}

// A list of names, e.g. [Preparation, Dissection].
Entry names(std::string name, std::string help, std::vector<std::string>& (*member)(Config&)) {
  Entry e;
  e.key = {std::move(name), std::move(help)};
  e.set = [member](Config& c, const YAML::Node& n, const std::string& where) {
    TORCH_CHECK(n.IsSequence(), where, ": expected a list of class names, e.g. [a, b]");
    std::vector<std::string> values;
    for (const auto& item : n) {
      values.push_back(convert<std::string>(item, where, "a name"));
      TORCH_CHECK(std::count(values.begin(), values.end(), values.back()) == 1, where, ": \"",
                  values.back(), "\" appears twice");
    }
    member(c) = std::move(values);
  };
  e.get = [member](const Config& c) {
    YAML::Node n(YAML::NodeType::Sequence);
    for (const auto& value : member(const_cast<Config&>(c))) n.push_back(value);
    return n;
  };
  return e;
}

// A file or folder: a leading ~ (alone or before /) is the home folder, as a shell expands it.
Entry path(std::string name, std::string help, std::string& (*member)(Config&)) {
  Entry e = field<std::string>(std::move(name), std::move(help), member, "a path");
  e.set = [set = e.set, member](Config& c, const YAML::Node& n, const std::string& where) {
    set(c, n, where);
    std::string& value = member(c);
    if (value == "~" || value.rfind("~/", 0) == 0) {
      const char* home = std::getenv("HOME");
      TORCH_CHECK(home != nullptr && *home != '\0', where, ": ", value,
                  " starts with ~ but HOME is not set: give the whole path");
      value = std::string(home) + value.substr(1);
    }
  };
  return e;
}

Entry choice(std::string name, std::string help, std::string& (*member)(Config&),
             std::vector<std::string> choices) {
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : " | ") + c;
  return field<std::string>(std::move(name), help + " (" + list + ")", member, "a string",
                            [choices, list](const std::string& v, const std::string& where) {
                              TORCH_CHECK(
                                  std::find(choices.begin(), choices.end(), v) != choices.end(),
                                  where, ": \"", v, "\" is not one of ", list);
                            });
}

std::function<void(const int64_t&, const std::string&)> at_least(int64_t minimum) {
  return [minimum](const int64_t& v, const std::string& where) {
    TORCH_CHECK(v >= minimum, where, ": must be at least ", minimum, ", got ", v);
  };
}
std::function<void(const double&, const std::string&)> non_negative() {
  return [](const double& v, const std::string& where) {
    TORCH_CHECK(v >= 0, where, ": must not be negative, got ", v);
  };
}
// Within [low, high] (closed) or [low, high) (not closed); `unit` follows the range in the
// message, e.g. " (turns)".
std::function<void(const double&, const std::string&)> within(double low, double high, bool closed,
                                                              std::string unit = "") {
  return [=](const double& v, const std::string& where) {
    TORCH_CHECK(v >= low && (closed ? v <= high : v < high), where, ": must be within [", low, ", ",
                high, closed ? "]" : ")", unit, ", got ", v);
  };
}
std::function<void(const double&, const std::string&)> positive() {
  return [](const double& v, const std::string& where) {
    TORCH_CHECK(v > 0, where, ": must be positive, got ", v);
  };
}
// A setting that is "auto" or a value, held as a std::optional: nullopt is auto. `parse` reads
// the value from its text (checking it), `node` writes it back.
template <class T>
Entry auto_or(std::string name, std::string help, std::optional<T>& (*member)(Config&),
              const char* expected, std::function<T(const std::string&, const std::string&)> parse,
              std::function<YAML::Node(const T&)> node) {
  Entry e;
  e.key = {std::move(name), std::move(help)};
  e.set = [member, expected, parse](Config& c, const YAML::Node& n, const std::string& where) {
    const auto text = convert<std::string>(n, where, expected);
    member(c) = text == "auto" ? std::nullopt : std::optional<T>(parse(text, where));
  };
  e.get = [member, node](const Config& c) {
    const auto& value = member(const_cast<Config&>(c));
    return value ? node(*value) : YAML::Node("auto");
  };
  return e;
}

// One of `names` (each with the value it stands for), held as its value.
template <class T>
Entry named(std::string name, std::string help, T& (*member)(Config&),
            std::vector<std::pair<std::string, T>> names) {
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : " | ") + n.first;
  Entry e;
  e.key = {std::move(name), help + " (" + list + ")"};
  e.set = [member, names, list](Config& c, const YAML::Node& n, const std::string& where) {
    const auto text = convert<std::string>(n, where, "a string");
    const auto found = std::find_if(names.begin(), names.end(),
                                    [&](const auto& entry) { return entry.first == text; });
    TORCH_CHECK(found != names.end(), where, ": \"", text, "\" is not one of ", list);
    member(c) = found->second;
  };
  e.get = [member, names](const Config& c) {
    const auto& value = member(const_cast<Config&>(c));
    for (const auto& n : names) {
      if (n.second == value) return YAML::Node(n.first);
    }
    TORCH_CHECK(false, "a setting holds a value none of its names stands for");
  };
  return e;
}

// auto or a count >= 0.
Entry auto_count(std::string name, std::string help, std::optional<int64_t>& (*member)(Config&)) {
  const auto parse = [](const std::string& v, const std::string& where) -> int64_t {
    char* end = nullptr;
    errno = 0;  // strtoll saturates out-of-range numbers and says so only here
    const long long n = std::strtoll(v.c_str(), &end, 10);
    TORCH_CHECK(!v.empty() && *end == '\0' && n >= 0 && errno != ERANGE, where,
                ": expected auto or a count >= 0, got \"", v, "\"");
    return n;
  };
  return auto_or<int64_t>(std::move(name), std::move(help), member, "auto or a count", parse,
                          [](const int64_t& v) { return YAML::Node(v); });
}

// One of `choices` after auto, read by `parse` (which may assume it is one of them).
template <class T>
Entry auto_choice(std::string name, std::string help, std::optional<T>& (*member)(Config&),
                  std::vector<std::string> choices, std::function<T(const std::string&)> parse,
                  std::function<YAML::Node(const T&)> node) {
  std::string list = "auto";
  for (const auto& c : choices) list += " | " + c;
  return auto_or<T>(
      std::move(name), help + " (" + list + ")", member, "a string",
      [choices, list, parse](const std::string& v, const std::string& where) {
        TORCH_CHECK(std::find(choices.begin(), choices.end(), v) != choices.end(), where, ": \"", v,
                    "\" is not one of ", list);
        return parse(v);
      },
      std::move(node));
}

// auto | true | false.
Entry auto_flag(std::string name, std::string help, std::optional<bool>& (*member)(Config&)) {
  return auto_choice<bool>(
      std::move(name), std::move(help), member, {"true", "false"},
      [](const std::string& v) { return v == "true"; },
      [](const bool& v) { return YAML::Node(v); });
}

Entry bytes(std::string name, std::string help, int64_t& (*member)(Config&)) {
  Entry e;
  e.key = {std::move(name), std::move(help)};
  e.set = [member](Config& c, const YAML::Node& n, const std::string& where) {
    const auto text = convert<std::string>(n, where, "a size such as 1GiB or 512MiB");
    try {
      member(c) = memory::parse_bytes(text);
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, where, ": ", error.what_without_backtrace());
    }
  };
  // In the largest binary unit that holds it exactly (2GiB, 1536MiB), as a user writes it:
  // config.yaml and a resumed run's list of changes read so.
  e.get = [member](const Config& c) {
    int64_t value = member(const_cast<Config&>(c));
    const char* const units[] = {"", "KiB", "MiB", "GiB", "TiB"};
    int unit = 0;
    while (value != 0 && value % 1024 == 0 && unit < 4) value /= 1024, ++unit;
    return YAML::Node(std::to_string(value) + units[unit]);
  };
  return e;
}

// One integer or a list of them ("kernel: 3" or "kernel: [1, 3, 3]").
std::vector<int64_t> int_list(const YAML::Node& n, const std::string& where) {
  std::vector<int64_t> values;
  if (n.IsSequence()) {
    for (const auto& item : n) values.push_back(convert<int64_t>(item, where, "an integer"));
  } else {
    values.push_back(convert<int64_t>(n, where, "an integer or a list of integers"));
  }
  return values;
}

YAML::Node int_list_node(const std::vector<int64_t>& values) {
  YAML::Node n(YAML::NodeType::Sequence);
  for (int64_t v : values) n.push_back(v);
  n.SetStyle(YAML::EmitterStyle::Flow);
  return n;
}

std::vector<models::LayerSpec> parse_layers(const YAML::Node& n, const std::string& where) {
  TORCH_CHECK(n.IsSequence(), where, ": expected a list of layers, e.g. [{type: relu}]");
  std::vector<models::LayerSpec> layers;
  for (size_t i = 0; i < n.size(); ++i) {
    const auto& node = n[i];
    const std::string at = c10::str(where, "[", i, "]");
    TORCH_CHECK(node.IsMap(), at, ": expected a mapping such as {type: conv2d, out: 64}");
    models::LayerSpec l;
    for (const auto& item : node) {
      const auto key = item.first.as<std::string>();
      const std::string field_at = at + "." + key;
      if (key == "type") {
        l.type = convert<std::string>(item.second, field_at, "a layer type");
      } else if (key == "name") {
        l.name = convert<std::string>(item.second, field_at, "a name");
      } else if (key == "in") {
        l.in = convert<int64_t>(item.second, field_at, "an integer");
      } else if (key == "out") {
        l.out = convert<int64_t>(item.second, field_at, "an integer");
      } else if (key == "kernel") {
        l.kernel = int_list(item.second, field_at);
      } else if (key == "stride") {
        l.stride = int_list(item.second, field_at);
      } else if (key == "padding") {
        l.padding = int_list(item.second, field_at);
      } else if (key == "groups") {
        l.groups = convert<int64_t>(item.second, field_at, "an integer");
      } else if (key == "p") {
        l.p = convert<double>(item.second, field_at, "a probability");
      } else if (key == "bias") {
        l.bias = convert<bool>(item.second, field_at, "true or false");
      } else {
        TORCH_CHECK(false, at, ": unknown layer field `", key,
                    "` (known: type, name, in, out, kernel, stride, padding, groups, p, bias)");
      }
    }
    const auto& types = models::layer_types();
    TORCH_CHECK(std::find(types.begin(), types.end(), l.type) != types.end(), at, ": layer type \"",
                l.type, "\" is not one of ", c10::Join(", ", types));
    layers.push_back(std::move(l));
  }
  return layers;
}

YAML::Node layers_node(const std::vector<models::LayerSpec>& layers) {
  YAML::Node n(YAML::NodeType::Sequence);
  const models::LayerSpec defaults;
  for (const auto& l : layers) {
    YAML::Node m;
    m["type"] = l.type;
    if (!l.name.empty()) m["name"] = l.name;
    if (l.in != defaults.in) m["in"] = l.in;
    if (l.out != defaults.out) m["out"] = l.out;
    if (!l.kernel.empty()) m["kernel"] = int_list_node(l.kernel);
    if (!l.stride.empty()) m["stride"] = int_list_node(l.stride);
    if (!l.padding.empty()) m["padding"] = int_list_node(l.padding);
    if (l.groups != defaults.groups) m["groups"] = l.groups;
    if (l.type == "dropout") m["p"] = l.p;
    if (l.bias != defaults.bias) m["bias"] = l.bias;
    m.SetStyle(YAML::EmitterStyle::Flow);
    n.push_back(m);
  }
  return n;
}

#define FRAMEFIT_MEMBER(type, path) +[](Config& c) -> type& { return c.path; }

const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = [] {
    std::vector<Entry> t;
    // model
    t.push_back(choice("model.encoder",
                       "per-frame CNN (torchscript: the module in model.script, mapping "
                       "normalised [N,3,H,W] frames to [N,D] features; features: none, the "
                       "head trains on the manifest's precomputed features files)",
                       FRAMEFIT_MEMBER(std::string, model.encoder),
                       {"resnet18", "resnet34", "resnet50", "torchscript", "features"}));
    t.push_back(field<int64_t>("model.feature_dim",
                               "model.encoder features: features per frame; 0: the training "
                               "data's",
                               FRAMEFIT_MEMBER(int64_t, model.feature_dim), "an integer",
                               at_least(0)));
    t.push_back(choice("model.norm", "normalisation layers of the encoder",
                       FRAMEFIT_MEMBER(std::string, model.norm),
                       {"bn", "frozen_bn", "group_norm"}));
    t.push_back(field<int64_t>("model.groups", "GroupNorm groups",
                               FRAMEFIT_MEMBER(int64_t, model.groups), "an integer", at_least(1)));
    t.push_back(choice("model.freeze", "last frozen encoder stage, empty for none",
                       FRAMEFIT_MEMBER(std::string, model.freeze),
                       {"", "conv1", "layer1", "layer2", "layer3", "layer4"}));
    t.push_back(choice("model.head", "temporal head", FRAMEFIT_MEMBER(std::string, model.head),
                       {"lstm", "tcn", "linear"}));
    t.push_back(field<int64_t>("model.lstm_hidden", "LSTM head: hidden units",
                               FRAMEFIT_MEMBER(int64_t, model.head_settings.lstm_hidden),
                               "an integer", at_least(1)));
    t.push_back(field<int64_t>("model.lstm_layers", "LSTM head: stacked LSTM layers",
                               FRAMEFIT_MEMBER(int64_t, model.head_settings.lstm_layers),
                               "an integer", at_least(1)));
    t.push_back(field<bool>("model.bidirectional",
                            "LSTM head: also read the video backwards (offline: each frame sees "
                            "the frames after it)",
                            FRAMEFIT_MEMBER(bool, model.head_settings.bidirectional),
                            "true or false"));
    t.push_back(field<int64_t>(
        "model.tcn_stages", "TCN head: stages, each refining the one before (MS-TCN: 4)",
        FRAMEFIT_MEMBER(int64_t, model.head_settings.tcn_stages), "an integer", at_least(1)));
    t.push_back(field<int64_t>("model.tcn_layers",
                               "TCN head: dilated residual layers per stage, dilations 1 to "
                               "2^(layers-1) (MS-TCN: 10)",
                               FRAMEFIT_MEMBER(int64_t, model.head_settings.tcn_layers),
                               "an integer", at_least(1)));
    t.push_back(field<int64_t>("model.tcn_channels", "TCN head: channels of each layer",
                               FRAMEFIT_MEMBER(int64_t, model.head_settings.tcn_channels),
                               "an integer", at_least(1)));
    t.push_back(field<bool>("model.causal",
                            "TCN head: only past frames (online recognition, TeCNO); false sees "
                            "both sides (offline, MS-TCN)",
                            FRAMEFIT_MEMBER(bool, model.head_settings.causal), "true or false"));
    t.push_back(path("model.weights", "torchvision state_dict (.pt/.pth) to start the encoder from",
                     FRAMEFIT_MEMBER(std::string, model.weights)));
    t.push_back(field<std::string>(
        "model.weights_prefix",
        "the key prefix of the encoder's weights in model.weights (encoder. for a framefit "
        "export, module. from DistributedDataParallel); empty: found when the keys do not match",
        FRAMEFIT_MEMBER(std::string, model.weights_prefix), "a string"));
    t.push_back(named<models::ActivationLayout>(
        "model.layout",
        "activation layout of the encoder: auto is channels-last with bn or frozen_bn (layer4 in "
        "NCHW on the CPU), NCHW with group_norm",
        FRAMEFIT_MEMBER(models::ActivationLayout, model.layout),
        {{"auto", models::ActivationLayout::Auto},
         {"nchw", models::ActivationLayout::Nchw},
         {"channels_last", models::ActivationLayout::ChannelsLast}}));
    t.push_back(auto_flag(
        "model.recompute_norm",
        "ResNet encoder with bn or frozen_bn: each block's BatchNorm and ReLU between convolutions "
        "recomputed in backward instead of kept (ResNet-18 at 112 px: an eighth less activation "
        "memory per chunk, for an elementwise pass per block); auto: the planner calibrates both "
        "and takes it where only it fits or the larger chunk it allows is predicted 5% faster (off "
        "where chunk, keep and precision are all fixed)",
        FRAMEFIT_MEMBER(std::optional<bool>, model.recompute_norm)));
    {
      Entry e;
      e.key = {"model.layers",
               "a network as a list of layers, e.g. [{type: conv3d, name: conv1, out: 32, "
               "kernel: 3, padding: 1}, {type: relu}, ...] (types: " +
                   c10::Join(", ", models::layer_types()) + ")"};
      e.set = [](Config& c, const YAML::Node& n, const std::string& where) {
        c.model.layers = parse_layers(n, where);
      };
      e.get = [](const Config& c) { return layers_node(c.model.layers); };
      t.push_back(e);
    }
    {
      Entry e;
      e.key = {"model.input", "the network's input per sample: [C,H,W] or [C,T,H,W]"};
      e.set = [](Config& c, const YAML::Node& n, const std::string& where) {
        c.model.input = int_list(n, where);
      };
      e.get = [](const Config& c) { return int_list_node(c.model.input); };
      t.push_back(e);
    }
    t.push_back(choice("model.network",
                       "clips/segmentation network; empty: r3d_18 (layers when model.layers is "
                       "set) for clips, unet for segmentation",
                       FRAMEFIT_MEMBER(std::string, model.network),
                       {"", "layers", "r3d_18", "r2plus1d_18", "unet", "torchscript"}));
    t.push_back(path("model.script",
                     "model.network or model.encoder torchscript: the file torch.jit.save wrote",
                     FRAMEFIT_MEMBER(std::string, model.script)));
    t.push_back(field<int64_t>("model.width", "UNet: channels of the first stage",
                               FRAMEFIT_MEMBER(int64_t, model.width), "an integer", at_least(1)));
    t.push_back(field<int64_t>("model.depth", "UNet: down-sampling steps",
                               FRAMEFIT_MEMBER(int64_t, model.depth), "an integer", at_least(1)));
    t.push_back(field<bool>("model.bilinear",
                            "UNet: bilinear upsampling instead of transposed conv",
                            FRAMEFIT_MEMBER(bool, model.bilinear), "true or false"));
    t.push_back(auto_flag(
        "model.lean_backward",
        "r3d_18/r2plus1d_18 and conv3d layers on the CPU: convolutions with few "
        "output positions (layer4) run their backward without oneDNN's weight-sized workspace, "
        "slower but leaner; auto: only where that fits twice the batch",
        FRAMEFIT_MEMBER(std::optional<bool>, model.lean_backward)));
    // data
    t.push_back(path("data.manifest", "CSV listing videos, label files and splits",
                     FRAMEFIT_MEMBER(std::string, data.manifest)));
    t.push_back(names("data.classes",
                      "phase names in label-id order, e.g. [Preparation, Dissection]",
                      FRAMEFIT_MEMBER(std::vector<std::string>, data.classes)));
    t.push_back(names("data.background",
                      "phases: classes the segmental metrics (edit, F1@k) leave out, e.g. "
                      "[background]; frame metrics count them",
                      FRAMEFIT_MEMBER(std::vector<std::string>, data.background)));
    t.push_back(names("data.tools",
                      "phases: tools whose presence is also learned, the columns of the "
                      "manifest's tool annotation files, e.g. [Grasper, Bipolar]; empty: none",
                      FRAMEFIT_MEMBER(std::vector<std::string>, data.tools)));
    t.push_back(field<double>("data.fps", "frames per second sampled from each video; 0: all",
                              FRAMEFIT_MEMBER(double, data.fps), "a number", non_negative()));
    t.push_back(named<data::FeatureLayout>(
        "data.features_layout",
        "model.encoder features: the files' axes, T,D (framefit extract) or D,T (MS-TCN's .npy); "
        "auto: the axis as long as the annotation is time",
        FRAMEFIT_MEMBER(data::FeatureLayout, data.features_layout),
        {{"auto", data::FeatureLayout::Auto},
         {"T,D", data::FeatureLayout::TimeFirst},
         {"D,T", data::FeatureLayout::FeaturesFirst}}));
    t.push_back(field<int64_t>("data.features_stride",
                               "model.encoder features: train, evaluate and predict on rows 0, k, "
                               "2k, ... of each file (MS-TCN's sample_rate); 1: every row",
                               FRAMEFIT_MEMBER(int64_t, data.features_stride), "an integer",
                               at_least(1)));
    t.push_back(field<double>("data.labels_fps",
                              "frame rate of the annotation files where it is not the video's "
                              "(manifest column labels_fps overrides); 0: one label per frame",
                              FRAMEFIT_MEMBER(double, data.labels_fps), "a number",
                              non_negative()));
    t.push_back(field<int64_t>(
        "data.resize", "shorter side after decoding (segmentation: square side), pixels; 0: keep",
        FRAMEFIT_MEMBER(int64_t, data.resize), "an integer", at_least(0)));
    t.push_back(field<int64_t>("data.crop", "square crop side, pixels; 0: none",
                               FRAMEFIT_MEMBER(int64_t, data.crop), "an integer", at_least(0)));
    t.push_back(field<bool>("data.augment", "training: random crop offset and flip per video",
                            FRAMEFIT_MEMBER(bool, data.augment), "true or false"));
    t.push_back(field<double>("data.brightness",
                              "training with data.augment: brightness factor drawn per video "
                              "from [max(0, 1 - x), 1 + x] (torchvision ColorJitter); 0: off",
                              FRAMEFIT_MEMBER(double, data.brightness), "a number",
                              non_negative()));
    t.push_back(field<double>("data.contrast", "as data.brightness, for contrast",
                              FRAMEFIT_MEMBER(double, data.contrast), "a number", non_negative()));
    t.push_back(field<double>("data.saturation", "as data.brightness, for saturation",
                              FRAMEFIT_MEMBER(double, data.saturation), "a number",
                              non_negative()));
    t.push_back(field<double>("data.hue",
                              "training with data.augment: hue shift drawn per video from "
                              "[-x, x] turns (torchvision ColorJitter); 0: off",
                              FRAMEFIT_MEMBER(double, data.hue), "a number",
                              within(0, 0.5, true, " (turns)")));
    t.push_back(field<double>("data.rotation",
                              "training with data.augment: rotation drawn per video from "
                              "[-x, x] degrees (torchvision RandomRotation); 0: off",
                              FRAMEFIT_MEMBER(double, data.rotation), "a number",
                              within(0, 180, true, " (degrees)")));
    t.push_back(choice("data.on_error",
                       "a bad video: stop with an error, or skip it with a warning",
                       FRAMEFIT_MEMBER(std::string, data.on_error), {"fail", "skip"}));
    t.push_back(field<int64_t>("data.workers", "decoding threads",
                               FRAMEFIT_MEMBER(int64_t, data.workers), "an integer", at_least(1)));
    t.push_back(field<bool>("data.skip_unsampled",
                            "decoding leaves out the frames data.fps does not sample that no "
                            "other frame refers to (most B-frames); the frames read are the same",
                            FRAMEFIT_MEMBER(bool, data.skip_unsampled), "true or false"));
    t.push_back(bytes("data.prefetch_bytes", "decoded frames held ahead of training",
                      FRAMEFIT_MEMBER(int64_t, data.prefetch_bytes)));
    t.push_back(field<std::string>("data.train_split", "manifest split trained on",
                                   FRAMEFIT_MEMBER(std::string, data.train_split), "a name"));
    t.push_back(field<std::string>("data.val_split", "split evaluated after each epoch",
                                   FRAMEFIT_MEMBER(std::string, data.val_split), "a name"));
    t.push_back(field<std::string>("data.test_split", "split `framefit eval` uses by default",
                                   FRAMEFIT_MEMBER(std::string, data.test_split), "a name"));
    t.push_back(field<int64_t>("data.clip_length", "clips: sampled frames per clip",
                               FRAMEFIT_MEMBER(int64_t, data.clip_length), "an integer",
                               at_least(1)));
    t.push_back(field<int64_t>("data.clip_stride", "clips: sampled frames between clip starts",
                               FRAMEFIT_MEMBER(int64_t, data.clip_stride), "an integer",
                               at_least(1)));
    t.push_back(choice("data.clip_label", "clips: a clip's label from its frames' labels",
                       FRAMEFIT_MEMBER(std::string, data.clip_label),
                       {"majority", "center", "last"}));
    t.push_back(path("data.images", "segmentation: image folder, {split} replaced by the split",
                     FRAMEFIT_MEMBER(std::string, data.images)));
    t.push_back(path("data.masks", "segmentation: mask folder (PNG class ids), {split} as above",
                     FRAMEFIT_MEMBER(std::string, data.masks)));
    {
      Entry e;
      e.key = {"data.mask_values",
               "segmentation: class i's value in the masks: numbers ([0, 255] for binary masks) "
               "or [R, G, B] colours; empty: the values are the ids"};
      e.set = [](Config& c, const YAML::Node& n, const std::string& where) {
        TORCH_CHECK(n.IsSequence(), where,
                    ": expected a list of values, e.g. [0, 255], or of colours, e.g. [[0, 0, 0], "
                    "[255, 0, 0]]");
        std::vector<std::vector<int64_t>> values;
        for (size_t i = 0; i < n.size(); ++i) {
          const auto at = where + "[" + std::to_string(i) + "]";
          values.push_back(n[i].IsSequence()
                               ? int_list(n[i], at)
                               : std::vector<int64_t>{convert<int64_t>(n[i], at, "an integer")});
          const auto& v = values.back();
          const bool colour = v.size() == 3;
          TORCH_CHECK(v.size() == 1 || colour, at, ": expected a number or an [R, G, B] colour");
          TORCH_CHECK(v.size() == values.front().size(), at,
                      ": mixes numbers and colours; give every class the same kind of value");
          for (const int64_t x : v) {
            TORCH_CHECK(x >= 0 && x <= (colour ? 255 : 65535), at, ": ", x, " is not a ",
                        colour ? "colour channel (0-255)" : "mask value (0-65535)");
          }
          for (size_t j = 0; j + 1 < values.size(); ++j) {
            TORCH_CHECK(values[j] != v, at, ": the same value as class ", j);
          }
        }
        c.data.mask_values = std::move(values);
      };
      e.get = [](const Config& c) {
        YAML::Node n(YAML::NodeType::Sequence);
        for (const auto& v : c.data.mask_values) {
          n.push_back(v.size() == 1 ? YAML::Node(v[0]) : int_list_node(v));
        }
        return n;
      };
      t.push_back(e);
    }
    t.push_back(field<std::string>("data.mask_suffix",
                                   "segmentation: a mask is named as its image plus this (e.g. "
                                   "_segmentation); empty: same name",
                                   FRAMEFIT_MEMBER(std::string, data.mask_suffix), "a string"));
    t.push_back(field<int64_t>("data.ignore_id",
                               "segmentation: mask id of pixels left out of loss and metrics "
                               "(e.g. 255, Pascal VOC's object borders); -1: none",
                               FRAMEFIT_MEMBER(int64_t, data.ignore_id), "an integer",
                               at_least(-1)));
    // train
    t.push_back(field<int64_t>("train.epochs", "passes over the training split",
                               FRAMEFIT_MEMBER(int64_t, train.epochs), "an integer", at_least(1)));
    t.push_back(
        field<int64_t>("train.max_steps", "stop after this many optimizer steps; 0: epochs decide",
                       FRAMEFIT_MEMBER(int64_t, train.max_steps), "an integer", at_least(0)));
    t.push_back(choice("train.optimizer", "optimizer",
                       FRAMEFIT_MEMBER(std::string, train.optimizer), {"sgd", "adam", "adamw"}));
    t.push_back(field<double>("train.lr", "peak learning rate", FRAMEFIT_MEMBER(double, train.lr),
                              "a number", positive()));
    t.push_back(field<double>("train.weight_decay", "weight decay",
                              FRAMEFIT_MEMBER(double, train.weight_decay), "a number",
                              non_negative()));
    t.push_back(field<double>("train.momentum", "SGD momentum",
                              FRAMEFIT_MEMBER(double, train.momentum), "a number", non_negative()));
    t.push_back(choice("train.schedule", "learning-rate schedule after warm-up",
                       FRAMEFIT_MEMBER(std::string, train.schedule),
                       {"constant", "step", "cosine"}));
    t.push_back(field<int64_t>("train.warmup_steps", "linear warm-up from 0, optimizer steps",
                               FRAMEFIT_MEMBER(int64_t, train.warmup_steps), "an integer",
                               at_least(0)));
    t.push_back(
        field<int64_t>("train.step_size", "step schedule: steps between decays; 0: one epoch",
                       FRAMEFIT_MEMBER(int64_t, train.step_size), "an integer", at_least(0)));
    t.push_back(field<double>("train.gamma", "step schedule: decay factor",
                              FRAMEFIT_MEMBER(double, train.gamma), "a number", non_negative()));
    t.push_back(field<double>("train.min_lr", "cosine schedule: final learning rate",
                              FRAMEFIT_MEMBER(double, train.min_lr), "a number", non_negative()));
    t.push_back(field<int64_t>(
        "train.lr_batch",
        "samples per optimizer step train.lr and train.min_lr are for; the run scales them to its "
        "own (train.lr_scaling); 0: used as they are",
        FRAMEFIT_MEMBER(int64_t, train.lr_batch), "an integer", at_least(0)));
    t.push_back(choice("train.lr_scaling",
                       "with train.lr_batch: learning rate proportional to the samples per step "
                       "(linear, for SGD) or to its square root (sqrt, often better for Adam)",
                       FRAMEFIT_MEMBER(std::string, train.lr_scaling), {"linear", "sqrt"}));
    t.push_back(auto_choice<engine::Precision>(
        "train.precision", "autocast precision; auto lets the planner choose",
        FRAMEFIT_MEMBER(std::optional<engine::Precision>, train.precision),
        {"fp32", "bf16", "fp16"}, [](const std::string& v) { return engine::parse_precision(v); },
        [](const engine::Precision& v) { return YAML::Node(engine::to_string(v)); }));
    t.push_back(bytes("train.budget", "memory budget, e.g. 1GiB; 0: the free memory",
                      FRAMEFIT_MEMBER(int64_t, train.budget)));
    t.push_back(choice("train.budget_covers",
                       "on the CPU, what train.budget bounds: the process's resident memory, or "
                       "the tensors alone",
                       FRAMEFIT_MEMBER(std::string, train.budget_covers), {"process", "tensors"}));
    t.push_back(auto_count("train.chunk", "frames per encoder chunk: auto, 0 (naive) or a count",
                           FRAMEFIT_MEMBER(std::optional<int64_t>, train.chunk)));
    t.push_back(auto_count("train.keep", "chunks whose graph is kept: auto or a count",
                           FRAMEFIT_MEMBER(std::optional<int64_t>, train.keep)));
    t.push_back(field<int64_t>("train.accumulate",
                               "videos (phases) or batches (clips, segmentation) per optimizer "
                               "step, gradients averaged",
                               FRAMEFIT_MEMBER(int64_t, train.accumulate), "an integer",
                               at_least(1)));
    t.push_back(field<double>("train.clip_grad_norm", "clip the gradient norm; 0: off",
                              FRAMEFIT_MEMBER(double, train.clip_grad_norm), "a number",
                              non_negative()));
    t.push_back(field<double>("train.smoothing", "phases: MS-TCN smoothing loss weight; 0: off",
                              FRAMEFIT_MEMBER(double, train.smoothing), "a number",
                              non_negative()));
    t.push_back(field<double>(
        "train.label_smoothing",
        "cross-entropy label smoothing (PyTorch's label_smoothing): the target puts 1 - x on the "
        "label and x spread over all classes; 0: off",
        FRAMEFIT_MEMBER(double, train.label_smoothing), "a number", within(0, 1, false)));
    t.push_back(field<double>("train.tool_weight",
                              "with data.tools: weight of the tool presence loss (binary "
                              "cross-entropy) added to the phase loss",
                              FRAMEFIT_MEMBER(double, train.tool_weight), "a number",
                              non_negative()));
    t.push_back(field<bool>("train.class_weights",
                            "weight the loss by inverse class frequency (frames, clips or pixels)",
                            FRAMEFIT_MEMBER(bool, train.class_weights), "true or false"));
    t.push_back(field<uint64_t>("train.seed", "initialisation, data order and augmentation",
                                FRAMEFIT_MEMBER(uint64_t, train.seed), "a non-negative integer"));
    t.push_back(path("train.out_dir", "checkpoints, log.jsonl and config.yaml go here",
                     FRAMEFIT_MEMBER(std::string, train.out_dir)));
    t.push_back(field<int64_t>("train.keep_last", "checkpoints kept besides the best",
                               FRAMEFIT_MEMBER(int64_t, train.keep_last), "an integer",
                               at_least(1)));
    t.push_back(field<int64_t>(
        "train.checkpoint_every", "optimizer steps between checkpoints; 0: each epoch",
        FRAMEFIT_MEMBER(int64_t, train.checkpoint_every), "an integer", at_least(0)));
    t.push_back(field<bool>("train.validate", "evaluate the validation split after each epoch",
                            FRAMEFIT_MEMBER(bool, train.validate), "true or false"));
    t.push_back(field<int64_t>("train.patience",
                               "stop once train.best_by has not improved for this many validated "
                               "epochs; 0: never",
                               FRAMEFIT_MEMBER(int64_t, train.patience), "an integer",
                               at_least(0)));
    t.push_back(auto_choice<std::string>(
        "train.best_by",
        "validation metric that picks best.pt (edit, f1@k: phases; tool_map: data.tools); auto: "
        "macro_jaccard for segmentation, accuracy otherwise",
        FRAMEFIT_MEMBER(std::optional<std::string>, train.best_by),
        {"accuracy", "macro_f1", "macro_jaccard", "edit", "f1@10", "f1@25", "f1@50", "tool_map"},
        [](const std::string& v) { return v; },
        [](const std::string& v) { return YAML::Node(v); }));
    t.push_back(auto_count("train.batch",
                           "clips/segmentation: samples per batch; auto: the largest that fits",
                           FRAMEFIT_MEMBER(std::optional<int64_t>, train.batch)));
    t.push_back(auto_count(
        "train.eval_batch",
        "clips/segmentation: samples per evaluation batch; auto: the largest that fits (planned)",
        FRAMEFIT_MEMBER(std::optional<int64_t>, train.eval_batch)));
    t.push_back(named<bool>("train.cache_features",
                            "phases, encoder frozen through its last stage, data.augment false: "
                            "keep each video's features after the first epoch and train the head "
                            "on them",
                            FRAMEFIT_MEMBER(bool, train.cache_features),
                            {{"auto", true}, {"off", false}}));
    t.push_back(named<plan::Recompute>(
        "train.checkpointing",
        "clips/segmentation: layer checkpointing (with BatchNorm recomputed between "
        "convolutions); auto: only what the batch needs",
        FRAMEFIT_MEMBER(plan::Recompute, train.checkpointing),
        {{"auto", plan::Recompute::AsNeeded},
         {"off", plan::Recompute::Nothing},
         {"all", plan::Recompute::EveryStage}}));
    t.push_back(choice("task", "what is learned", FRAMEFIT_MEMBER(std::string, task),
                       {"phases", "clips", "segmentation"}));
    t.push_back(field<std::string>(
        "device", "cpu, cuda or cuda:N", FRAMEFIT_MEMBER(std::string, device), "a device name",
        [](const std::string& v, const std::string& where) {
          TORCH_CHECK(is_device_name(v), where, ": expected cpu, cuda or cuda:N, got \"", v, "\"");
        }));
    return t;
  }();
  return table;
}

#undef FRAMEFIT_MEMBER

const Entry* find_entry(const std::string& name) {
  for (const auto& e : entries()) {
    if (e.key.name == name) return &e;
  }
  return nullptr;
}

std::string unknown_key_message(const std::string& name) {
  // Lists the keys of the same section (or the sections), so a typo is easy to fix.
  const auto dot = name.find('.');
  const std::string section = dot == std::string::npos ? "" : name.substr(0, dot + 1);
  std::string known;
  for (const auto& e : entries()) {
    if (!section.empty() && e.key.name.rfind(section, 0) != 0) continue;
    known += (known.empty() ? "" : ", ") + e.key.name;
  }
  if (known.empty()) known = "task, model.*, data.*, train.*, device";
  return "unknown key `" + name + "` (known: " + known + ")";
}

bool is_section(const std::string& name) {
  const auto& all = entries();
  return std::any_of(all.begin(), all.end(),
                     [&](const Entry& e) { return e.key.name.rfind(name + ".", 0) == 0; });
}

void apply(Config& config, const YAML::Node& node, const std::string& prefix,
           const std::string& source) {
  // yaml-cpp keeps a mapping's repeated keys, and a lookup finds only one of them: a key given
  // twice (a section pasted twice) would have lost the other's settings without a word.
  std::map<std::string, int> lines;
  for (const auto& item : node) {
    const int line = item.first.Mark().line + 1;
    TORCH_CHECK(item.first.IsScalar(), source, ": line ", line,
                ": a key must be a name, not a list or mapping");
    const auto key = item.first.Scalar();
    const std::string name = prefix.empty() ? key : prefix + "." + key;
    const auto [earlier, first] = lines.emplace(name, line);
    TORCH_CHECK(first, source, ": `", name, "` is given twice (lines ", earlier->second, " and ",
                line, "); keep one");
    if (const Entry* e = find_entry(name)) {
      e->set(config, item.second, source + ": " + name);
    } else if (item.second.IsMap()) {
      apply(config, item.second, name, source);
    } else if (is_section(name)) {
      TORCH_CHECK(false, source, ": `", name, "` is a section: expected a mapping of its keys (",
                  name, ": {key: value, ...}), got ",
                  item.second.IsSequence() ? "a list"
                  : item.second.IsNull()   ? "nothing"
                                           : "\"" + item.second.Scalar() + "\"");
    } else {
      TORCH_CHECK(false, source, ": ", unknown_key_message(name));
    }
  }
}

}  // namespace

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> k;
    for (const auto& e : entries()) k.push_back(e.key);
    return k;
  }();
  return keys;
}

Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  Config config;
  YAML::Node root;
  try {
    const auto documents = YAML::LoadAll(yaml_text);
    // A second document (after a `---` line) would be ignored.
    TORCH_CHECK(documents.size() <= 1, source, ": holds ", documents.size(),
                " YAML documents (separated by --- lines); put every setting in one");
    if (!documents.empty()) root = documents.front();
  } catch (const YAML::Exception& e) {
    TORCH_CHECK(false, source, ": not valid YAML: line ", e.mark.line + 1, ", column ",
                e.mark.column + 1, ": ", e.msg);
  }
  if (root.IsDefined() && !root.IsNull()) {
    TORCH_CHECK(root.IsMap(), source,
                ": expected a mapping of sections (task, model, data, train, device)");
    apply(config, root, "", source);
  }
  for (const auto& text : overrides) {
    const auto eq = text.find('=');
    TORCH_CHECK(eq != std::string::npos && eq > 0, "--set ", text, ": expected key=value");
    const std::string name = text.substr(0, eq);
    const Entry* e = find_entry(name);
    TORCH_CHECK(e != nullptr, "--set ", text, ": ", unknown_key_message(name));
    YAML::Node value;
    try {
      value = YAML::Load(text.substr(eq + 1));
    } catch (const YAML::Exception& error) {
      TORCH_CHECK(false, "--set ", text, ": the value is not valid YAML: ", error.msg);
    }
    if (value.IsNull()) value = YAML::Node(std::string());  // `--set model.freeze=` clears
    e->set(config, value, "--set " + name);
  }
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "config ", path, ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  return parse_config(text.str(), "config " + path, overrides);
}

namespace {
// A value as a reader wants it: YAML flow style, decimals with 15 significant digits (the node
// holds 0.0030000000000000001 where the config said 0.003).
std::string display(const YAML::Node& node) {
  if (node.IsSequence()) {
    std::vector<std::string> items;
    for (const auto& item : node) items.push_back(display(item));
    return "[" + c10::Join(", ", items) + "]";
  }
  if (!node.IsScalar()) {
    YAML::Emitter out;
    out << YAML::Flow << node;
    return out.c_str();
  }
  const auto& text = node.Scalar();
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || text.find_first_of(".eE") == std::string::npos) return text;
  std::ostringstream out;
  out << std::setprecision(15) << value;
  return out.str();
}
}  // namespace

bool is_batch_task(const Config& config) {
  return config.task == "clips" || config.task == "segmentation";
}

std::string best_metric(const Config& config) {
  if (config.train.best_by) return *config.train.best_by;
  return config.task == "segmentation" ? "macro_jaccard" : "accuracy";
}

std::vector<std::string> config_differences(const Config& before, const Config& after) {
  std::vector<std::string> changed;
  for (const auto& e : entries()) {
    const auto a = display(e.get(before)), b = display(e.get(after));
    if (a != b) changed.push_back(e.key.name + ": " + a + " -> " + b);
  }
  return changed;
}

std::string to_yaml(const Config& config) {
  YAML::Node root;
  for (const auto& e : entries()) {
    const auto& name = e.key.name;
    const auto dot = name.find('.');
    if (dot == std::string::npos) {
      root[name] = e.get(config);
    } else {
      root[name.substr(0, dot)][name.substr(dot + 1)] = e.get(config);
    }
  }
  YAML::Emitter out;
  out << root;
  return std::string(out.c_str()) + "\n";
}

}  // namespace framefit::train
