#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "framefit/core/runtime.h"

namespace framefit {
namespace {

// OMP_NUM_THREADS set to `value` (or unset) for the scope; the runtime as ctest configured it
// afterwards.
class ThreadsVariable {
 public:
  explicit ThreadsVariable(const char* value) {
    if (const char* old = std::getenv("OMP_NUM_THREADS")) saved_ = old;
    if (value != nullptr) {
      setenv("OMP_NUM_THREADS", value, 1);
    } else {
      unsetenv("OMP_NUM_THREADS");
    }
  }
  ~ThreadsVariable() {
    if (saved_) {
      setenv("OMP_NUM_THREADS", saved_->c_str(), 1);
    } else {
      unsetenv("OMP_NUM_THREADS");
    }
    configure_runtime();
  }
  ThreadsVariable(const ThreadsVariable&) = delete;
  ThreadsVariable& operator=(const ThreadsVariable&) = delete;

 private:
  std::optional<std::string> saved_;
};

TEST(Runtime, ThreadsComeFromTheOptionThenOmpNumThreadsThenTheCores) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  {
    ThreadsVariable variable("3");
    EXPECT_EQ(configure_runtime().threads, 3);
    EXPECT_EQ(at::get_num_threads(), 3);
    EXPECT_EQ(configure_runtime(RuntimeOptions{2}).threads, 2);  // the flag wins
  }
  {
    ThreadsVariable variable("3,1");  // OpenMP's nested levels: the outer one's count
    EXPECT_EQ(configure_runtime().threads, 3);
  }
  for (const char* unusable : {static_cast<const char*>(nullptr), "", "0", "-2", "2x", "many"}) {
    ThreadsVariable variable(unusable);
    EXPECT_EQ(configure_runtime().threads, std::max(1, cores))
        << "OMP_NUM_THREADS=" << (unusable ? unusable : "(unset)");
  }
}

TEST(Runtime, OpenBlasGetsTheSameThreadCount) {
  // Debian's LibTorch multiplies matrices in OpenBLAS, whose pool LibTorch does not size.
  ThreadsVariable variable(nullptr);
  if (machine_info().blas_threads == 0) GTEST_SKIP() << "the BLAS here is not OpenBLAS";
  for (const int threads : {1, 3}) {
    const auto info = configure_runtime(RuntimeOptions{threads});
    EXPECT_EQ(info.threads, threads);
    EXPECT_EQ(info.blas_threads, threads);
    EXPECT_NE(info.describe().find("threads: " + std::to_string(threads) +
                                   " (OpenBLAS: " + std::to_string(threads) + ")"),
              std::string::npos)
        << info.describe();
  }
}

TEST(Runtime, Bf16IsNativeOnlyWhereTheKernelsUseTheCpusBf16Instructions) {
  const std::string avx2 = "avx2 fma f16c";
  const std::string avx512 = "avx2 fma avx512f avx512_vnni";
  const std::string bf16 = "avx2 fma avx512f avx512_bf16 avx512_vnni";
  const std::string amx = "avx2 avx512f avx512_bf16 amx_bf16 amx_tile";
  EXPECT_EQ(classify_cpu_bf16(avx2, "", "").kernels, Bf16Kernels::Emulated);
  EXPECT_EQ(classify_cpu_bf16(avx512, "", "").kernels, Bf16Kernels::Emulated);
  EXPECT_EQ(classify_cpu_bf16(bf16, "", "").kernels, Bf16Kernels::Native);
  EXPECT_EQ(classify_cpu_bf16(amx, "", "").kernels, Bf16Kernels::Native);
  // oneDNN capped below its bf16 ISA emulates bf16 with AVX-512, whatever the CPU has.
  EXPECT_EQ(classify_cpu_bf16(bf16, "AVX512_CORE_VNNI", "").kernels, Bf16Kernels::Emulated);
  EXPECT_EQ(classify_cpu_bf16(amx, "avx512_core", "").kernels, Bf16Kernels::Emulated);
  for (const char* cap : {"AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL", "avx512_core_fp16"})
    EXPECT_EQ(classify_cpu_bf16(amx, cap, "").kernels, Bf16Kernels::Native) << cap;
  // Capped at AVX2 on an AVX-512 CPU, ATen still hands oneDNN bf16, which has no kernel for it.
  const auto failed = classify_cpu_bf16(bf16, "AVX2", "could not create a primitive descriptor");
  EXPECT_EQ(failed.kernels, Bf16Kernels::Unavailable);
  EXPECT_NE(failed.reason.find("capped at AVX2"), std::string::npos) << failed.reason;
  EXPECT_NE(failed.reason.find("primitive descriptor"), std::string::npos) << failed.reason;
}

TEST(Runtime, Bf16AnswerIsThisMachinesAndInItsDescription) {
  const auto& answer = cpu_bf16();
  EXPECT_FALSE(answer.reason.empty());
  EXPECT_NE(machine_info().describe().find("bf16: " + to_string(answer.kernels)),
            std::string::npos)
      << machine_info().describe();
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap != nullptr && std::string(cap) == "AVX2")
    EXPECT_NE(answer.kernels, Bf16Kernels::Native) << answer.reason;
}

}  // namespace
}  // namespace framefit
