#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "framefit/models/resnet.h"
#include "framefit/models/weights.h"

using namespace framefit::models;

namespace {
std::string temp_path(const std::string& name) {
  return (testing::TempDir() + "framefit_weights_" + name);
}

}  // namespace

TEST(Weights, WriteThenReadRoundTrips) {
  ResNet source(ResNetOptions(18).num_classes(3));
  const auto path = temp_path("roundtrip.pt");
  write_state_dict(state_dict(*source), path);
  const auto read = read_state_dict(path);
  const auto expected = state_dict(*source);
  ASSERT_EQ(read.size(), expected.size());
  for (size_t i = 0; i < read.size(); ++i) {
    EXPECT_EQ(read[i].first, expected[i].first);
    EXPECT_TRUE(torch::equal(read[i].second, expected[i].second)) << read[i].first;
    EXPECT_EQ(read[i].second.scalar_type(), expected[i].second.scalar_type());
  }
  ResNet target(ResNetOptions(18).num_classes(3));
  const auto report = load_state_dict(*target, read);
  EXPECT_TRUE(report.complete());
  EXPECT_EQ(report.loaded.size(), expected.size());
  torch::NoGradGuard no_grad;
  source->eval();
  target->eval();
  const auto x = torch::randn({1, 3, 32, 32});
  EXPECT_TRUE(torch::equal(source->forward(x), target->forward(x)));
  std::remove(path.c_str());
}

TEST(Weights, TensorFilesRoundTrip) {
  const auto path = temp_path("tensor.pt");
  const auto t = torch::randint(0, 255, {4, 3, 8, 8}).to(torch::kUInt8);
  write_tensor(t, path);
  EXPECT_TRUE(torch::equal(read_tensor(path), t));
  EXPECT_NE(framefit::test_util::error_message([&] { read_state_dict(path); }).find("holds no dict"), std::string::npos);
  std::remove(path.c_str());
}

TEST(Weights, FailedWriteIsAnErrorAndLeavesTheEarlierFile) {
  // A disk that fills up while a file is written: the error names the file and why, the file
  // written before is as it was, and no temporary file is left to fill the disk further.
  const auto path = temp_path("full_disk.pt");
  const auto earlier = torch::arange(10);
  write_tensor(earlier, path);
  std::string message;
  {
    framefit::test_util::FileSizeLimit limit(64 << 10);
    message = framefit::test_util::error_message(
        [&] { write_tensor(torch::zeros({1 << 18}), path); });  // 1 MiB
  }
  EXPECT_NE(message.find("writing '" + path + "' failed: File too large"), std::string::npos)
      << message;
  EXPECT_TRUE(torch::equal(read_tensor(path), earlier));
  EXPECT_FALSE(std::ifstream(path + ".tmp").good());
  std::remove(path.c_str());
}

TEST(Weights, StrictLoadNamesEveryProblemAndCopiesNothing) {
  ResNet model(ResNetOptions(18).num_classes(3));
  auto state = state_dict(*ResNet(ResNetOptions(18).num_classes(5)));  // fc shape differs
  state.erase(state.begin());                                        // conv1.weight missing
  state.emplace_back("head.extra", torch::zeros({2}));
  const auto before = model->layer1[0]->as<ResidualBlock>()->conv1->weight.clone();
  const auto message = framefit::test_util::error_message([&] { load_state_dict(*model, state); });
  EXPECT_NE(message.find("missing key (in the model, not in the file): conv1.weight"),
            std::string::npos) << message;
  EXPECT_NE(message.find("unexpected key (in the file, not in the model): head.extra"),
            std::string::npos) << message;
  EXPECT_NE(message.find("shape mismatch for fc.weight: the model has [3, 512], the file [5, 512]"),
            std::string::npos) << message;
  EXPECT_TRUE(torch::equal(before, model->layer1[0]->as<ResidualBlock>()->conv1->weight));
}

