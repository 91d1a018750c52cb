#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common/cuda_utils.cuh"
#include "shard/shard.h"
#include "shard/shard_math.h"

namespace packcuda::shard {
namespace {

constexpr int kThreads = 256;

// Per local slot: a binary search over this rank's pieces gives its source (index, position, label_index),
// from the packed int32 metadata; plus the widened piece offsets and the int32 copies, over
// max(total_local, npieces, copy sizes) items in one launch.
__global__ void plan_tables_kernel(const PlanTables p, int64_t n_items) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < n_items; s += int64_t(gridDim.x) * blockDim.x) {
    if (s < p.total_local)
      write_slot_tables(p.index, p.position, p.label_index, p.cu, p.nseq, p.pieces, p.piece_offset, p.piece_seq,
                        p.npieces, s);
    if (s < p.npieces) p.piece_offset_wide[s] = p.piece_offset[s];
#pragma unroll
    for (int c = 0; c < PlanTables::kCopies; ++c)
      if (s < p.copy_n[c]) p.copy_dst[c][s] = p.copy_src[c][s];
  }
}

__global__ void unshard_index_kernel(int64_t* __restrict__ out, int64_t total, const int64_t* __restrict__ cu,
                                     int64_t nseq, const int64_t* __restrict__ cu_padded, int64_t cp, int layout,
                                     int64_t total_local) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x)
    out[t] = unshard_slot(layout, cu, nseq, cu_padded, cp, total_local, t);
}

// Static plan layout in one block: a reduction over the sequences (padded total, first bad cu entry), then
// tiles of segments with two block-wide exclusive scans (padded starts, then piece starts). Integer sums in a
// fixed tree: deterministic.
constexpr int kBuildThreads = 512;

struct MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};
struct SatSumOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return static_sum(a, b); }
};

__global__ void __launch_bounds__(kBuildThreads) static_build_kernel(const StaticBuild b) {
  using Reduce = cub::BlockReduce<int64_t, kBuildThreads>;
  using Scan = cub::BlockScan<int64_t, kBuildThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t shared[2];
  constexpr int64_t kNone = INT64_MAX;
  const int64_t n_in = static_num_seqs(b);
  const int64_t n = static_num_seqs_ok(b, n_in) ? n_in : 0;
  int64_t sum = 0, bad = threadIdx.x == 0 && b.cu[0] != 0 ? 0 : kNone;
  for (int64_t i = threadIdx.x; i < n; i += kBuildThreads) {
    const int64_t p = static_checked_length(b, i);
    if (p >= 0) sum = static_sum(sum, p);
    else bad = bad < i + 1 ? bad : i + 1;
  }
  sum = Reduce(tmp.reduce).Reduce(sum, SatSumOp());
  __syncthreads();
  bad = Reduce(tmp.reduce).Reduce(bad, MinOp());
  if (threadIdx.x == 0) shared[0] = sum, shared[1] = bad;
  __syncthreads();
  sum = shared[0];
  bad = shared[1] == kNone ? -1 : shared[1];
  const StaticCheck c = static_check(b, n_in, sum, bad);
  if (threadIdx.x == 0) static_write_head(b, c, bad);
  const int64_t nseg = static_segments(b.max_seqs);
  int64_t carry_rows = 0, carry_pieces = 0;
  for (int64_t base = 0; base < nseg; base += kBuildThreads) {
    const int64_t i = base + threadIdx.x;
    const int64_t len = i < nseg ? static_segment_length(b, c, i) : 0;
    int64_t pb, rows;
    Scan(tmp.scan).ExclusiveSum(len, pb, rows);
    __syncthreads();
    pb += carry_rows;
    const int64_t cnt = i < nseg ? segment_piece_count(b.layout, pb, pb + len, b.rank, b.total_local) : 0;
    int64_t np, pieces;
    Scan(tmp.scan).ExclusiveSum(cnt, np, pieces);
    __syncthreads();
    if (i < nseg) static_write_segment(b, c, i, pb, pb + len, carry_pieces + np);
    carry_rows += rows;
    carry_pieces += pieces;
  }
  for (int64_t k = carry_pieces + threadIdx.x; k < b.npieces; k += kBuildThreads) static_fill_piece(b, k);
}

__global__ void static_unshard_index_kernel(int64_t* __restrict__ out, int64_t capacity, const int32_t* __restrict__ cu,
                                            int64_t max_seqs, const int32_t* __restrict__ cu_padded, int64_t cp,
                                            int layout, int64_t total_local) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < capacity; t += int64_t(gridDim.x) * blockDim.x)
    out[t] = static_unshard_slot(layout, cu, max_seqs, cu_padded, cp, total_local, t);
}

}  // namespace

void plan_tables_cuda(const PlanTables& p, cudaStream_t stream) {
  int64_t n_items = p.total_local > p.npieces ? p.total_local : p.npieces;
  for (int c = 0; c < PlanTables::kCopies; ++c) n_items = p.copy_n[c] > n_items ? p.copy_n[c] : n_items;
  if (n_items == 0) return;
  plan_tables_kernel<<<cuda::grid_for(n_items, kThreads), kThreads, 0, stream>>>(p, n_items);
  PC_CUDA_LAUNCH_CHECK();
}

void unshard_index_cuda(int64_t* out, int64_t total, const int64_t* cu, int64_t nseq, const int64_t* cu_padded,
                        int64_t cp, int layout, int64_t total_local, cudaStream_t stream) {
  if (total == 0) return;
  unshard_index_kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(out, total, cu, nseq, cu_padded, cp,
                                                                                 layout, total_local);
  PC_CUDA_LAUNCH_CHECK();
}

void static_build_cuda(const StaticBuild& b, cudaStream_t stream) {
  static_build_kernel<<<1, kBuildThreads, 0, stream>>>(b);
  PC_CUDA_LAUNCH_CHECK();
}

void static_unshard_index_cuda(int64_t* out, int64_t capacity, const int32_t* cu, int64_t max_seqs,
                               const int32_t* cu_padded, int64_t cp, int layout, int64_t total_local,
                               cudaStream_t stream) {
  if (capacity == 0) return;
  static_unshard_index_kernel<<<cuda::grid_for(capacity, kThreads), kThreads, 0, stream>>>(
      out, capacity, cu, max_seqs, cu_padded, cp, layout, total_local);
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace packcuda::shard
