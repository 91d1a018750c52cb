// packcuda core: packing kernels on raw pointers (no torch). CPU functions run on the calling thread;
// CUDA functions enqueue on `stream` and never synchronize.
#pragma once
#include <cstdint>

#include "../common/stream.h"

namespace packcuda::pack {

// Row gather: out[i, :] = index[i] >= 0 ? src[index[i], :] : fill, for rows of `row_bytes` bytes.
// `fill_elem` holds one element's bytes (elem_size in {1, 2, 4, 8}); index values must be in [-1, n_src).
// Lead dimension: with lead > 1, src holds `lead` blocks of rows, block l starting src_lead_bytes * l bytes
// after src (rows dense inside a block), and out is [lead, n_out, row] contiguous:
// out[l, i, :] = index[i] >= 0 ? src[l][index[i], :] : fill (one launch for all blocks on CUDA).
void gather_rows_cpu(void* out, const void* src, const int64_t* index, int64_t n_out, int64_t row_bytes,
                     uint64_t fill_elem, int elem_size, int64_t lead = 1, int64_t src_lead_bytes = 0);
void gather_rows_cuda(void* out, const void* src, const int64_t* index, int64_t n_out, int64_t row_bytes,
                      uint64_t fill_elem, int elem_size, cudaStream_t stream, int64_t lead = 1,
                      int64_t src_lead_bytes = 0);

// Row scatter into zeros: out = 0 (n_out rows), then out[index[i], :] = src[i, :] for index[i] >= 0.
// Non-negative indices must be unique (then the result is deterministic). Lead dimension as for the gather:
// src block l (n_src rows) starts src_lead_bytes * l bytes after src, out is [lead, n_out, row] contiguous.
void scatter_rows_cpu(void* out, int64_t n_out, const void* src, const int64_t* index, int64_t n_src, int64_t row_bytes,
                      int64_t lead = 1, int64_t src_lead_bytes = 0);
void scatter_rows_cuda(void* out, int64_t n_out, const void* src, const int64_t* index, int64_t n_src,
                       int64_t row_bytes, cudaStream_t stream, int64_t lead = 1, int64_t src_lead_bytes = 0);

// Inverse of a unique index: inv[index[i]] = i for index[i] >= 0, inv = -1 elsewhere (n_inv entries).
void invert_index_cpu(int64_t* inv, int64_t n_inv, const int64_t* index, int64_t n_index);
void invert_index_cuda(int64_t* inv, int64_t n_inv, const int64_t* index, int64_t n_index, cudaStream_t stream);

// Position of every token inside its segment: out[t] = t - cu[seg(t)], t in [0, cu[nseg]).
void segment_positions_cpu(int64_t* out, const int64_t* cu, int64_t nseg, int64_t total);
void segment_positions_cuda(int64_t* out, const int64_t* cu, int64_t nseg, int64_t total, cudaStream_t stream);

// Next-token labels: out[t] = ids[t + 1] if t + 1 is in t's segment, else ignore_index.
// ids/out are int32 (elem_size 4) or int64 (elem_size 8).
void next_token_labels_cpu(void* out, const void* ids, int elem_size, const int64_t* cu, int64_t nseg, int64_t total,
                           int64_t ignore_index);
void next_token_labels_cuda(void* out, const void* ids, int elem_size, const int64_t* cu, int64_t nseg, int64_t total,
                            int64_t ignore_index, cudaStream_t stream);

// Flat positions (b * seqlen + j) of the valid tokens of a right-padded batch with segment lengths cu.
void right_pad_indices_cpu(int64_t* out, const int64_t* cu, int64_t nseg, int64_t seqlen, int64_t total);
void right_pad_indices_cuda(int64_t* out, const int64_t* cu, int64_t nseg, int64_t seqlen, int64_t total,
                            cudaStream_t stream);

// Flat positions of the set entries of a [rows, cols] 0/1 mask (bool/uint8), row-major; cu[r] is the
// number of set entries before row r (exclusive prefix of row counts).
void mask_indices_cpu(int64_t* out, const uint8_t* mask, int64_t rows, int64_t cols, const int64_t* cu);
void mask_indices_cuda(int64_t* out, const uint8_t* mask, int64_t rows, int64_t cols, const int64_t* cu,
                       cudaStream_t stream);

}  // namespace packcuda::pack
