// Host-side dispatch shared by the CPU and CUDA conv backends: element type and kernel-size templates.
#pragma once
#include <stdexcept>
#include <type_traits>

#include "conv/conv.h"
#include "conv/conv_math.h"

namespace packcuda::conv::detail {

template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::BF16: f(bf16_t{}); break;
    case DType::F16: f(f16_t{}); break;
    default: throw std::invalid_argument("packcuda conv: unsupported dtype");
  }
}

template <typename F>
void dispatch_k(int K, F&& f) {
  if (K <= 2) f(std::integral_constant<int, 2>{});
  else if (K == 3) f(std::integral_constant<int, 3>{});
  else if (K == 4) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, kMaxK>{});
}

inline ConvShape shape_of(const ConvArgs& a) { return ConvShape{a.T, a.C, a.K, a.nseg, a.activation}; }

}  // namespace packcuda::conv::detail
