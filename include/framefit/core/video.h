#pragma once
// A video as training sees it: the unit the data pipeline produces and a training step consumes.
// Low in the layering (core/), so that data/ and engine/ both use it without depending on each
// other.
#include <torch/types.h>

#include <string>

namespace framefit {

// One video: frames [T,3,H,W] (uint8 on the host) and one int64 label per frame [T].
struct Video {
  torch::Tensor frames;
  torch::Tensor labels;
  std::string name;  // for messages
  // [T,D] float features of an encoder without trained parameters, from an earlier step
  // (engine::StepReport::features): the step uses them instead of encoding `frames`, which may
  // then be undefined. The same numbers as encoding again: such an encoder is a fixed function.
  torch::Tensor features;
  // [T,K] float tool presence (1 present, 0 absent, -1 not annotated), for a step with a tool
  // head; undefined: the video has no tool labels.
  torch::Tensor tools;
};

}  // namespace framefit
