// The packcuda op namespace. Each capability adds its schemas with STABLE_TORCH_LIBRARY_FRAGMENT in its
// own *_ops.cpp; this file owns the namespace and an anchor symbol that C++ consumers reference so that a
// linker using --as-needed keeps the library (and its static op registrations).
#include "common/torch/checks.h"

#include "packcuda_torch.h"

STABLE_TORCH_LIBRARY(packcuda, m) { m.def("version() -> int"); }

namespace {
int64_t version_impl() { return packcuda::torch_library_version(); }
}  // namespace

STABLE_TORCH_LIBRARY_IMPL(packcuda, CompositeExplicitAutograd, m) { PC_IMPL(m, "version", &version_impl); }

namespace packcuda {
int64_t torch_library_version() { return 100; }  // 0.1.0

namespace th {
void run_boxed(const char* op, void (*boxed)(StableIValue*, uint64_t, uint64_t), StableIValue* stack, uint64_t num_args,
               uint64_t num_outputs) {
  try {
    boxed(stack, num_args, num_outputs);
  } catch (const AllocError& e) {
    throw AllocError(detail::cat("packcuda.", op, ": ", e.what()));
  }
}
}  // namespace th
}  // namespace packcuda
