// The shard layout's argument checks, for the torch-layer ops that build a layout (shard_plan,
// conv_prefix_schedule): one set of rules for every op that takes (cu_seqlens, cp_size, cp_rank, layout, align,
// bucket).
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

}  // namespace packcuda::th
