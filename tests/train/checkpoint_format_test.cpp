// Checkpoints written by an earlier framefit (tests/media/checkpoints, made by its make.sh with
// the build of commit 0875f54) must still load and resume: a change of the checkpoint format
// reads them or refuses them with a message that says so, never misreads them.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "test_util.h"

#include "framefit/models/weights.h"
#include "framefit/train/config.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"
#include "framefit/train/trainer.h"

using namespace framefit;

namespace {

const std::string kCheckpoints = std::string(FRAMEFIT_SOURCE_DIR) + "/tests/media/checkpoints";

// Every tensor of `got` equal to the same-named one of `expected`, and no name missing.
void expect_same_state(const models::StateDict& got, const models::StateDict& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, expected[i].first);
    EXPECT_TRUE(torch::equal(got[i].second, expected[i].second)) << got[i].first;
  }
}

int64_t step_records(const std::string& out_dir) {
  std::ifstream log(out_dir + "/log.jsonl");
  int64_t steps = 0;
  for (std::string line; std::getline(log, line);)
    steps += line.find("\"type\":\"step\"") != std::string::npos;
  return steps;
}

}  // namespace

TEST(CheckpointFormat, FirstFormatPhasesCheckpointLoadsAndResumes) {
  // A TCN head on features, stopped at step 2 of a run checkpointing every step.
  const std::string dir = kCheckpoints + "/phases", checkpoint = dir + "/step_00000002.pt";
  auto config = train::checkpoint_config(checkpoint);
  EXPECT_EQ(config.model.head, "tcn");
  EXPECT_EQ(config.model.head_settings.tcn_channels, 8);
  const auto model = train::load_model(checkpoint, {"data.manifest=" + dir + "/manifest.csv"});
  expect_same_state(train::export_state_dict(model),
                    models::read_state_dict(dir + "/step_00000002_weights.pt"));

  config.data.manifest = dir + "/manifest.csv";
  config.train.out_dir = "/tmp/framefit_checkpoint_format_phases_" + std::to_string(::getpid());
  config.train.max_steps = 3;
  test_util::remove_tree(config.train.out_dir);
  const auto result = train::train(config, checkpoint);
  EXPECT_EQ(result.steps, 3);                        // steps 1-2 were the checkpoint's
  EXPECT_EQ(step_records(config.train.out_dir), 1);  // this run trained step 3 alone
  const auto resumed = train::load_model(result.last_checkpoint);
  EXPECT_FALSE(torch::equal(train::export_state_dict(resumed)[0].second,
                            train::export_state_dict(model)[0].second));
  test_util::remove_tree(config.train.out_dir);
}

TEST(CheckpointFormat, ARunRecordOfANewerFormatIsRefusedSayingSo) {
  const std::string dir = kCheckpoints + "/phases";
  auto config = train::checkpoint_config(dir + "/step_00000002.pt");
  config.data.manifest = dir + "/manifest.csv";
  config.train.out_dir = "/tmp/framefit_checkpoint_format_newer_" + std::to_string(::getpid());
  config.train.max_steps = 1;
  test_util::remove_tree(config.train.out_dir);
  const auto written = train::train(config).last_checkpoint;
  // The same checkpoint, its run record marked as a later framefit's.
  auto archive = torch::jit::load(written);
  archive.attr("run").toModule().setattr("format", c10::IValue(int64_t{3}));
  const std::string newer = config.train.out_dir + "/newer.pt";
  archive.save(newer);
  config.train.max_steps = 2;
  const auto message = test_util::error_message([&] { train::train(config, newer); });
  EXPECT_NE(message.find(newer + " has run record format 3, newer than this framefit reads"),
            std::string::npos)
      << message;
  test_util::remove_tree(config.train.out_dir);
}

TEST(CheckpointFormat, ABatchCheckpointThatRecordsNoRunIsRefusedSayingSo) {
  // A segmentation checkpoint's network and config without its run record (neither format's):
  // eval and export need the record's precision and evaluation batch.
  const std::string dir = kCheckpoints + "/segmentation";
  const auto model = train::load_batch_model(dir + "/step_00000002.pt");
  const std::string file =
      "/tmp/framefit_checkpoint_format_norun_" + std::to_string(::getpid()) + ".pt";
  torch::serialize::OutputArchive archive, network;
  archive.write("format", c10::IValue(std::string("framefit-checkpoint-1")));
  archive.write("config", c10::IValue(train::to_yaml(model.config)));
  archive.write("input", torch::tensor(model.input, torch::kLong));
  model.network.module->save(network);
  archive.write("network", network);
  archive.save_to(file);
  const auto message = test_util::error_message([&] { train::load_batch_model(file); });
  EXPECT_NE(message.find("checkpoint " + file + " records no run (no training position)"),
            std::string::npos)
      << message;
  std::remove(file.c_str());
}

#ifdef FRAMEFIT_WITH_FFMPEG
TEST(CheckpointFormat, FirstFormatSegmentationCheckpointLoadsAndResumes) {
  // A UNet (width 4, depth 2, BatchNorm) on 16x16 images, stopped at step 2.
  const std::string dir = kCheckpoints + "/segmentation", checkpoint = dir + "/step_00000002.pt";
  auto config = train::checkpoint_config(checkpoint);
  ASSERT_EQ(config.task, "segmentation");
  const std::vector<std::string> data = {"data.images=" + dir + "/{split}/images",
                                         "data.masks=" + dir + "/{split}/masks"};
  const auto model = train::load_batch_model(checkpoint, data);
  expect_same_state(models::state_dict(*model.network.module),
                    models::read_state_dict(dir + "/step_00000002_weights.pt"));

  config.data.images = dir + "/{split}/images";
  config.data.masks = dir + "/{split}/masks";
  config.train.out_dir = "/tmp/framefit_checkpoint_format_seg_" + std::to_string(::getpid());
  config.train.max_steps = 3;
  test_util::remove_tree(config.train.out_dir);
  const auto result = train::train(config, checkpoint);
  EXPECT_EQ(result.steps, 3);
  EXPECT_EQ(step_records(config.train.out_dir), 1);
  test_util::remove_tree(config.train.out_dir);
}
#endif
