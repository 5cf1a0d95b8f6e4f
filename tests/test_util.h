#pragma once
// Helpers shared by the test files.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/script.h>

#include <fcntl.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>

#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "framefit/core/runtime.h"
#include "framefit/data/demo.h"
#include "framefit/memory/tracker.h"
#include "framefit/models/weights.h"

// Skips a test that runs bf16 convolutions on a CPU where none runs (oneDNN capped at AVX2 on an
// AVX-512 CPU: core/runtime.h, cpu_bf16), saying so; where bf16 runs emulated, it runs.
#define FRAMEFIT_SKIP_UNLESS_CPU_BF16_RUNS()                                                \
  do {                                                                                       \
    if (::framefit::cpu_bf16().kernels == ::framefit::Bf16Kernels::Unavailable)              \
      GTEST_SKIP() << "bf16 does not run on this CPU: " << ::framefit::cpu_bf16().reason;    \
  } while (false)

namespace framefit::test_util {

// Where tests/python/reference.py writes PyTorch's and torchvision's outputs (ctest runs it first).
inline const std::string kReferenceData = FRAMEFIT_TEST_DATA_DIR;

inline bool has_key(const models::StateDict& state, const std::string& name) {
  for (const auto& [key, value] : state) {
    if (key == name) return true;
  }
  return false;
}

// The largest difference relative to the largest magnitude of `expected`.
inline double relative_error(const torch::Tensor& got, const torch::Tensor& expected) {
  return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item<double>();
}

// Files larger than `bytes` cannot be written while alive, as on a full disk (RLIMIT_FSIZE;
// SIGXFSZ ignored, so the write fails with EFBIG instead of killing the process).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved_);
    handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit saved_{};
  void (*handler_)(int) = nullptr;
};

// A training run's folder lock (train.out_dir/.lock) held for the scope's lifetime, as a running
// framefit train of process `pid` holds it.
class HeldRunLock {
 public:
  HeldRunLock(const std::string& out_dir, const std::string& pid) {
    ::mkdir(out_dir.c_str(), 0755);
    fd_ = ::open((out_dir + "/.lock").c_str(), O_RDWR | O_CREAT, 0644);
    const std::string line = pid + "\n";
    held_ = fd_ >= 0 && ::write(fd_, line.data(), line.size()) == ssize_t(line.size()) &&
            ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
  }
  ~HeldRunLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  HeldRunLock(const HeldRunLock&) = delete;
  HeldRunLock& operator=(const HeldRunLock&) = delete;
  bool held() const { return held_; }

 private:
  int fd_ = -1;
  bool held_ = false;
};

// LibTorch's intra-op threads for the scope's lifetime. ctest gives each test one thread
// (OMP_NUM_THREADS=1, tests/CMakeLists.txt); a test of what several threads do asks for them.
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int threads) : saved_(at::get_num_threads()) {
    at::set_num_threads(threads);
  }
  ~IntraOpThreads() { at::set_num_threads(saved_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int saved_;
};

// The message of the c10::Error that `f` throws (without backtrace), or "" if it throws none.
inline std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// The lines of a text file (a reference's parameter names, one per line); none if it is missing.
inline std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream file(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(file, line);) lines.push_back(line);
  return lines;
}

// Removes a directory tree. Not std::filesystem::remove_all: with pip's LibTorch 2.11 (GPU check)
// it crashed, resolving to the copy of std::filesystem that LibTorch exports.
inline void remove_tree(const std::string& path) {
  nftw(
      path.c_str(),
      [](const char* file, const struct stat*, int, struct FTW*) { return std::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// A TorchScript module as torch.jit.save writes it, built in C++ so fast tests need no Python:
// `parameters` registered as trainable, `code` its methods in TorchScript.
inline std::string write_script_module(
    const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& parameters,
    const std::string& code) {
  torch::jit::Module module("TestModule");
  for (const auto& [name, value] : parameters) {
    module.register_parameter(name, value.detach().clone().requires_grad_(), /*is_buffer=*/false);
  }
  module.define(code);
  module.save(path);
  return path;
}

// A small demo data set in `dir` (make-demo's videos: 3 training, 1 validation, 1 test, 32x32,
// `min_frames` to `max_frames` frames, video files only), for tests that train.
inline void make_tiny_demo(const std::string& dir, int64_t min_frames, int64_t max_frames) {
  remove_tree(dir);
  data::DemoOptions o;
  o.train_videos = 3;
  o.val_videos = 1;
  o.test_videos = 1;
  o.min_frames = min_frames;
  o.max_frames = max_frames;
  o.width = 32;
  o.height = 32;
  o.frame_folders = false;
  data::make_demo(dir, o);
}

// A file's bytes, and the reverse.
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace framefit::test_util
