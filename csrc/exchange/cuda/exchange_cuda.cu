// CUDA kernels of the exchange's unpack step (gather_sum): one grid-stride pass over the output's V-wide
// chunks (16-byte accesses when the rows and the three buffers allow it) calling the shared math of
// exchange_math.h.
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "exchange/exchange.h"
#include "exchange/exchange_math.h"

namespace packcuda::exchange {
namespace {

constexpr int kThreads = 256;

template <typename S, int V>
__global__ void gather_sum_kernel(S* out, int64_t n_out, const S* a, int64_t na, const S* b, const int64_t* index,
                                  int M, int64_t C) {
  const int64_t cv = C / V;  // V-wide chunks per row
  const int64_t n = n_out * cv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / cv;
    gather_sum_elem<S, V>(out, a, na, b, index, M, C, r, (e - r * cv) * V);
  }
}

template <typename S, int V>
__global__ void gather_copy_kernel(S* out, int64_t n_out, const S* a, int64_t na, const S* b, const int64_t* index,
                                   int64_t C) {
  const int64_t cv = C / V;
  const int64_t n = n_out * cv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / cv;
    gather_copy_elem<S, V>(out, a, na, b, index, C, r, (e - r * cv) * V);
  }
}

// The 16-byte path needs whole 16-byte chunks in every row and 16-byte aligned buffers.
template <typename S> bool vector_ok(const GatherSum& g) {
  return g.C % (16 / static_cast<int64_t>(sizeof(S))) == 0 && cuda::aligned(g.out, 16) && cuda::aligned(g.a, 16) &&
         cuda::aligned(g.b, 16);
}

template <typename S, typename Launch> void with_width(const GatherSum& g, Launch&& launch) {
  constexpr int V = 16 / static_cast<int>(sizeof(S));
  dispatch_bool(vector_ok<S>(g), [&](auto vec) {
    constexpr int W = decltype(vec)::value ? V : 1;
    launch(std::integral_constant<int, W>{}, cuda::grid_for(g.n_out * (g.C / W), kThreads));
  });
}

template <typename S> void launch_copy(const GatherSum& g, cudaStream_t stream) {
  with_width<S>(g, [&](auto w, int blocks) {
    gather_copy_kernel<S, decltype(w)::value><<<blocks, kThreads, 0, stream>>>(
        static_cast<S*>(g.out), g.n_out, static_cast<const S*>(g.a), g.na, static_cast<const S*>(g.b), g.index, g.C);
  });
}

}  // namespace

void gather_sum_cuda(const GatherSum& g, cudaStream_t stream) {
  if (g.n_out == 0 || g.C == 0) return;
  if (g.M == 1) {  // a copy of each row's bits
    switch (g.elem_size) {
      case 1: launch_copy<uint8_t>(g, stream); break;
      case 2: launch_copy<uint16_t>(g, stream); break;
      case 4: launch_copy<uint32_t>(g, stream); break;
      case 8: launch_copy<uint64_t>(g, stream); break;
      default: throw std::invalid_argument("packcuda: gather_sum copies elements of 1, 2, 4 or 8 bytes");
    }
  } else {
    dispatch_dtype(g.dtype, [&](auto tag) {
      using S = decltype(tag);
      with_width<S>(g, [&](auto w, int blocks) {
        gather_sum_kernel<S, decltype(w)::value>
            <<<blocks, kThreads, 0, stream>>>(static_cast<S*>(g.out), g.n_out, static_cast<const S*>(g.a), g.na,
                                              static_cast<const S*>(g.b), g.index, g.M, g.C);
      });
    });
  }
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace packcuda::exchange
