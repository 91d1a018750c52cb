#include <cub/block/block_scan.cuh>

#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/vec.h"
#include "pack/pack.h"
#include "pack/pack_math.h"

namespace packcuda::pack {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Each thread moves kUnroll vectors, issuing all loads before the stores (more bytes in flight).
// Gather: out[v] = src[index[row] * vpr + col] (or fill); scatter: out[index[row] * vpr + col] = src[v].
// Lead blocks (grid y): block l reads src + l * src_lead and writes out + l * out_lead (in vectors); the index
// is shared by all blocks.
template <bool kScatter, typename V, typename I>
__global__ void __launch_bounds__(kThreads)
    move_rows_kernel(V* __restrict__ out, const V* __restrict__ src, const int64_t* __restrict__ index, I n_vec, I vpr,
                     V fill, int64_t lead, int64_t out_lead, int64_t src_lead) {
  const I base = static_cast<I>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
  for (int64_t l = blockIdx.y; l < lead; l += gridDim.y) {
    V* __restrict__ o = out + l * out_lead;
    const V* __restrict__ s = src + l * src_lead;
    V vals[kUnroll];
    int64_t dst[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const I v = base + k * kThreads;
      dst[k] = -1;
      if (v < n_vec) {
        const I row = v / vpr;
        const I col = v - row * vpr;
        const int64_t r = __ldg(index + row);
        if (kScatter) {
          if (r >= 0) {
            vals[k] = s[v];
            dst[k] = r * vpr + col;
          }
        } else {
          vals[k] = r >= 0 ? s[r * vpr + col] : fill;
          dst[k] = v;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
      if (dst[k] >= 0) o[dst[k]] = vals[k];
  }
}

// n_rows: rows per lead block that the kernel walks (out rows for a gather, src rows for a scatter);
// out_rows: rows of each output block.
template <bool kScatter, int VW>
void launch_move(void* out, const void* src, const int64_t* index, int64_t n_rows, int64_t row_bytes, const Fill16& f,
                 int64_t lead, int64_t out_rows, int64_t src_lead_bytes, cudaStream_t stream) {
  using V = typename Word<VW>::type;  // rows moved as machine words of VW bytes
  const int64_t vpr = row_bytes / VW;
  const int64_t n_vec = n_rows * vpr;
  if (n_vec == 0 || lead == 0) return;
  V fill;
  memcpy(&fill, &f, sizeof(V));
  const int64_t blocks = (n_vec + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(lead < 65535 ? lead : 65535));
  const int64_t out_lead = out_rows * vpr, src_lead = src_lead_bytes / VW;
  if (n_vec < (int64_t(1) << 31))
    move_rows_kernel<kScatter, V, uint32_t><<<grid, kThreads, 0, stream>>>(
        static_cast<V*>(out), static_cast<const V*>(src), index, static_cast<uint32_t>(n_vec),
        static_cast<uint32_t>(vpr), fill, lead, out_lead, src_lead);
  else
    move_rows_kernel<kScatter, V, int64_t><<<grid, kThreads, 0, stream>>>(
        static_cast<V*>(out), static_cast<const V*>(src), index, n_vec, vpr, fill, lead, out_lead, src_lead);
  PC_CUDA_LAUNCH_CHECK();
}

// Widest vector (16, 8, 4, 2 or 1 bytes) that divides the row, both base pointers and the lead stride.
template <bool kScatter>
void move_rows(void* out, const void* src, const int64_t* index, int64_t n_rows, int64_t row_bytes, const Fill16& f,
               int64_t lead, int64_t out_rows, int64_t src_lead_bytes, cudaStream_t stream) {
  auto fits = [&](int w) {
    return row_bytes % w == 0 && cuda::aligned(out, w) && cuda::aligned(src, w) &&
           (lead <= 1 || src_lead_bytes % w == 0);
  };
  dispatch_first<16, 8, 4, 2, 1>(fits, [&](auto w) {
    launch_move<kScatter, decltype(w)::value>(out, src, index, n_rows, row_bytes, f, lead, out_rows, src_lead_bytes,
                                              stream);
  });
}

__global__ void invert_index_kernel(int64_t* inv, const int64_t* index, int64_t n_index) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_index; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = index[i];
    if (r >= 0) inv[r] = i;
  }
}

__global__ void segment_positions_kernel(int64_t* out, const int64_t* cu, int64_t nseg, int64_t total) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x)
    out[t] = position_in_segment(cu, nseg, t);
}

template <typename T>
__global__ void next_token_labels_kernel(T* out, const T* ids, const int64_t* cu, int64_t nseg, int64_t total,
                                         int64_t ignore_index) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t src = next_token_source(cu, nseg, t);
    out[t] = src >= 0 ? ids[src] : static_cast<T>(ignore_index);
  }
}

