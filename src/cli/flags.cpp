#include "flags.h"

#include <CLI/CLI.hpp>

#include <sstream>

#include "framefit/memory/tracker.h"

namespace framefit::cli {

const std::vector<Command>& command_table() {
  static const std::vector<Command> commands = {
      {"extract",
       "Per-frame features of a video tensor [T,3,H,W] (torch.save file), computed chunk by chunk "
       "without grad: memory is bounded by --chunk, not by T."},
  };
  return commands;
}

const std::vector<Flag>& flag_table() {
  static const std::vector<Flag> flags = {
      {"model", {"extract"}, FlagType::Choice, "Encoder architecture (torchvision layout).",
       "", true, {"resnet18", "resnet34", "resnet50"}},
      {"weights", {"extract"}, FlagType::ExistingFile,
       "state_dict file from torch.save(model.state_dict(), path); fc.* entries are ignored. "
       "Without it the encoder has random (torchvision-style) weights from --seed.", ""},
      {"input", {"extract"}, FlagType::ExistingFile,
       "Video tensor [T,3,H,W] saved with torch.save: uint8 (normalised with ImageNet statistics "
       "here) or float (taken as already normalised).", "", true},
      {"output", {"extract"}, FlagType::Path,
       "Where to write the [T,D] float32 features (torch.save format; torch.load reads it).", "",
       true},
      {"chunk", {"extract"}, FlagType::Int, "Frames per forward pass.", "64", false, {}, 1},
      {"norm", {"extract"}, FlagType::Choice,
       "Normalisation layers: bn (BatchNorm), frozen_bn, group_norm.", "bn", false,
       {"bn", "frozen_bn", "group_norm"}},
      {"groups", {"extract"}, FlagType::Int, "Groups per GroupNorm layer (--norm group_norm).",
       "32", false, {}, 1},
      {"drop-layer4", {"extract"}, FlagType::Switch,
       "Use the slim ResNet without layer4 (256-d or 1024-d features).", ""},
      {"channels-last", {"extract"}, FlagType::Switch,
       "Run convolutions in channels-last (NHWC) layout: faster on CPU.", ""},
      {"budget", {"extract"}, FlagType::Bytes,
       "Memory budget for tensors, e.g. 2GiB: exceeding it is an out-of-memory error.", ""},
      {"threads", {"extract"}, FlagType::Int, "Compute threads; 0 = all cores.", "0", false, {},
       0},
      {"seed", {"extract"}, FlagType::Int, "Random seed.", "0", false, {}, 0},
      {"device", {"extract"}, FlagType::Text, "cpu, cuda or cuda:N.", "cpu"},
  };
  return flags;
}

bool Args::has(const std::string& flag) const { return values_.count(flag) > 0; }

std::string Args::text(const std::string& flag) const {
  auto it = values_.find(flag);
  TORCH_CHECK(it != values_.end(), "--", flag, " was not given");
  return it->second;
}

int64_t Args::integer(const std::string& flag) const { return std::stoll(text(flag)); }

int64_t Args::bytes(const std::string& flag) const {
  return has(flag) ? memory::parse_bytes(text(flag)) : 0;
}

bool Args::on(const std::string& flag) const { return has(flag) && text(flag) == "true"; }

namespace {

CLI::Validator integer_at_least(int64_t min) {
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        size_t used = 0;
        long long v = 0;
        try {
          v = std::stoll(value, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != value.size()) return "'" + value + "' is not an integer";
        if (v < min) return "must be at least " + std::to_string(min) + ", got " + value;
        return "";
      },
      "INT>=" + std::to_string(min));
}

CLI::Validator byte_size() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          memory::parse_bytes(value);
        } catch (const c10::Error& e) {
          return e.msg();
        }
        return "";
      },
      "SIZE");
}

void add_flag(CLI::App& app, const Flag& flag, std::map<std::string, std::string>& values) {
  const std::string name = "--" + flag.name;
  if (flag.type == FlagType::Switch) {
    app.add_flag_callback(name, [&values, flag] { values[flag.name] = "true"; }, flag.help)
        ->multi_option_policy(CLI::MultiOptionPolicy::Throw);
    return;
  }
  auto* option = app.add_option_function<std::string>(
      name, [&values, flag](const std::string& v) { values[flag.name] = v; }, flag.help);
  option->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  if (flag.required) option->required();
  if (!flag.default_value.empty()) option->default_str(flag.default_value);
  switch (flag.type) {
    case FlagType::ExistingFile: option->check(CLI::ExistingFile); break;
    case FlagType::Int: option->check(integer_at_least(flag.min_value)); break;
    case FlagType::Bytes: option->check(byte_size()); break;
    case FlagType::Choice: option->check(CLI::IsMember(flag.choices)); break;
    case FlagType::Path: option->type_name("PATH"); break;
    default: break;
  }
}

}  // namespace

ParseResult parse_command_line(const std::vector<std::string>& argv) {
  CLI::App app{"framefit: train video models end to end on whole, long videos within a memory "
               "budget."};
  app.name("framefit");
  app.require_subcommand(1);
  std::map<std::string, std::map<std::string, std::string>> values;
  for (const auto& command : command_table()) {
    auto* sub = app.add_subcommand(command.name, command.help);
    for (const auto& flag : flag_table()) {
      for (const auto& c : flag.commands) {
        if (c == command.name) add_flag(*sub, flag, values[command.name]);
      }
    }
  }

  ParseResult result;
  if (!argv.empty() && !argv.front().empty() && argv.front()[0] != '-') {
    bool known = false;
    std::string names;
    for (const auto& command : command_table()) {
      known = known || command.name == argv.front();
      names += (names.empty() ? "" : ", ") + command.name;
    }
    if (!known) {
      result.output = "unknown command '" + argv.front() + "'; commands: " + names +
                      ". Run framefit --help for more information.\n";
      result.exit_code = static_cast<int>(CLI::ExitCodes::ExtrasError);
      return result;
    }
  }
  std::vector<const char*> raw;
  raw.push_back("framefit");
  for (const auto& a : argv) raw.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(raw.size()), raw.data());
  } catch (const CLI::ParseError& e) {
    std::ostringstream out, err;
    result.exit_code = app.exit(e, out, err);
    result.output = out.str() + err.str();
    return result;
  }
  const auto chosen = app.get_subcommands();
  const std::string command = chosen.front()->get_name();
  auto given = values[command];
  for (const auto& flag : flag_table()) {
    for (const auto& c : flag.commands) {
      if (c == command && !flag.default_value.empty() && !given.count(flag.name)) {
        given[flag.name] = flag.default_value;
      }
    }
  }
  result.args = Args(command, std::move(given));
  return result;
}

}  // namespace framefit::cli
