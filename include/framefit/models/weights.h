#pragma once
// state_dict files shared with PyTorch.
//
// Reads what `torch.save(model.state_dict(), path)` writes (an OrderedDict, which LibTorch
// 1.13's own unpickler turns into None) as well as `torch.save(dict(...))`, and checkpoints that
// wrap the weights under "state_dict" or "model". Writes files that `torch.load` +
// `load_state_dict` accept.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace framefit::models {

// Name -> tensor in file order.
using StateDict = std::vector<std::pair<std::string, torch::Tensor>>;

StateDict read_state_dict(const std::string& path);
// Written to a temporary file and renamed into place: never left half-written.
void write_state_dict(const StateDict& state, const std::string& path);

// Writes `path` so that a crash leaves the old file or the new one: `produce` is handed a sink
// for the file's bytes, which go to a temporary file beside it, flushed to disk and renamed over
// `path`. A failed write (a full disk) is an error naming the file and why, and removes the
// temporary file. The sink never fails the producer: LibTorch's archive writer aborts the
// process when its sink comes up short in its destructor.
using ByteSink = std::function<void(const void* data, size_t size)>;
void write_file_atomically(const std::string& path,
                           const std::function<void(const ByteSink& sink)>& produce);

// Reads every entry of the zip archive `path` (torch.save's format, and framefit's checkpoints)
// and checks it against the CRC-32 its writer stored. LibTorch's reader skips that check, so a
// damaged file would otherwise load with wrong numbers. The readers here call it; an error names
// `what` and the damaged entry. A file that is not a zip archive is left to its reader. Built
// without libzip (FRAMEFIT_WITH_LIBZIP off, as scripts/cuda_check.sh builds), it checks nothing.
void check_archive(const std::string& path, const std::string& what);

// A single tensor saved with torch.save(tensor, path), and the reverse.
torch::Tensor read_tensor(const std::string& path);
void write_tensor(const torch::Tensor& tensor, const std::string& path);

// Parameters and buffers in PyTorch's state_dict order (each module's parameters, then its
// buffers, then its children), detached.
StateDict state_dict(const torch::nn::Module& module);

struct ShapeMismatch {
  std::string name;
  std::vector<int64_t> expected;
  std::vector<int64_t> got;
};

struct LoadReport {
  std::vector<std::string> loaded;
  std::vector<std::string> missing;     // in the module, not in the file
  std::vector<std::string> unexpected;  // in the file, not in the module
  std::vector<ShapeMismatch> mismatched;
  std::string prefix;  // the file keys' prefix the weights were taken from ("" for none)
  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // One line per problem, names included; at most `limit` lines of each kind, then a count.
  std::string describe(size_t limit = 8) const;
};

struct LoadOptions {
  // Strict: any missing, unexpected or mismatched key is an error and nothing is copied.
  // Non-strict: matching keys are copied, the rest is reported.
  bool strict = true;
  // Keys whose name starts with one of these are dropped from the file first (e.g. "fc." when
  // loading ImageNet weights into an encoder in feature mode).
  std::vector<std::string> ignore_prefixes;
  // Only the file's keys under this prefix are loaded, with it removed: "encoder." for
  // framefit's own export, "module." for a model saved from DistributedDataParallel.
  std::string prefix;
  // With no prefix given and file keys that do not match as they are: the one prefix under
  // which the file holds every key the module needs (after ignore_prefixes) is found and used.
  // Two such prefixes (a MoCo checkpoint's encoder_q and encoder_k) are an error naming both.
  bool find_prefix = false;
};

LoadReport load_state_dict(torch::nn::Module& module, const StateDict& state,
                           const LoadOptions& options = {});

}  // namespace framefit::models
