// CUDA-side helpers for core kernels (included only from .cu files).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include "common/errors.h"

#define PC_CUDA_CHECK(expr)                                                                   \
  do {                                                                                        \
    cudaError_t _e = (expr);                                                                  \
    if (_e != cudaSuccess)                                                                    \
      throw std::runtime_error(::packcuda::detail::cat("packcuda CUDA error: ",              \
                                                       cudaGetErrorString(_e), " at ", __FILE__, \
                                                       ":", __LINE__));                       \
  } while (0)

#define PC_CUDA_LAUNCH_CHECK() PC_CUDA_CHECK(cudaGetLastError())

namespace packcuda::cuda {

// Blocks for a 1-D grid-stride launch over n items: enough to fill the device a few times over.
inline int grid_for(int64_t n, int threads, int max_blocks_per_sm = 8) {
  static int sms = [] {
    int dev = 0, v = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v;
  }();
  int64_t want = (n + threads - 1) / threads;
  int64_t cap = static_cast<int64_t>(sms) * max_blocks_per_sm;
  if (want > cap) want = cap;
  if (want < 1) want = 1;
  return static_cast<int>(want);
}

}  // namespace packcuda::cuda
