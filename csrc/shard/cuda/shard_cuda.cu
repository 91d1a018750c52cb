#include "common/cuda_utils.cuh"
#include "shard/shard.h"
#include "shard/shard_math.h"

namespace packcuda::shard {
namespace {

constexpr int kThreads = 256;

// One launch over the local slots: a binary search over this rank's pieces gives every slot's source.
__global__ void plan_index_kernel(int64_t* __restrict__ index, int64_t* __restrict__ position,
                                  int64_t* __restrict__ label_index, int64_t total_local,
                                  const int64_t* __restrict__ cu, int64_t nseq, const int64_t* __restrict__ pieces,
                                  const int64_t* __restrict__ piece_offset, const int64_t* __restrict__ piece_seq,
                                  int64_t npieces) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < total_local;
       s += int64_t(gridDim.x) * blockDim.x)
    write_slot_tables(index, position, label_index, cu, nseq, pieces, piece_offset, piece_seq, npieces, s);
}

// The same tables from the packed int32 metadata, plus the widened piece offsets and the int32 copies, over
// max(total_local, npieces, copy sizes) items in one launch.
__global__ void plan_tables_kernel(const PlanTables p, int64_t n_items) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < n_items;
       s += int64_t(gridDim.x) * blockDim.x) {
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

}  // namespace

void plan_index_cuda(int64_t* index, int64_t* position, int64_t* label_index, int64_t total_local,
                     const int64_t* cu, int64_t nseq, const int64_t* pieces, const int64_t* piece_offset,
                     const int64_t* piece_seq, int64_t npieces, cudaStream_t stream) {
  if (total_local == 0) return;
  plan_index_kernel<<<cuda::grid_for(total_local, kThreads), kThreads, 0, stream>>>(
      index, position, label_index, total_local, cu, nseq, pieces, piece_offset, piece_seq, npieces);
  PC_CUDA_LAUNCH_CHECK();
}

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
  unshard_index_kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(out, total, cu, nseq, cu_padded,
                                                                                 cp, layout, total_local);
  PC_CUDA_LAUNCH_CHECK();
}

}  // namespace packcuda::shard
