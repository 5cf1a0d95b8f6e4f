#pragma once
// Encoders from TorchScript: a module saved in Python with torch.jit.save (torch.jit.script or
// trace), trained from C++ with the same engine as framefit's own models.
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/script.h>

#include <istream>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace framefit::models {

// The loaded module's parameters and buffers are registered on this nn::Module (the same
// tensors, so optimizers, the chunked engine and checkpoints see them); their TorchScript names
// ("conv.weight") are kept for state_dicts, as registration forbids dots.
class TorchScriptEncoderImpl : public torch::nn::Module {
 public:
  // `device`: where the parameters live. Errors name the file.
  explicit TorchScriptEncoderImpl(const std::string& path, torch::Device device = torch::kCPU);
  // From the bytes of such a file (as a checkpoint stores them); `name` is for messages.
  TorchScriptEncoderImpl(std::istream& in, const std::string& name,
                         torch::Device device = torch::kCPU);
  // Calls the module's forward with one tensor; it must return a tensor.
  torch::Tensor forward(const torch::Tensor& x);
  void train(bool on = true) override;
  // TorchScript names in the module's order.
  std::vector<std::pair<std::string, torch::Tensor>> named_state() const;
  const std::string& path() const { return path_; }
  // The module as torch.jit.save writes it (code and current weights): what a checkpoint
  // stores so it loads without the original file.
  void save_module(std::ostream& out) const;

 private:
  void register_state();
  std::string path_;
  torch::jit::Module module_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;
};
TORCH_MODULE(TorchScriptEncoder);

}  // namespace framefit::models