__global__ void right_pad_indices_kernel(int64_t* out, const int64_t* cu, int64_t nseg, int64_t seqlen, int64_t total) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x)
    out[t] = right_pad_flat_index(cu, nseg, seqlen, t);
}

// One block per mask row: a block-wide exclusive scan over chunks of the row writes the flat positions.
constexpr int kScanItems = 4;
__global__ void __launch_bounds__(kThreads)
    mask_indices_kernel(int64_t* out, const uint8_t* mask, int64_t cols, const int64_t* cu) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t running;
  const int64_t r = blockIdx.x;
  if (threadIdx.x == 0) running = cu[r];
  __syncthreads();
  const uint8_t* row = mask + r * cols;
  for (int64_t c0 = 0; c0 < cols; c0 += kThreads * kScanItems) {
    int flags[kScanItems];
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      const int64_t c = c0 + threadIdx.x * kScanItems + k;
      flags[k] = (c < cols && row[c]) ? 1 : 0;
    }
    int offs[kScanItems];
    int chunk_total;
    Scan(tmp).ExclusiveSum(flags, offs, chunk_total);
    const int64_t base = running;
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      const int64_t c = c0 + threadIdx.x * kScanItems + k;
      if (flags[k]) out[base + offs[k]] = r * cols + c;
    }
    __syncthreads();
    if (threadIdx.x == 0) running = base + chunk_total;
    __syncthreads();
  }
}

}  // namespace

void gather_rows_cuda(void* out, const void* src, const int64_t* index, int64_t n_out, int64_t row_bytes,
                      uint64_t fill_elem, int elem_size, cudaStream_t stream, int64_t lead, int64_t src_lead_bytes) {
  move_rows<false>(out, src, index, n_out, row_bytes, replicate_fill(fill_elem, elem_size), lead, n_out, src_lead_bytes,
                   stream);
}

void scatter_rows_cuda(void* out, int64_t n_out, const void* src, const int64_t* index, int64_t n_src,
                       int64_t row_bytes, cudaStream_t stream, int64_t lead, int64_t src_lead_bytes) {
  if (n_out > 0 && lead > 0) PC_CUDA_CHECK(cudaMemsetAsync(out, 0, lead * n_out * row_bytes, stream));
  move_rows<true>(out, src, index, n_src, row_bytes, Fill16{0, 0}, lead, n_out, src_lead_bytes, stream);
}

void invert_index_cuda(int64_t* inv, int64_t n_inv, const int64_t* index, int64_t n_index, cudaStream_t stream) {
  if (n_inv > 0) PC_CUDA_CHECK(cudaMemsetAsync(inv, 0xff, n_inv * sizeof(int64_t), stream));  // -1
  if (n_index == 0) return;
  invert_index_kernel<<<cuda::grid_for(n_index, kThreads), kThreads, 0, stream>>>(inv, index, n_index);
  PC_CUDA_LAUNCH_CHECK();
}

void segment_positions_cuda(int64_t* out, const int64_t* cu, int64_t nseg, int64_t total, cudaStream_t stream) {
  if (total == 0) return;
  segment_positions_kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(out, cu, nseg, total);
  PC_CUDA_LAUNCH_CHECK();
}

void next_token_labels_cuda(void* out, const void* ids, int elem_size, const int64_t* cu, int64_t nseg, int64_t total,
                            int64_t ignore_index, cudaStream_t stream) {
  if (total == 0) return;
  const int g = cuda::grid_for(total, kThreads);
  if (elem_size == 4)
    next_token_labels_kernel<<<g, kThreads, 0, stream>>>(static_cast<int32_t*>(out), static_cast<const int32_t*>(ids),
                                                         cu, nseg, total, ignore_index);
  else
    next_token_labels_kernel<<<g, kThreads, 0, stream>>>(static_cast<int64_t*>(out), static_cast<const int64_t*>(ids),
                                                         cu, nseg, total, ignore_index);
  PC_CUDA_LAUNCH_CHECK();
}

void right_pad_indices_cuda(int64_t* out, const int64_t* cu, int64_t nseg, int64_t seqlen, int64_t total,
                            cudaStream_t stream) {
  if (total == 0) return;
  right_pad_indices_kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(out, cu, nseg, seqlen, total);
  PC_CUDA_LAUNCH_CHECK();
}

void mask_indices_cuda(int64_t* out, const uint8_t* mask, int64_t rows, int64_t cols, const int64_t* cu,
                       cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  mask_indices_kernel<<<rows, kThreads, 0, stream>>>(out, mask, cols, cu);
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace packcuda::pack
