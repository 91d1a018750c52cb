// Public header of libpackcuda_torch: link packcuda::torch and include this to make sure the registered
// ops are loaded (the inline variable references a symbol of the library, so --as-needed keeps it).
#pragma once
#include <cstdint>

namespace packcuda {
__attribute__((visibility("default"))) int64_t torch_library_version();
namespace detail {
inline const int64_t torch_library_anchor = torch_library_version();
}  // namespace detail
}  // namespace packcuda
