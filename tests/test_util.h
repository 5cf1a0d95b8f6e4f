#pragma once
// Helpers shared by the test files.
#include <c10/util/Exception.h>

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

}  // namespace framefit::test_util
