#pragma once
// Helpers shared by the test files.
#include <c10/util/Exception.h>

#include <ftw.h>

#include <cstdio>
#include <functional>
#include <string>

namespace framefit::test_util {

// The message of the c10::Error that `f` throws (without backtrace), or "" if it throws none.
inline std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Removes a directory tree. Not std::filesystem::remove_all: with pip's LibTorch 2.11 (GPU check)
// it crashed, resolving to the copy of std::filesystem that LibTorch exports.
inline void remove_tree(const std::string& path) {
  nftw(
      path.c_str(),
      [](const char* file, const struct stat*, int, struct FTW*) { return std::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

}  // namespace framefit::test_util
