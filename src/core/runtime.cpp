#include "framefit/core/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <malloc.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <set>
#include <sstream>
#include <thread>

namespace framefit {

namespace {
void read_cpuinfo(std::string& model, std::string& flags) {
  static const std::set<std::string> interesting = {
      "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "f16c"};
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

// OpenMP's own convention, so that a caller running several processes side by side (ctest -j,
// a job scheduler) can give each its share of the cores without a flag for every command.
int threads_from_environment(int all_cores) {
  const char* text = std::getenv("OMP_NUM_THREADS");
  if (text == nullptr) return all_cores;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  // "4,2" gives nested levels their own counts; the first is the outer one's.
  const bool number = end != text && (*end == '\0' || *end == ',');
  return number && value > 0 && value <= 4096 ? static_cast<int>(value) : all_cores;
}

// LibTorch sizes only OpenMP's pool. Debian's LibTorch does its matrix products in OpenBLAS,
// whose own pool is sized from the environment or all cores: `--threads 1` still multiplied
// matrices on every core, where another process (ctest -j) computed too. Looked up at run time:
// another BLAS (MKL in CUDA builds, the reference BLAS) has no such call.
void set_blas_threads(int threads) {
  using SetThreads = void (*)(int);
  if (const auto set =
          reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    set(threads);
}

int blas_threads() {
  using GetThreads = int (*)();
  const auto get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : 0;
}
}  // namespace

std::string MachineInfo::describe() const {
  const auto caps = cpu_kernel_caps();
  std::ostringstream out;
  out << "cpu: " << (cpu_model.empty() ? "unknown" : cpu_model) << "; cores: " << cores
      << "; threads: " << threads
      << (blas_threads > 0 ? " (OpenBLAS: " + std::to_string(blas_threads) + ")" : "")
      << "; flags: " << (cpu_flags.empty() ? "-" : cpu_flags)
      << (cpu_bf16.empty() ? "" : "; bf16: " + cpu_bf16)
      << (caps.empty() ? "" : "; kernels capped: " + caps)
      << "; libtorch " << torch_version
      << (cuda_available ? " (cuda available)" : " (cpu)");
  return out.str();
}

bool is_device_name(const std::string& name) {
  if (name == "cpu" || name == "cuda") return true;
  return name.rfind("cuda:", 0) == 0 && name.size() > 5 && name.size() < 9 &&
         name.find_first_not_of("0123456789", 5) == std::string::npos;
}

std::string device_unavailable(const std::string& name) {
  if (name.rfind("cuda", 0) != 0) return "";
  if (!torch::cuda::is_available()) {
#ifdef FRAMEFIT_WITH_CUDA
    return "no CUDA device is visible here";
#else
    return "this framefit was built against a CPU-only LibTorch";
#endif
  }
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  const int64_t index = name.size() > 5 ? std::stoll(name.substr(5)) : 0;
  if (index < count) return "";
  return "there " + std::string(count == 1 ? "is " : "are ") + std::to_string(count) +
         " CUDA device" + (count == 1 ? "" : "s") + " here (cuda:0" +
         (count > 1 ? " to cuda:" + std::to_string(count - 1) : std::string()) + ")";
}

std::string to_string(Bf16Kernels kernels) {
  switch (kernels) {
    case Bf16Kernels::Native: return "native";
    case Bf16Kernels::Emulated: return "emulated";
    case Bf16Kernels::Unavailable: return "unavailable";
  }
  return "?";
}

CpuBf16 classify_cpu_bf16(const std::string& cpu_flags, const std::string& onednn_isa_cap,
                          const std::string& probe_error) {
  if (!probe_error.empty()) {
    return {Bf16Kernels::Unavailable,
            "a bf16 convolution fails on this CPU" +
                (onednn_isa_cap.empty() ? std::string()
                                        : " (oneDNN is capped at " + onednn_isa_cap + ")") +
                ": " + probe_error};
  }
  std::istringstream words(cpu_flags);
  std::string word;
  bool instructions = false;
  while (words >> word) instructions |= word == "avx512_bf16" || word == "amx_bf16";
  if (!instructions)
    return {Bf16Kernels::Emulated, "this CPU has no bf16 instructions (avx512_bf16, amx_bf16)"};
  // oneDNN's ISA names (cpu_isa_traits): those from AVX512_CORE_BF16 up take bf16 instructions.
  std::string cap = onednn_isa_cap;
  for (auto& c : cap) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const bool capped_below = !cap.empty() && cap != "ALL" && cap.find("BF16") == std::string::npos &&
                            cap.find("AMX") == std::string::npos &&
                            cap.find("FP16") == std::string::npos;
  if (capped_below)
    return {Bf16Kernels::Emulated, "oneDNN is capped at " + onednn_isa_cap +
                                       ", below this CPU's bf16 instructions"};
  return {Bf16Kernels::Native, "this CPU's bf16 instructions run oneDNN's bf16 kernels"};
}

namespace {
// The first of `names` set (and not empty) in the environment; "" when none is.
std::string first_variable(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return value;
  }
  return "";
}
std::string onednn_isa_cap() { return first_variable({"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}); }
}  // namespace

std::string cpu_kernel_caps() {
  const auto aten = first_variable({"ATEN_CPU_CAPABILITY"});
  const auto onednn = onednn_isa_cap();
  std::string caps = aten.empty() ? "" : "aten=" + aten;
  if (!onednn.empty()) caps += (caps.empty() ? "onednn=" : " onednn=") + onednn;
  return caps;
}

const CpuBf16& cpu_bf16() {
  static const CpuBf16 answer = [] {
    std::string error;
    try {
      // What autocast hands oneDNN: bf16 input and weight (ATen's use_mkldnn takes every bf16
      // convolution where the CPU has AVX-512, whatever oneDNN was capped at).
      at::NoGradGuard no_grad;
      const auto options = at::TensorOptions().dtype(at::kBFloat16);
      at::conv2d(at::ones({1, 8, 8, 8}, options), at::ones({8, 8, 3, 3}, options));
    } catch (const std::exception& e) {
      error = e.what();
      error = error.substr(0, error.find('\n'));
    }
    std::string flags, model;
    read_cpuinfo(model, flags);
    return classify_cpu_bf16(flags, onednn_isa_cap(), error);
  }();
  return answer;
}

bool autocast_enabled(bool cuda) {
  return !c10::impl::tls_is_dispatch_key_excluded(cuda ? c10::DispatchKey::AutocastCUDA
                                                       : c10::DispatchKey::AutocastCPU);
}

MachineInfo machine_info() {
  MachineInfo info;
  info.cores = static_cast<int>(std::thread::hardware_concurrency());
  info.threads = at::get_num_threads();
  info.blas_threads = blas_threads();
  read_cpuinfo(info.cpu_model, info.cpu_flags);
  info.torch_version = TORCH_VERSION;
  info.cpu_bf16 = to_string(cpu_bf16().kernels);
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
  const int threads =
      options.threads > 0 ? options.threads : threads_from_environment(std::max(1, cores));
  if (at::get_num_threads() != threads) at::set_num_threads(threads);
  set_blas_threads(threads);
  return machine_info();
}

}  // namespace framefit
