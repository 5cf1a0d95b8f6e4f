#pragma once
// The tiny planning configuration shared by the CPU and CUDA planner tests.
#include "framefit/plan/calibration.h"
#include "framefit/plan/memory_model.h"

namespace framefit::test_util {

// ResNet-18 + linear head on 64x64 frames: calibrates in a second or two, and its activations
// are large enough against the parameters to make chunking matter.
inline plan::ModelSpec tiny_plan_spec(torch::Device device = torch::kCPU) {
  plan::ModelSpec spec;
  spec.model = "resnet18";
  spec.head = "linear";
  spec.classes = 3;
  spec.norm = "group_norm";
  spec.groups = 8;
  spec.size = 64;
  spec.optimizer = "sgd";
  spec.device = device;
  return spec;
}

inline plan::CalibrationOptions quick_calibration() {
  plan::CalibrationOptions options;
  options.chunk_frames = {2, 6};
  options.head_frames = {16, 48};
  return options;
}

}  // namespace framefit::test_util
