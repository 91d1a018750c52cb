// CUDA kernels of the causal conv1d and the exchange's gather-sum: one thread per (group of V consecutive
// channels, token tile), running the shared per-tile math of conv_math.h. Each token row is one 16-byte
// access per thread (V = 16 / element size) and consecutive threads take consecutive channel groups, so every
// row is read and written with coalesced vector accesses; each x row is loaded once per tile (the K-1
// previous rows live in registers). Odd C or unaligned tensors fall back to V = 1 (same math).
#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "conv/conv.h"
#include "conv/conv_math.h"
#include "conv/conv_dispatch.h"

namespace packcuda::conv {
namespace {

using detail::dispatch_dtype;
using detail::dispatch_k;
using detail::shape_of;

constexpr int kThreads = 128;


// Channels per thread on the vector path: one 16-byte access per token row (8 bf16/f16, 4 fp32, 2 fp64),
// halved (8-byte accesses) where the per-channel register arrays would otherwise spill (checked with
// -Xptxas -v: the backward keeps four KM-sized arrays per channel; 16-bit types at K > 4 or in the backward).
template <typename S, int KM, bool kBwd>
constexpr int vec_width() {
  constexpr int full = static_cast<int>(16 / sizeof(S));
  const bool halve = (kBwd && KM > 4) || (full == 8 && (kBwd || KM > 4));
  return halve ? full / 2 : full;
}
// Tokens per batch of loads: the vector path already moves 16 bytes per row and load, so the backward (two
// loads per row, many live registers) batches fewer rows.
template <int V, bool kBwd>
constexpr int kBatchRows = V == 1 ? kBatch : 4;

bool aligned(const void* p, int bytes) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Tiles along T: enough that the vector path (8 channels per thread) puts about 2048 threads per SM to work,
// each tile at least 64 tokens tall so that the K-1 warm-up rows stay small and the [tiles, C, K+1] partial
// buffer of the backward stays a few percent of one [T, C] pass. The count depends on (T, C) only, so the
// torch layer can size the partial buffer before the path is chosen; the scalar fallback (8x more threads)
// then has more than enough parallelism.
int64_t want_tiles(int64_t T, int64_t C) {
  static int sms = [] {
    int dev = 0, v = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v;
  }();
  const int64_t row_threads = ceil_div(ceil_div(C, 8), kThreads) * kThreads;
  int64_t want = ceil_div(static_cast<int64_t>(sms) * 2048, row_threads);
  const int64_t max_by_len = ceil_div(T, 64);
  if (want > max_by_len) want = max_by_len;
  if (want > 65535) want = 65535;
  if (want < 1) want = 1;
  return want;
}

// Thread (blockIdx.x * kThreads + threadIdx.x) takes channels [V * that, V * that + V); C % V == 0.
template <typename S, int KM, int V>
__global__ void __launch_bounds__(kThreads) conv_fwd_kernel(const S* __restrict__ x, const S* __restrict__ w,
                                                           const S* __restrict__ b, const S* __restrict__ prefix,
                                                           const int64_t* __restrict__ cu, ConvShape sh, S* y,
                                                           Tiles tl) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= sh.C) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * tl.len;
  const int64_t t1 = t0 + tl.len < sh.T ? t0 + tl.len : sh.T;
  conv_fwd_tile<S, KM, V, kBatchRows<V, false>>(x, w, b, prefix, cu, sh, y, c, t0, t1);
}

template <typename S, int KM, int V>
__global__ void __launch_bounds__(kThreads) conv_bwd_kernel(const S* __restrict__ dy, const S* __restrict__ x,
                                                           const S* __restrict__ w, const S* __restrict__ b,
                                                           const S* __restrict__ prefix,
                                                           const int64_t* __restrict__ cu, ConvShape sh, S* dx,
                                                           S* dprefix, typename Acc<S>::type* part, Tiles tl) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= sh.C) return;
  const int64_t i = blockIdx.y;
  const int64_t t0 = i * tl.len;
  const int64_t t1 = t0 + tl.len < sh.T ? t0 + tl.len : sh.T;
  conv_bwd_tile<S, KM, V, kBatchRows<V, true>>(dy, x, w, b, prefix, cu, sh, dx, dprefix,
                                                 part + (i * sh.C + c) * (sh.K + 1), c, t0, t1);
}

// One thread per element e of [C, K+1]: adjacent threads read adjacent partials of a tile (coalesced).
template <typename S>
__global__ void conv_reduce_kernel(const typename Acc<S>::type* part, int64_t ntiles, ConvShape sh, S* dweight,
                                   S* dbias) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < sh.C * (sh.K + 1)) conv_reduce_elem<S>(part, ntiles, sh, dweight, dbias, e);
}

template <typename S, int V>
__global__ void gather_sum_kernel(S* out, int64_t n_out, const S* a, int64_t na, const S* b,
                                  const int64_t* index, int M, int64_t C) {
  const int64_t cv = C / V;  // V-wide chunks per row
  const int64_t n = n_out * cv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / cv;
    gather_sum_elem<S, V>(out, a, na, b, index, M, C, r, (e - r * cv) * V);
  }
}

}  // namespace

