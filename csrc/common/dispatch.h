// One dispatch vocabulary for the element type: dispatch_dtype(t, f) calls f with a value of the storage type
// of t (float, double, bf16_t, f16_t of common/dtype.h), so a kernel is written once as a template on it.
#pragma once
#include <stdexcept>

#include "dtype.h"

namespace packcuda {

template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::BF16: f(bf16_t{}); break;
    case DType::F16: f(f16_t{}); break;
    default: throw std::invalid_argument("packcuda: unsupported element type");
  }
}

}  // namespace packcuda
