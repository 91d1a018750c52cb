// CUDA-side helpers for core kernels (included only from .cu files).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include "common/errors.h"

#define PC_CUDA_CHECK(expr)                                                                                           \
  do {                                                                                                                \
    cudaError_t _e = (expr);                                                                                          \
    if (_e != cudaSuccess)                                                                                            \
      throw std::runtime_error(                                                                                       \
          ::packcuda::detail::cat("packcuda CUDA error: ", cudaGetErrorString(_e), " at ", __FILE__, ":", __LINE__)); \
  } while (0)

#define PC_CUDA_LAUNCH_CHECK() PC_CUDA_CHECK(cudaGetLastError())

namespace packcuda::cuda {

// An attribute of the current device (cached per device index); `fallback` without a current device.
template <cudaDeviceAttr Attr> inline int device_attribute(int fallback) {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return fallback;
  if (cache[dev] == 0) {
    int v = fallback;
    cudaDeviceGetAttribute(&v, Attr, dev);
    cache[dev] = v;
  }
  return cache[dev];
}

// Multiprocessors of the current device.
inline int sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(132); }

// Dynamic shared memory one block may opt in to on the current device (227 KB on 9.0, 99 KB on 8.6 and 8.9).
inline int smem_per_block_optin() { return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(0); }

// Blocks for a 1-D grid-stride launch over n items: enough to fill the device a few times over.
inline int grid_for(int64_t n, int threads, int max_blocks_per_sm = 8) {
  int64_t want = (n + threads - 1) / threads;
  int64_t cap = static_cast<int64_t>(sm_count()) * max_blocks_per_sm;
  if (want > cap) want = cap;
  if (want < 1) want = 1;
  return static_cast<int>(want);
}

// Host check of a device pointer's alignment (a null pointer counts as aligned).
inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Asynchronous 16-byte global -> shared copies (cp.async, sm_80+; a plain copy on older devices). Copies
// issued by a thread between two commits form one group; wait<N>() returns once at most N of the thread's
// groups are still in flight. Other threads' copies are visible after a __syncthreads() that follows the wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<int4*>(smem) = *static_cast<const int4*>(gmem);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace packcuda::cuda
