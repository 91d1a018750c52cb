// The shard layout's argument checks, for the torch-layer ops that build a layout (shard_plan,
// conv_prefix_schedule, relayout_schedule) or read a static plan's tables: one set of rules for every op that
// takes (cu_seqlens, cp_size, cp_rank, layout, align, bucket) or a static plan.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "common/torch/checks.h"
#include "shard/shard_math.h"

namespace packcuda::th {

// A plan's layout at the op boundary. The ops take its name (schema `str layout`, `str src_layout`, ...), turned
// into this enum once, by parse_layout, before anything else is checked; the core API and the kernels take its
// int code (layout_code: shard::kZigzag / shard::kContiguous).
enum class Layout : int { Zigzag = shard::kZigzag, Contiguous = shard::kContiguous };

// "zigzag" -> Zigzag, "contiguous" -> Contiguous; any other name is refused with std::invalid_argument naming `op`,
// the argument `name` and the value: "packcuda.<op>: <name> must be 'zigzag' or 'contiguous', got '<value>'".
Layout parse_layout(const char* op, const char* name, const std::string& value);
inline int layout_code(Layout layout) { return static_cast<int>(layout); }
inline const char* layout_name(Layout layout) { return layout == Layout::Zigzag ? "zigzag" : "contiguous"; }

// Checks cp_size, cp_rank, align and bucket (ranges, the multiples a zigzag layout needs), cu_seqlens (a 1-D
// int32/int64 CPU tensor, first entry 0, non-decreasing) and that the padded stream fits the plan's int32
// boundaries (checked arithmetic). Returns the host cu_seqlens; throws std::invalid_argument naming `op` and the
// argument.
std::vector<int64_t> checked_layout_args(const char* op, const Tensor& cu_seqlens, int64_t cp_size, int64_t cp_rank,
                                         Layout layout, int64_t align, std::optional<int64_t> bucket_opt);

// The device tables of a static plan that users of the plan build from (static_shard_plan's outputs, values
// not read): cp_size, cp_rank, capacity and cu_seqlens_padded (int32 [max_seqs + 2], cpu or cuda; the same for
// either layout); returns max_seqs. Then pieces (int32 [S + 1]), piece_offset (int64 [S]) and piece_seq (int32
// [S]) with S = the plan's piece count for `layout` and max_seqs, on cu_seqlens_padded's device; returns S.
int64_t checked_static_layout(const char* op, const Tensor& cu_seqlens_padded, int64_t cp_size, int64_t cp_rank,
                              int64_t capacity);
int64_t checked_static_pieces(const char* op, const Tensor& pieces, const Tensor& piece_offset, const Tensor& piece_seq,
                              const Tensor& cu_seqlens_padded, Layout layout, int64_t max_seqs);

}  // namespace packcuda::th
