#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>

#include "framefit/core/runtime.h"

namespace {
// A crash on a machine without a debugger (the GPU check) still says where it happened.
void print_backtrace_and_die(int signal) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}
}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGSEGV, print_backtrace_and_die);
  std::signal(SIGABRT, print_backtrace_and_die);
  ::testing::InitGoogleTest(&argc, argv);
  framefit::configure_runtime();
  return RUN_ALL_TESTS();
}
