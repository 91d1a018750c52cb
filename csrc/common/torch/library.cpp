// The packcuda op namespace. Each capability adds its schemas with STABLE_TORCH_LIBRARY_FRAGMENT in its
// own *_ops.cpp; this file owns the namespace and an anchor symbol that C++ consumers reference so that a
// linker using --as-needed keeps the library (and its static op registrations).
#include "common/torch/checks.h"

#include "packcuda_torch.h"

STABLE_TORCH_LIBRARY(packcuda, m) {
  m.def("version() -> int");
}

namespace {
int64_t version_impl() { return packcuda::torch_library_version(); }
}  // namespace

STABLE_TORCH_LIBRARY_IMPL(packcuda, CompositeExplicitAutograd, m) {
  m.impl("version", TORCH_BOX(&version_impl));
}

namespace packcuda {
int64_t torch_library_version() { return 100; }  // 0.1.0
}  // namespace packcuda
