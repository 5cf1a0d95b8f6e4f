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

}  // namespace
}  // namespace framefit
