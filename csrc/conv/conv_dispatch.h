// Host-side dispatch shared by the CPU and CUDA conv backends: the element type (common/dispatch.h) and the
// kernel-size templates.
#pragma once
#include <stdexcept>
#include <type_traits>

#include "../common/dispatch.h"
#include "conv.h"
#include "conv_math.h"

namespace packcuda::conv::detail {

using packcuda::dispatch_dtype;  // common/dispatch.h

template <typename F>
void dispatch_k(int K, F&& f) {
  if (K <= 2) f(std::integral_constant<int, 2>{});
  else if (K == 3) f(std::integral_constant<int, 3>{});
  else if (K == 4) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, kMaxK>{});
}

inline ConvShape shape_of(const ConvArgs& a) { return ConvShape{a.T, a.C, a.K, a.nseg, a.activation}; }

}  // namespace packcuda::conv::detail
