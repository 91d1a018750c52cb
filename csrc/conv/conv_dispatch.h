// Host-side dispatch shared by the CPU and CUDA conv backends, in the words of common/dispatch.h: the element
// type and the kernel-size bucket.
#pragma once
#include "../common/dispatch.h"
#include "conv.h"
#include "conv_math.h"

namespace packcuda::conv::detail {

using packcuda::dispatch_bool;  // common/dispatch.h
using packcuda::dispatch_dtype;
using packcuda::dispatch_first;

// The kernel-size bucket: K <= 2, 3, 4, or up to kMaxK.
template <typename F>
void dispatch_k(int K, F&& f) {
  dispatch_first<2, 3, 4, kMaxK>([K](int km) { return K <= km; }, f);
}

inline ConvShape shape_of(const ConvArgs& a) { return ConvShape{a.T, a.C, a.K, a.nseg, a.activation}; }

}  // namespace packcuda::conv::detail
