// Host moves of the layout bridge (shard::padded_row for each local slot, shard::locate for its other home), and
// the CPU pass of its static tables.
#include "relayout/relayout.h"

namespace packcuda::relayout {

std::vector<exchange::Move> moves(const int64_t* cu_padded, int64_t nseg, int64_t cp, int64_t rank, int src_layout,
                                  int dst_layout, int64_t total_local) {
  std::vector<exchange::Move> out;
  out.reserve(2 * total_local);
  auto where = [&](int layout, int64_t g) {
    const int64_t seg = find_segment(cu_padded, nseg, g);
    return shard::locate(layout, cu_padded, cp, total_local, seg, g - cu_padded[seg]);
  };
  auto row = [&](int layout, int64_t s) {
    return shard::padded_row(layout, cu_padded, nseg, cp, total_local, rank, s);
  };
  for (int64_t s = 0; s < total_local; ++s) {  // what fills this rank's dst slots
    const shard::Location src = where(src_layout, row(dst_layout, s));
    out.push_back(exchange::Move{src.rank, src.slot, rank, s});
  }
  for (int64_t s = 0; s < total_local; ++s) {  // where this rank's src rows go (its own dst slots are above)
    const shard::Location dst = where(dst_layout, row(src_layout, s));
    if (dst.rank != rank) out.push_back(exchange::Move{rank, s, dst.rank, dst.slot});
  }
  return out;
}

void static_tables_cpu(const StaticRelayout& r, const exchange::StaticTables& t) { exchange::static_tables_cpu(t, r); }

}  // namespace packcuda::relayout
