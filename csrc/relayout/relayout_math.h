// Math of the layout bridge's static tables, shared by the CPU and CUDA kernels: the fixed-size move
// (exchange/exchange_static.h) between the two layouts of one static padded stream, with block B = total_local
// (the most rows one rank can owe another; every rank sends every peer B rows, zero rows where it holds none).
#pragma once
#include <cstdint>

#include "../common/hd.h"
#include "../shard/shard_math.h"

namespace packcuda::relayout {

// Where padded row g (0 <= g < cu_padded[nseg]) lives in `layout`, or false (values not trusted).
template <typename I>
PC_HD bool locate_row(int layout, const I* cu_padded, int64_t nseg, int64_t cp, int64_t total_local, int64_t g,
                      shard::Location* loc) {
  if (g < 0 || g >= static_cast<int64_t>(cu_padded[nseg])) return false;
  const int64_t seg = find_segment(cu_padded, nseg, g);
  return shard::static_locate(layout, cu_padded, cp, total_local, seg, g - static_cast<int64_t>(cu_padded[seg]), loc);
}

// The three tables of rank `rank` for the move from src_layout to dst_layout (both over cu_padded, nseg = max_seqs
// + 1 segments, T_local = total_local rows per rank): send [cp * T_local] (this rank's slot that fills slot s of
// peer p at p*T_local + s), unpack [T_local] (row of the received buffer that fills slot s: its source rank's
// block, position s), bwd [T_local, 1] (row of the gradient buffer sent back that slot s sums: the block of the
// rank that holds it in dst_layout, at its slot there).
struct StaticRelayout {
  const int32_t* cu_padded = nullptr;  // [nseg + 1]
  int64_t nseg = 0, cp = 1, rank = 0, total_local = 0;
  int src_layout = shard::kZigzag, dst_layout = shard::kContiguous;
  PC_HD int64_t operator()(int table, int64_t i) const {
    shard::Location loc{0, 0};
    if (table == 0) {
      const int64_t p = i / total_local, s = i - p * total_local;
      const int64_t g = shard::padded_row(dst_layout, cu_padded, nseg, cp, total_local, p, s);
      return locate_row(src_layout, cu_padded, nseg, cp, total_local, g, &loc) && loc.rank == rank ? loc.slot : -1;
    }
    if (table == 1) {
      const int64_t g = shard::padded_row(dst_layout, cu_padded, nseg, cp, total_local, rank, i);
      return locate_row(src_layout, cu_padded, nseg, cp, total_local, g, &loc) ? loc.rank * total_local + i : -1;
    }
    const int64_t g = shard::padded_row(src_layout, cu_padded, nseg, cp, total_local, rank, i);
    return locate_row(dst_layout, cu_padded, nseg, cp, total_local, g, &loc) ? loc.rank * total_local + loc.slot : -1;
  }
};

}  // namespace packcuda::relayout
