#include "framefit/models/torchscript.h"

#include <torch/torch.h>

#include <algorithm>

#include "framefit/core/errors.h"
#include "framefit/models/weights.h"

namespace framefit::models {

namespace {
std::string registered_name(std::string name) {
  std::replace(name.begin(), name.end(), '.', '_');
  return name;
}
}  // namespace

TorchScriptEncoderImpl::TorchScriptEncoderImpl(const std::string& path, torch::Device device)
    : path_(path) {
  check_archive(path, "TorchScript encoder " + path);  // LibTorch's loader skips the CRC-32s
  try {
    module_ = torch::jit::load(path, device);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "TorchScript encoder ", path, ": cannot load it (", error_text(e),
                "). Save it in Python with torch.jit.save(torch.jit.script(model), path)");
  }
  register_state();
}

TorchScriptEncoderImpl::TorchScriptEncoderImpl(std::istream& in, const std::string& name,
                                               torch::Device device)
    : path_(name) {
  try {
    module_ = torch::jit::load(in, device);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "TorchScript encoder ", name, ": cannot load it (", error_text(e), ")");
  }
  register_state();
}

void TorchScriptEncoderImpl::register_state() {
  TORCH_CHECK(module_.find_method("forward").has_value(), "TorchScript encoder ", path_,
              ": the module has no forward method");
  for (const auto& p : module_.named_parameters(/*recurse=*/true)) {
    register_parameter(registered_name(p.name), p.value, p.value.requires_grad());
    named_.emplace_back(p.name, p.value);
  }
  for (const auto& b : module_.named_buffers(/*recurse=*/true)) {
    register_buffer(registered_name(b.name), b.value);
    named_.emplace_back(b.name, b.value);
  }
  module_.train(is_training());
}

torch::Tensor TorchScriptEncoderImpl::forward(const torch::Tensor& x) {
  auto out = module_.forward({x});
  TORCH_CHECK(out.isTensor(), "TorchScript encoder ", path_,
              ": forward must return one tensor; it returned ", out.tagKind());
  return out.toTensor();
}

void TorchScriptEncoderImpl::save_module(std::ostream& out) const { module_.save(out); }

void TorchScriptEncoderImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_.train(on);
}

std::vector<std::pair<std::string, torch::Tensor>> TorchScriptEncoderImpl::named_state() const {
  return named_;
}

}  // namespace framefit::models
