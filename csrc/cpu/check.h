// Errors the kernels report: a KernelError thrown on the caller's thread (never inside a parallel
// region), which the C ABI (abi.cpp) turns into a status code and a message for Python.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace sluice::cpu {

struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw KernelError(message.str());
}

}  // namespace sluice::cpu

// SK_CHECK(condition, message parts...): the parts are streamed into the error's message.
#define SK_CHECK(condition, ...)                     \
  do {                                               \
    if (!(condition)) ::sluice::cpu::fail(__VA_ARGS__); \
  } while (false)
