#pragma once
// Process set-up that LibTorch leaves to the application: thread count and glibc's malloc
// tuning, and a description of the machine for benchmark output.
#include <string>

namespace framefit {

struct RuntimeOptions {
  int threads = 0;  // 0 = $OMP_NUM_THREADS if set, else all cores
};

struct MachineInfo {
  int cores = 0;
  int threads = 0;        // intra-op threads LibTorch will use
  int blas_threads = 0;   // OpenBLAS's own pool for matrix products (0: another BLAS)
  std::string cpu_model;  // from /proc/cpuinfo
  std::string cpu_flags;  // the ones that matter for LibTorch: avx2, avx512f, avx512_bf16, amx
  std::string torch_version;
  bool cuda_available = false;
  std::string describe() const;  // one line for logs and benchmark headers
};

// Sets LibTorch's intra-op threads (and OpenBLAS's, to the same count) and keeps glibc from
// returning freed heap memory to the kernel after every step (the trim/mmap thresholds);
// idempotent. Returns what it set.
MachineInfo configure_runtime(const RuntimeOptions& options = {});

MachineInfo machine_info();

// Whether autocast is on for CUDA (`cuda`) or the CPU on this thread: its dispatch key is not
// excluded (the check behind at::autocast::is_enabled/is_cpu_enabled, renamed in LibTorch 2.4).
bool autocast_enabled(bool cuda);

// Whether `name` is a device name framefit takes: cpu, cuda or cuda:N.
bool is_device_name(const std::string& name);
// Why the device `name` cannot be used on this machine ("" when it can): a CUDA device where this
// LibTorch was built without CUDA or sees no GPU, or an index past the devices there are.
std::string device_unavailable(const std::string& name);

}  // namespace framefit
