#pragma once
// What a clips or segmentation checkpoint records: the network (with its config, and a
// TorchScript network's module) and the run's position and step settings as a run record
// (run_files.h), read back from either record format. Private to src/train.
#include <torch/serialize.h>

#include <string>
#include <vector>

#include "framefit/engine/amp.h"
#include "framefit/engine/checkpoint.h"
#include "framefit/train/task.h"
#include "framefit/train/tasks.h"

namespace framefit::train::detail {

// What a batch-task checkpoint records about the run.
struct BatchProgress : RunPosition {  // position: samples of the epoch's order used
  int64_t batch = 0;
  int64_t micro_batches = 1;
  engine::Precision precision = engine::Precision::FP32;
  std::vector<engine::ChainSegment> segments;           // the recomputation the step runs with
  std::vector<engine::ChainSegment> fallback_segments;  // after out of memory, as planned
  bool lean_backward = false;                           // models/conv3d.h, as planned
  bool recompute_norm = false;                          // models/norm_relu_conv.h, as planned
  int64_t time_slices = 0;                              // models/network.h, as planned
  int64_t eval_batch = 0;                               // validation's batch, as planned
};

void write_network(torch::serialize::OutputArchive& archive, const BatchModel& model);
void write_progress(torch::serialize::OutputArchive& archive, const BatchProgress& p);
// The checkpoint's record of its run, of either format; a file that records none is an error
// naming `checkpoint`.
BatchProgress read_batch_progress(torch::serialize::InputArchive& archive,
                                  const std::string& checkpoint);

}  // namespace framefit::train::detail