TEST(Weights, NonStrictLoadCopiesWhatMatches) {
  ResNet model(ResNetOptions(18).num_classes(3));
  ResNet other(ResNetOptions(18).num_classes(5));
  LoadOptions options;
  options.strict = false;
  const auto report = load_state_dict(*model, state_dict(*other), options);
  EXPECT_FALSE(report.complete());
  ASSERT_EQ(report.mismatched.size(), 2u);  // fc.weight, fc.bias
  EXPECT_TRUE(torch::equal(model->conv1->weight, other->conv1->weight));

  // Feature mode: ImageNet weights load once fc.* is ignored.
  ResNet encoder(ResNetOptions(18).num_classes(0));
  LoadOptions ignore_fc;
  ignore_fc.ignore_prefixes = {"fc."};
  EXPECT_TRUE(load_state_dict(*encoder, state_dict(*other), ignore_fc).complete());
}

TEST(Weights, KeysUnderAPrefixAreFoundOrNamed) {
  ResNet source(ResNetOptions(18).num_classes(4));
  const auto under = [&](const std::string& prefix) {
    StateDict state;
    for (auto& [name, tensor] : state_dict(*source)) state.emplace_back(prefix + name, tensor);
    return state;
  };
  LoadOptions find;
  find.ignore_prefixes = {"fc."};
  find.find_prefix = true;
  // DistributedDataParallel's "module.", a framefit export's "encoder." (next to head.*), a
  // self-supervised backbone's: the one prefix holding every needed key is found.
  for (const std::string prefix : {"module.", "encoder.", "model.backbone."}) {
    auto state = under(prefix);
    state.emplace_back("head.fc.weight", torch::zeros({2, 2}));
    ResNet encoder(ResNetOptions(18).num_classes(0));
    const auto report = load_state_dict(*encoder, state, find);
    EXPECT_TRUE(report.complete()) << prefix << "\n" << report.describe();
    EXPECT_EQ(report.prefix, prefix);
    EXPECT_TRUE(torch::equal(encoder->conv1->weight, source->conv1->weight));
  }
  // Keys that match as they are need no prefix, and without find_prefix none is looked for.
  ResNet encoder(ResNetOptions(18).num_classes(0));
  EXPECT_EQ(load_state_dict(*encoder, state_dict(*source), find).prefix, "");
  EXPECT_NE(framefit::test_util::error_message([&] {
              load_state_dict(*encoder, under("module."), LoadOptions{});
            }).find("missing key"),
            std::string::npos);
  // Two complete copies (MoCo's query and key encoders) are named; a given prefix picks one.
  auto both = under("encoder_q.");
  for (auto& entry : under("encoder_k.")) both.push_back(entry);
  EXPECT_NE(framefit::test_util::error_message([&] {
              load_state_dict(*encoder, both, find);
            }).find("under 2 prefixes (encoder_k., encoder_q.)"),
            std::string::npos);
  LoadOptions given = find;
  given.prefix = "encoder_k.";
  EXPECT_TRUE(load_state_dict(*encoder, both, given).complete());
  given.prefix = "nothing.";
  EXPECT_NE(framefit::test_util::error_message([&] {
              load_state_dict(*encoder, both, given);
            }).find("no key of the file starts with \"nothing.\""),
            std::string::npos);
  // Long reports are cut: 8 lines of a kind, then a count.
  ResNet fifty(ResNetOptions(50).num_classes(0));
  const auto message = framefit::test_util::error_message(
      [&] { load_state_dict(*fifty, state_dict(*source), find); });
  EXPECT_NE(message.find("... and "), std::string::npos);
  EXPECT_LT(std::count(message.begin(), message.end(), '\n'), 30);
}

TEST(Weights, OlderFilesWithoutBatchCountersAreComplete) {
  ResNet model(ResNetOptions(18).num_classes(3));
  StateDict state;
  for (auto& entry : state_dict(*model)) {
    if (entry.first.find("num_batches_tracked") == std::string::npos) state.push_back(entry);
  }
  EXPECT_TRUE(load_state_dict(*model, state).complete());
}

