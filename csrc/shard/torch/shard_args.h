// The shard layout's argument checks, for the torch-layer ops that build a layout (shard_plan,
// conv_prefix_schedule, relayout_schedule) or read a static plan's tables: one set of rules for every op that
// takes (cu_seqlens, cp_size, cp_rank, layout, align, bucket) or a static plan.
#pragma once
#include <optional>
#include <vector>

#include "common/torch/checks.h"

namespace packcuda::th {

// Checks cp_size, cp_rank, layout, align and bucket (ranges, the zigzag multiples), cu_seqlens (a 1-D int32/int64
// CPU tensor, first entry 0, non-decreasing) and that the padded stream fits the plan's int32 boundaries (checked
// arithmetic). Returns the host cu_seqlens; throws std::invalid_argument naming `op` and the argument.
std::vector<int64_t> checked_layout_args(const char* op, const Tensor& cu_seqlens, int64_t cp_size, int64_t cp_rank,
                                         int64_t layout, int64_t align, std::optional<int64_t> bucket_opt);

// The device tables of a static plan that users of the plan build from (static_shard_plan's outputs, values
// not read): cp_size, cp_rank, layout, capacity and cu_seqlens_padded (int32 [max_seqs + 2], cpu or cuda);
// returns max_seqs. Then pieces (int32 [S + 1]), piece_offset (int64 [S]) and piece_seq (int32 [S]) with
// S = the plan's piece count for `layout` and max_seqs, on cu_seqlens_padded's device; returns S.
int64_t checked_static_layout(const char* op, const Tensor& cu_seqlens_padded, int64_t cp_size, int64_t cp_rank,
                              int64_t layout, int64_t capacity);
int64_t checked_static_pieces(const char* op, const Tensor& pieces, const Tensor& piece_offset,
                              const Tensor& piece_seq, const Tensor& cu_seqlens_padded, int64_t layout,
                              int64_t max_seqs);

}  // namespace packcuda::th
