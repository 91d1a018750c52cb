// packcuda core: the layout bridge — the move of a CP rank's rows between two shard plan layouts of one padded
// stream (zigzag <-> contiguous), in the words of the row exchange (exchange/exchange.h): which rows go where.
// Host plans give moves (then exchange::build_schedule); static plans give the fixed-size move's tables.
#pragma once
#include <cstdint>
#include <vector>

#include "../common/stream.h"
#include "../exchange/exchange.h"
#include "../exchange/exchange_static.h"
#include "relayout_math.h"

namespace packcuda::relayout {

// The moves that involve `rank` when every padded row goes from where src_layout keeps it to where dst_layout
// keeps it: the rows of this rank's dst buffer (slot s = padded row shard::padded_row(dst_layout, .., rank, s)),
// and the rows of its src buffer that other ranks' dst buffers take. cu_padded [nseg + 1] is the padded stream
// both layouts share (a multiple of 2*cp for zigzag), total_local = cu_padded[nseg] / cp. O(total_local log nseg).
std::vector<exchange::Move> moves(const int64_t* cu_padded, int64_t nseg, int64_t cp, int64_t rank, int src_layout,
                                  int dst_layout, int64_t total_local);

// The static move's tables (StaticRelayout in relayout_math.h) into t (n_send = cp * total_local, n_unpack =
// total_local, n_bwd = total_local). One pass (one launch on CUDA).
void static_tables_cpu(const StaticRelayout& r, const exchange::StaticTables& t);
void static_tables_cuda(const StaticRelayout& r, const exchange::StaticTables& t, cudaStream_t stream);

}  // namespace packcuda::relayout
