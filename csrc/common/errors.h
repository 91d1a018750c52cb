// Error reporting for the framework-free core: exceptions with a readable message.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace packcuda::detail {
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace packcuda::detail

#define PC_CHECK(cond, ...)                                                         \
  do {                                                                              \
    if (!(cond)) throw std::invalid_argument(::packcuda::detail::cat(__VA_ARGS__)); \
  } while (0)