TEST(Weights, BadFilesGetClearErrors) {
  EXPECT_NE(framefit::test_util::error_message([] { read_state_dict("/nonexistent/w.pt"); }).find("does not exist"),
            std::string::npos);
  const auto garbage = temp_path("garbage.pt");
  std::ofstream(garbage) << "this is not a zip archive";
  const auto message = framefit::test_util::error_message([&] { read_state_dict(garbage); });
  EXPECT_NE(message.find("not a torch.save zip archive"), std::string::npos) << message;
  EXPECT_NE(message.find(garbage), std::string::npos) << message;
  std::remove(garbage.c_str());
}

// A copy of `from` at `to` with the byte at `offset` (from the end where negative) changed.
void write_damaged_copy(const std::string& from, const std::string& to, int64_t offset) {
  auto bytes = framefit::test_util::read_bytes(from);
  const auto at =
      static_cast<size_t>(offset < 0 ? static_cast<int64_t>(bytes.size()) + offset : offset);
  ASSERT_LT(at, bytes.size());
  bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
  framefit::test_util::write_bytes(to, bytes);
}

TEST(Weights, DamagedArchiveIsAnErrorNotWrongNumbers) {
#if !FRAMEFIT_WITH_LIBZIP
  GTEST_SKIP() << "built without libzip: archives are not checked";
#endif
  // LibTorch's zip reader skips the CRC-32s, so one changed byte in a tensor's data loaded as a
  // wrong weight without a word; check_archive compares them.
  const auto path = temp_path("crc.pt");
  write_state_dict({{"w", torch::arange(4096, torch::kFloat32)}}, path);
  EXPECT_EQ(read_state_dict(path)[0].second[100].item<float>(), 100);
  const auto damaged = temp_path("crc_damaged.pt");
  // The data (16 KiB) ends a little before the central directory and its end record.
  write_damaged_copy(path, damaged, 8000);
  auto message = framefit::test_util::error_message([&] { read_state_dict(damaged); });
  EXPECT_EQ(message, "'" + damaged + "' is damaged: its entry archive/data/0: CRC error");
  // The same for a file torch.save wrote in Python, whose records are named after the file.
  write_damaged_copy(std::string(FRAMEFIT_SOURCE_DIR) + "/tests/media/ordered_dict_state.pt",
                     damaged, 1000);
  message = framefit::test_util::error_message([&] { read_state_dict(damaged); });
  EXPECT_EQ(message,
            "'" + damaged + "' is damaged: its entry ordered_dict_state/data/0: CRC error");
  std::remove(path.c_str());
  std::remove(damaged.c_str());
}

TEST(Weights, CommittedOrderedDictFileLoads) {
  // Written by torch.save(model.state_dict(), path) with PyTorch 1.13 (an OrderedDict with
  // _metadata and per-tensor hook OrderedDicts): the case LibTorch's own reader cannot read.
  const auto state = read_state_dict(std::string(FRAMEFIT_SOURCE_DIR) +
                                     "/tests/media/ordered_dict_state.pt");
  ASSERT_EQ(state.size(), 7u);
  EXPECT_EQ(state[0].first, "0.weight");
  EXPECT_EQ(state[0].second.sizes(), (std::vector<int64_t>{4, 3, 3, 3}));
  EXPECT_EQ(state[6].first, "1.num_batches_tracked");
  EXPECT_EQ(state[6].second.scalar_type(), torch::kInt64);
  EXPECT_EQ(state[6].second.item<int64_t>(), 0);
  EXPECT_TRUE(torch::allclose(state[2].second, torch::ones({4})));  // BN weight initialised to 1
  // The conv weight was filled with arange(108) / 100 by the script that wrote the file.
  EXPECT_TRUE(torch::allclose(state[0].second.flatten(),
                              torch::arange(108, torch::kFloat32) / 100));
}
