#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "flags.h"

using framefit::cli::parse_command_line;

namespace {
// A command line with every required flag of `extract`; input must exist, so use this file.
std::vector<std::string> extract_with(std::vector<std::string> extra) {
  std::vector<std::string> argv = {"extract", "--model",  "resnet18",   "--input",
                                   __FILE__,  "--output", "/tmp/out.pt"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

void expect_error(const std::vector<std::string>& argv, const std::string& fragment) {
  const auto r = parse_command_line(argv);
  EXPECT_FALSE(r.args.has_value());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(fragment), std::string::npos)
      << "expected '" << fragment << "' in: " << r.output;
}
}  // namespace

TEST(Flags, ParsesValuesAndFillsDefaults) {
  const auto r =
      parse_command_line(extract_with({"--chunk", "16", "--budget", "2GiB", "--drop-layer4"}));
  ASSERT_TRUE(r.args.has_value()) << r.output;
  EXPECT_EQ(r.args->command(), "extract");
  EXPECT_EQ(r.args->integer("chunk"), 16);
  EXPECT_EQ(r.args->bytes("budget"), int64_t(2) << 30);
  EXPECT_TRUE(r.args->on("drop-layer4"));
  EXPECT_EQ(r.args->text("norm"), "bn");  // defaults
  EXPECT_EQ(r.args->text("layout"), "auto");
  EXPECT_EQ(r.args->integer("threads"), 0);
  EXPECT_FALSE(r.args->has("weights"));
}

TEST(Flags, RejectsUnknownDuplicateAndBadValues) {
  expect_error(extract_with({"--chunck", "4"}), "--chunck");
  expect_error(extract_with({"--chunk", "4", "--chunk", "8"}), "chunk");
  expect_error(extract_with({"--chunk", "abc"}), "not an integer");
  expect_error(extract_with({"--chunk", "0"}), "at least 1");
  expect_error(extract_with({"--chunk", "4x"}), "not an integer");
  expect_error(extract_with({"--chunk", "99999999999999999999"}), "out of range");
  expect_error(extract_with({"--budget", "12XB"}), "12XB");
  expect_error(extract_with({"--norm", "layer_norm"}), "layer_norm");
  expect_error(extract_with({"--model", "resnet18"}), "model");
  expect_error({"extract", "--model", "vgg", "--input", __FILE__, "--output", "o.pt"}, "vgg");
  expect_error(
      {"extract", "--model", "resnet18", "--input", "/no/such/file.pt", "--output", "o.pt"},
      "/no/such/file.pt");
  expect_error({"extract", "--model", "resnet18", "--input", __FILE__}, "--output");
  // An output file's folder must exist before any work is done.
  expect_error(
      {"extract", "--model", "resnet18", "--input", __FILE__, "--output", "/no/such/folder/f.pt"},
      "cannot write '/no/such/folder/f.pt': the folder /no/such/folder does not exist");
  expect_error({"export", "--checkpoint", __FILE__, "--out", "missing/w.pt"},
               "the folder missing does not exist");
  EXPECT_TRUE(parse_command_line({"export", "--checkpoint", __FILE__, "--out", "here.pt"})
                  .args.has_value());
  EXPECT_TRUE(parse_command_line(
                  {"predict", "--checkpoint", __FILE__, "--image", __FILE__, "--out", "new_masks/"})
                  .args.has_value());  // a folder predict creates, in "."
  expect_error({"predict", "--checkpoint", __FILE__, "--image", __FILE__, "--out", "a/masks/"},
               "the folder a does not exist");
  expect_error(extract_with({"--budget", "1e30GiB"}), "too large");  // once read as no budget
  // A folder where a file goes was found only when the work was done.
  expect_error({"export", "--checkpoint", __FILE__, "--out", "/tmp/"},
               "cannot write '/tmp/': it is a folder; give a file name");
  expect_error({"export", "--checkpoint", __FILE__, "--out", "/tmp"}, "it is a folder");
  expect_error({"predict", "--checkpoint", __FILE__, "--video", __FILE__, "--segments", "/tmp"},
               "it is a folder");
  EXPECT_TRUE(parse_command_line(
                  {"predict", "--checkpoint", __FILE__, "--image", __FILE__, "--out", "/tmp"})
                  .args.has_value());  // predict's --out: a folder of masks
  expect_error({"launch"}, "launch");
  expect_error({}, "subcommand");
}

TEST(Flags, BenchStepTakesAutoOrACount) {
  const std::vector<std::string> base = {"bench-step", "--model", "resnet18", "--head", "lstm",
                                         "--frames",   "64",      "--size",   "64"};
  auto with = [&](std::vector<std::string> extra) {
    auto argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  };
  const auto automatic = parse_command_line(with({"--chunk", "auto", "--json"}));
  ASSERT_TRUE(automatic.args.has_value()) << automatic.output;
  EXPECT_EQ(automatic.args->text("chunk"), "auto");
  EXPECT_TRUE(automatic.args->on("json"));
  const auto naive = parse_command_line(with({"--chunk", "0", "--precision", "bf16"}));
  ASSERT_TRUE(naive.args.has_value()) << naive.output;
  EXPECT_EQ(naive.args->text("chunk"), "0");
  EXPECT_EQ(naive.args->text("keep"), "1");
  expect_error(with({"--chunk", "some"}), "auto");
  expect_error(with({"--chunk", "-3"}), "auto");
  expect_error(with({"--precision", "fp8"}), "fp8");
  expect_error(with({"--frames", "0"}), "at least 1");
  expect_error(with({"--device", "cuda:x"}), "expected cpu, cuda or cuda:N, got 'cuda:x'");
  EXPECT_TRUE(parse_command_line(with({"--device", "cuda:1"})).args.has_value());
  expect_error({"bench-step", "--model", "resnet18", "--head", "lstm", "--size", "64"}, "--frames");
}

TEST(Flags, OutputsNamingTheSameFileOrAnInputAreRefused) {
  const std::string checkpoint = __FILE__;
  expect_error({"export", "--checkpoint", checkpoint, "--out", checkpoint},
               "--out names " + checkpoint + ", which --checkpoint reads");
  // Spelled differently, the same file.
  const auto folder = checkpoint.substr(0, checkpoint.rfind('/'));
  const auto name = checkpoint.substr(checkpoint.rfind('/') + 1);
  expect_error({"export", "--checkpoint", checkpoint, "--out", folder + "/./" + name},
               "which --checkpoint reads");
  expect_error({"predict", "--checkpoint", checkpoint, "--video", "/tmp/v.mp4", "--out",
                "/tmp/p.csv", "--segments", "/tmp/../tmp/p.csv"},
               "--out and --segments both name /tmp/p.csv: give each output its own file");
  expect_error(
      {"predict", "--checkpoint", checkpoint, "--video", "/tmp/v.mp4", "--timeline", "/tmp/v.mp4"},
      "--timeline names /tmp/v.mp4, which --video reads");
  // A hard link is the same file under another name.
  const std::string stored = ::testing::TempDir() + "framefit_flags_stored.pt";
  const std::string linked = ::testing::TempDir() + "framefit_flags_linked.pt";
  std::filesystem::remove(linked);
  std::ofstream(stored) << "checkpoint";
  std::filesystem::create_hard_link(stored, linked);
  expect_error({"export", "--checkpoint", stored, "--out", linked},
               "which --checkpoint reads: writing it would replace it");
  std::filesystem::remove(linked);
  std::filesystem::remove(stored);
  // Distinct files, and two inputs naming one file, are fine.
  EXPECT_TRUE(parse_command_line({"predict", "--checkpoint", checkpoint, "--video", checkpoint,
                                  "--out", "/tmp/p.csv", "--segments", "/tmp/s.csv"})
                  .args.has_value());
}

TEST(Flags, HelpDescribesEveryCommandAndFlag) {
  const auto top = parse_command_line({"--help"});
  EXPECT_FALSE(top.args.has_value());
  EXPECT_EQ(top.exit_code, 0);
  for (const auto& command : framefit::cli::command_table()) {
    EXPECT_NE(top.output.find(command.name), std::string::npos) << command.name;
    const auto sub = parse_command_line({command.name, "--help"});
    EXPECT_EQ(sub.exit_code, 0);
    for (const auto& flag : framefit::cli::flag_table()) {
      for (const auto& c : flag.commands) {
        if (c != command.name) continue;
        EXPECT_NE(sub.output.find("--" + flag.name), std::string::npos) << flag.name;
        EXPECT_NE(sub.output.find(flag.help.substr(0, 20)), std::string::npos) << flag.name;
      }
    }
  }
}

TEST(Flags, TableIsConsistent) {
  std::set<std::string> commands;
  for (const auto& c : framefit::cli::command_table()) commands.insert(c.name);
  std::set<std::pair<std::string, std::string>> seen;  // (command, flag)
  for (const auto& flag : framefit::cli::flag_table()) {
    for (const auto& c : flag.commands) {
      EXPECT_TRUE(seen.insert({c, flag.name}).second)
          << "--" << flag.name << " listed twice for " << c;
    }
    EXPECT_FALSE(flag.help.empty()) << flag.name;
    EXPECT_FALSE(flag.commands.empty()) << flag.name;
    for (const auto& c : flag.commands) EXPECT_TRUE(commands.count(c)) << flag.name << " " << c;
    if (flag.type == framefit::cli::FlagType::Choice) EXPECT_FALSE(flag.choices.empty());
    EXPECT_FALSE(flag.required && !flag.default_value.empty()) << flag.name;
  }
}

TEST(Flags, PlanningCommandsTakeAutoSettingsAndFractions) {
  const std::vector<std::string> base = {"plan",     "--model", "resnet50", "--head", "lstm",
                                         "--frames", "2000",    "--size",   "224"};
  auto with = [&](std::vector<std::string> extra) {
    auto argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  };
  const auto r = parse_command_line(with({"--budget", "8GiB", "--precision", "auto"}));
  ASSERT_TRUE(r.args.has_value()) << r.output;
  EXPECT_EQ(r.args->text("chunk"), "auto");
  EXPECT_EQ(r.args->text("keep"), "auto");
  EXPECT_EQ(r.args->text("cache-frozen"), "auto");
  EXPECT_EQ(r.args->text("accumulate"), "auto");
  EXPECT_DOUBLE_EQ(r.args->number("margin"), 0.1);
  EXPECT_EQ(r.args->bytes("budget"), int64_t(8) << 30);
  expect_error(with({"--margin", "1.5"}), "fraction");
  expect_error(with({"--margin", "ten"}), "fraction");
  expect_error(with({"--accumulate", "0"}), "at least 1");
  expect_error(with({"--cache-frozen", "maybe"}), "cache-frozen");
  // bench-step has no "auto" precision; doctor and bench-memory share the model flags.
  expect_error({"bench-step", "--model", "resnet18", "--head", "lstm", "--frames", "8", "--size",
                "32", "--precision", "auto"},
               "precision");
  const auto doctor = parse_command_line({"doctor", "--model", "resnet18", "--head", "tcn",
                                          "--frames", "8", "--size", "32", "--chunk", "4"});
  ASSERT_TRUE(doctor.args.has_value()) << doctor.output;
  EXPECT_EQ(doctor.args->integer("chunk"), 4);
  // With --config the doctor checks the config's network and needs no model flags; without it
  // they stay required.
  const auto config = std::string(FRAMEFIT_SOURCE_DIR) + "/configs/clip3d.yaml";
  const auto network = parse_command_line({"doctor", "--config", config, "--batch", "3"});
  ASSERT_TRUE(network.args.has_value()) << network.output;
  EXPECT_EQ(network.args->integer("batch"), 3);
  expect_error({"doctor", "--head", "tcn", "--frames", "8", "--size", "32"},
               "--model is required (or give --config)");
  expect_error({"doctor", "--config", config, "--batch", "0"}, "at least 1");
  // extract: one video from model flags, or a whole data set from a checkpoint or a config.
  const auto data_set = parse_command_line({"extract", "--checkpoint", config, "--out-dir", "f"});
  ASSERT_TRUE(data_set.args.has_value()) << data_set.output;
  EXPECT_EQ(data_set.args->text("out-dir"), "f");
  expect_error({"extract", "--output", "x.pt"},
               "--model is required (or give --config or --checkpoint)");
  const auto bench = parse_command_line({"bench-memory", "--model", "resnet18", "--head", "tcn",
                                         "--frames", "8", "--size", "32", "--chunks", "2,4,0"});
  ASSERT_TRUE(bench.args.has_value()) << bench.output;
  EXPECT_EQ(bench.args->text("chunks"), "2,4,0");
}

TEST(Flags, FrameRateIsAPositiveFiniteNumber) {
  const auto predict = [](const std::string& fps) {
    auto r = parse_command_line(
        {"predict", "--checkpoint", __FILE__, "--video", __FILE__, "--fps", fps});
    EXPECT_TRUE(r.args.has_value()) << r.output;
    return *r.args;
  };
  EXPECT_DOUBLE_EQ(predict("25").frame_rate("fps"), 25);
  EXPECT_DOUBLE_EQ(predict("29.97").frame_rate("fps"), 29.97);
  for (const std::string bad : {"0", "-25", "25fps", "", "inf", "1e400", "nan"}) {
    EXPECT_THROW(predict(bad).frame_rate("fps"), c10::Error) << bad;
  }
}
