// packcuda core: context-parallel shard plans on raw pointers (no torch). The layout (host part) is built on
// the host from host cu_seqlens in O(number of sequences) (build_layout); the per-slot tables (device part)
// come from one kernel over the local slots (plan_tables). CUDA functions enqueue on `stream` and never
// synchronize.
// See shard_math.h for the vocabulary and the two layouts.
#pragma once
#include <cstdint>
#include <vector>

#include "../common/stream.h"
#include "shard_math.h"

namespace packcuda::shard {

// Host description of one rank's share of a padded packed stream.
struct HostLayout {
  std::vector<int64_t> cu_padded;     // [nseg+1] global padded boundaries (bucket segment included)
  std::vector<int64_t> cu_local;      // [nseg+1] local boundaries of each segment on this rank
  std::vector<int64_t> pieces;        // [S+1]  local boundaries of runs of consecutive padded offsets
  std::vector<int64_t> piece_offset;  // [S]    first padded offset of each piece inside its segment
  std::vector<int64_t> piece_seq;     // [S]    segment of each piece
  int64_t total = 0, total_padded = 0, total_local = 0, pad_size = 0, max_seqlen_padded = 0;
};

// Largest padded total a plan may have (and so the largest cp_size, align and bucket): the plan's boundary
// tensors are int32, as varlen attention kernels expect. Every size of a layout (padded lengths, local
// boundaries, piece offsets, cp * total_local) is at most this once the padded total is.
constexpr int64_t kMaxPaddedTotal = 2147483647;  // 2**31 - 1

// Padded total of a layout (sum of round_up(L_i, align), rounded up to bucket, or to lcm(bucket, cp) for
// the contiguous layout), computed with checked int64 arithmetic. Throws std::invalid_argument
// "packcuda.<op>: ..." when it exceeds kMaxPaddedTotal (or any step overflows). Needs cp, align, bucket in
// [1, kMaxPaddedTotal] and cu non-decreasing from 0.
int64_t checked_padded_total(const char* op, const int64_t* cu, int64_t nseq, int64_t cp, int layout, int64_t align,
                             int64_t bucket);

// Parameters must already be valid (cp >= 1, 0 <= rank < cp, align >= 1, bucket >= 1, zigzag: align % 2cp
// == 0 and bucket % align == 0; cu non-decreasing from 0; checked_padded_total accepts them, so no size
// overflows). bucket == 1 means no bucketing. The contiguous layout pads the stream to a multiple of
// lcm(bucket, cp).
HostLayout build_layout(const int64_t* cu, int64_t nseq, int64_t cp, int64_t rank, int layout, int64_t align,
                        int64_t bucket);

// The per-slot tables of one rank, from its layout (build_layout, or static_build on the device) narrowed to
// int32 (every value of a layout fits int32 once its padded total does): for each local slot s in
// [0, total_local), index[s] (original row or -1), position[s] and label_index[s] (original row of the next
// token or -1); piece_offset widened to int64; and plain int32 copies (copy_n[c] == 0: none), with which the
// torch op hands out the plan's boundary arrays from the same upload. This is the one route to a plan's tables:
// a C++ caller fills the inputs from a HostLayout (see examples/cpp/main.cpp) and calls plan_tables_cpu/_cuda.
struct PlanTables {
  // inputs (sections of the packed metadata)
  const int32_t* cu = nullptr;  // [nseq+1]
  int64_t nseq = 0;
  const int32_t* pieces = nullptr;        // [npieces+1]
  const int32_t* piece_offset = nullptr;  // [npieces]
  const int32_t* piece_seq = nullptr;     // [npieces]
  int64_t npieces = 0;
  int64_t total_local = 0;
  // outputs
  int64_t* index = nullptr;        // [total_local]
  int64_t* position = nullptr;     // [total_local]
  int64_t* label_index = nullptr;  // [total_local]
  int64_t* piece_offset_wide = nullptr;  // [npieces]
  static constexpr int kCopies = 4;
  int32_t* copy_dst[kCopies] = {};
  const int32_t* copy_src[kCopies] = {};
  int64_t copy_n[kCopies] = {};
};
// One pass (one launch on CUDA) over max(total_local, npieces, copy sizes) items.
void plan_tables_cpu(const PlanTables& p);
void plan_tables_cuda(const PlanTables& p, cudaStream_t stream);

// out[t] = row of original token t in the rank-major concatenation of all local buffers [cp*total_local].
void unshard_index_cpu(int64_t* out, int64_t total, const int64_t* cu, int64_t nseq, const int64_t* cu_padded,
                       int64_t cp, int layout, int64_t total_local);
void unshard_index_cuda(int64_t* out, int64_t total, const int64_t* cu, int64_t nseq, const int64_t* cu_padded,
                        int64_t cp, int layout, int64_t total_local, cudaStream_t stream);

// Static plans (shard_math.h, "static plans"): the layout of a StaticBuild from device inputs, with no host
// read (CUDA: one single-block launch, a deterministic scan over the max_seqs + 1 segments). The per-slot
// tables then come from plan_tables_* over its outputs.
void static_build_cpu(const StaticBuild& b);
void static_build_cuda(const StaticBuild& b, cudaStream_t stream);

// out[t] for t < capacity: static_unshard_slot (cu [max_seqs+1], cu_padded [max_seqs+2], int32).
void static_unshard_index_cpu(int64_t* out, int64_t capacity, const int32_t* cu, int64_t max_seqs,
                              const int32_t* cu_padded, int64_t cp, int layout, int64_t total_local);
void static_unshard_index_cuda(int64_t* out, int64_t capacity, const int32_t* cu, int64_t max_seqs,
                               const int32_t* cu_padded, int64_t cp, int layout, int64_t total_local,
                               cudaStream_t stream);

}  // namespace packcuda::shard
