#pragma once
// The text of an exception for a message of our own: LibTorch's errors without their C++
// backtrace, and the rest (TorchScript's parser reports a damaged or hand-edited module with a
// plain std::exception) as they are.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace framefit {

inline std::string error_text(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e))
    return error->what_without_backtrace();
  return e.what();
}

}  // namespace framefit
