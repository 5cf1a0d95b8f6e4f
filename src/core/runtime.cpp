#include "framefit/core/runtime.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <malloc.h>

#include <fstream>
#include <set>
#include <sstream>
#include <thread>

namespace framefit {

namespace {
void read_cpuinfo(std::string& model, std::string& flags) {
  static const std::set<std::string> interesting = {"avx2",        "fma",      "avx512f",
                                                    "avx512_bf16", "avx512_vnni", "amx_bf16",
                                                    "amx_tile",    "f16c"};
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_first_of(" \t"));
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model" && line.rfind("model name", 0) == 0 && model.empty()) model = value;
    if (key == "flags" && flags.empty()) {
      std::istringstream words(value);
      std::string word;
      while (words >> word) {
        if (interesting.count(word)) flags += (flags.empty() ? "" : " ") + word;
      }
    }
  }
}
}  // namespace

std::string MachineInfo::describe() const {
  std::ostringstream out;
  out << "cpu: " << (cpu_model.empty() ? "unknown" : cpu_model) << "; cores: " << cores
      << "; threads: " << threads << "; flags: " << (cpu_flags.empty() ? "-" : cpu_flags)
      << "; libtorch " << torch_version << (cuda_available ? " (cuda available)" : " (cpu)");
  return out.str();
}

MachineInfo machine_info() {
  MachineInfo info;
  info.cores = static_cast<int>(std::thread::hardware_concurrency());
  info.threads = at::get_num_threads();
  read_cpuinfo(info.cpu_model, info.cpu_flags);
  info.torch_version = TORCH_VERSION;
  info.cuda_available = torch::cuda::is_available();
  return info;
}

MachineInfo configure_runtime(const RuntimeOptions& options) {
  TORCH_CHECK(options.threads >= 0, "thread count must be >= 0 (0 = all cores); got ",
              options.threads);
  // glibc would otherwise unmap large freed chunks and trim the heap top on every free, so
  // each step page-faults its activations in again (5x slower convolutions measured here).
  // Blocks of 1 MiB and more are kept by framefit's own allocator; these cover the rest.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = options.threads > 0 ? options.threads : std::max(1, cores);
  if (at::get_num_threads() != threads) at::set_num_threads(threads);
  return machine_info();
}

}  // namespace framefit
