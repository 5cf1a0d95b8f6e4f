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
  std::string cpu_bf16;  // how bf16 autocast runs here: native | emulated | unavailable
  bool cuda_available = false;
  std::string describe() const;  // one line for logs and benchmark headers
};

// Sets LibTorch's intra-op threads (and OpenBLAS's, to the same count) and keeps glibc from
// returning freed heap memory to the kernel after every step (the trim/mmap thresholds);
// idempotent. Returns what it set.
MachineInfo configure_runtime(const RuntimeOptions& options = {});

MachineInfo machine_info();

// How bf16 autocast's convolutions and matrix products run on this CPU. Decided from what the
// kernels will run, not from /proc/cpuinfo alone: oneDNN capped by ONEDNN_MAX_CPU_ISA (or
// DNNL_MAX_CPU_ISA) below its bf16 ISA emulates bf16 (AVX-512) or has no bf16 convolution at all
// (AVX2), while ATen still hands it bf16 tensors because the CPU has AVX-512.
enum class Bf16Kernels {
  Native,       // the CPU's bf16 instructions (avx512_bf16, amx_bf16) and oneDNN uses them
  Emulated,     // bf16 runs, converted to and from float32 in software: slower than fp32
  Unavailable,  // a bf16 convolution fails here
};
struct CpuBf16 {
  Bf16Kernels kernels = Bf16Kernels::Emulated;
  std::string reason;  // one sentence: why (the flags, the cap, the probe's error)
};
// This machine's answer, probed once (a small bf16 convolution) and kept for the process.
const CpuBf16& cpu_bf16();
// The rule behind cpu_bf16(), on its inputs: the CPU flags (MachineInfo::cpu_flags), oneDNN's
// ISA cap ("" when not set) and the probe's error ("" when the bf16 convolution ran).
CpuBf16 classify_cpu_bf16(const std::string& cpu_flags, const std::string& onednn_isa_cap,
                          const std::string& probe_error);
std::string to_string(Bf16Kernels kernels);

// The caps on the CPU kernels' instruction sets set in the environment (ATEN_CPU_CAPABILITY,
// ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA), as "aten=avx2 onednn=AVX2"; "" when none is set.
// Capped kernels hold other workspaces and run at other speeds: what was measured under one cap
// is not the machine's under another.
std::string cpu_kernel_caps();

// Whether autocast is on for CUDA (`cuda`) or the CPU on this thread: its dispatch key is not
// excluded (the check behind at::autocast::is_enabled/is_cpu_enabled, renamed in LibTorch 2.4).
bool autocast_enabled(bool cuda);

// Whether `name` is a device name framefit takes: cpu, cuda or cuda:N.
bool is_device_name(const std::string& name);
// Why the device `name` cannot be used on this machine ("" when it can): a CUDA device where this
// LibTorch was built without CUDA or sees no GPU, or an index past the devices there are.
std::string device_unavailable(const std::string& name);

}  // namespace framefit
