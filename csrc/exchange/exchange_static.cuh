// The CUDA pass of exchange_static.h: the three tables of a static move in one launch (included by the .cu files
// of the users of the move).
#pragma once
#include "common/cuda_utils.cuh"
#include "exchange/exchange_static.h"

namespace packcuda::exchange {

template <typename Item>
__global__ void static_tables_kernel(const StaticTables t, const Item item) {
  const int64_t n = t.total();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    static_tables_write(t, item, i);
}

template <typename Item>
void static_tables_cuda(const StaticTables& t, const Item& item, cudaStream_t stream) {
  constexpr int kThreads = 256;
  if (t.total() == 0) return;
  static_tables_kernel<<<cuda::grid_for(t.total(), kThreads), kThreads, 0, stream>>>(t, item);
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace packcuda::exchange