int64_t conv_bwd_tiles_cuda(int64_t T, int64_t C) { return make_tiles(T, want_tiles(T, C)).count; }

void causal_conv1d_fwd_cuda(const ConvArgs& a, void* y, cudaStream_t stream) {
  if (a.T == 0 || a.C == 0) return;
  const ConvShape sh = shape_of(a);
  const Tiles tl = make_tiles(a.T, want_tiles(a.T, a.C));
  dispatch_dtype(a.dtype, [&](auto tag) {
    using S = decltype(tag);
    dispatch_k(a.K, [&](auto km) {
      constexpr int KM = decltype(km)::value;
      constexpr int V = vec_width<S, KM, false>();
      const bool vec = a.C % V == 0 && aligned(a.x, V * sizeof(S)) && aligned(y, V * sizeof(S));
      auto launch = [&](auto vw) {
        constexpr int W = decltype(vw)::value;
        const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(a.C, W), kThreads)),
                        static_cast<unsigned>(tl.count));
        conv_fwd_kernel<S, KM, W><<<grid, kThreads, 0, stream>>>(
            static_cast<const S*>(a.x), static_cast<const S*>(a.weight), static_cast<const S*>(a.bias),
            static_cast<const S*>(a.prefix), a.cu, sh, static_cast<S*>(y), tl);
      };
      if (vec) launch(std::integral_constant<int, V>{});
      else launch(std::integral_constant<int, 1>{});
    });
  });
  PC_CUDA_LAUNCH_CHECK();
}

void causal_conv1d_bwd_cuda(const ConvArgs& a, const void* dy, void* dx, void* dweight, void* dbias,
                            void* dprefix, void* work, int64_t tiles, cudaStream_t stream) {
  const ConvShape sh = shape_of(a);
  const Tiles tl = make_tiles(a.T, tiles);
  if (a.T > 0 && tl.count != tiles) throw std::invalid_argument("packcuda conv: inconsistent tile count");
  if (dprefix && a.nseg * (a.K - 1) * a.C > 0)
    PC_CUDA_CHECK(cudaMemsetAsync(dprefix, 0, a.nseg * (a.K - 1) * a.C * dtype_size(a.dtype), stream));
  if (a.C == 0) return;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using S = decltype(tag);
    using A = typename Acc<S>::type;
    if (a.T > 0) {
      dispatch_k(a.K, [&](auto km) {
        constexpr int KM = decltype(km)::value;
        constexpr int V = vec_width<S, KM, true>();
        const int bytes = V * sizeof(S);
        const bool vec = a.C % V == 0 && aligned(a.x, bytes) && aligned(dy, bytes) && aligned(dx, bytes);
        auto launch = [&](auto vw) {
          constexpr int W = decltype(vw)::value;
          const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(a.C, W), kThreads)),
                          static_cast<unsigned>(tl.count));
          conv_bwd_kernel<S, KM, W><<<grid, kThreads, 0, stream>>>(
              static_cast<const S*>(dy), static_cast<const S*>(a.x), static_cast<const S*>(a.weight),
              static_cast<const S*>(a.bias), static_cast<const S*>(a.prefix), a.cu, sh, static_cast<S*>(dx),
              static_cast<S*>(dprefix), static_cast<A*>(work), tl);
        };
        if (vec) launch(std::integral_constant<int, V>{});
        else launch(std::integral_constant<int, 1>{});
      });
      PC_CUDA_LAUNCH_CHECK();
    }
    conv_reduce_kernel<S><<<static_cast<unsigned>(ceil_div(a.C * (a.K + 1), 256)), 256, 0, stream>>>(
        static_cast<const A*>(work), a.T > 0 ? tl.count : 0, sh, static_cast<S*>(dweight),
        static_cast<S*>(dbias));
    PC_CUDA_LAUNCH_CHECK();
  });
}

void gather_sum_cuda(void* out, int64_t n_out, const void* a, int64_t na, const void* b, const int64_t* index,
                     int M, int64_t C, DType dtype, cudaStream_t stream) {
  if (n_out == 0 || C == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using S = decltype(tag);
    constexpr int V = 16 / sizeof(S);
    const bool vec = C % V == 0 && aligned(out, 16) && aligned(a, 16) && (b == nullptr || aligned(b, 16));
    if (vec)
      gather_sum_kernel<S, V><<<cuda::grid_for(n_out * (C / V), 256), 256, 0, stream>>>(
          static_cast<S*>(out), n_out, static_cast<const S*>(a), na, static_cast<const S*>(b), index, M, C);
    else
      gather_sum_kernel<S, 1><<<cuda::grid_for(n_out * C, 256), 256, 0, stream>>>(
          static_cast<S*>(out), n_out, static_cast<const S*>(a), na, static_cast<const S*>(b), index, M, C);
  });
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace packcuda::conv
