// The moves of the conv-prefix exchange, derived from the shard plan layout (shard::build_layout for every rank,
// shard::locate for each prefix row); the row exchange (exchange::build_schedule) turns them into a schedule.
#include "conv/conv.h"
#include "shard/shard.h"
#include "shard/shard_math.h"

namespace packcuda::conv {

PrefixMoves prefix_moves(const int64_t* cu, int64_t nseq, int64_t cp, int64_t rank, int layout, int64_t align,
                         int64_t bucket, int K) {
  PrefixMoves out;
  const int64_t W = K - 1;  // prefix rows per piece
  for (int64_t q = 0; q < cp; ++q) {
    const shard::HostLayout h = shard::build_layout(cu, nseq, cp, q, layout, align, bucket);
    const int64_t np = static_cast<int64_t>(h.piece_offset.size());
    if (q == rank) {
      out.n_pieces = np;
      out.n_local = h.total_local;
    }
    // Pieces of rank q in order, prefix rows in order (the canonical order of the exchange already).
    for (int64_t k = 0; k < np; ++k) {
      if (h.pieces[k + 1] == h.pieces[k]) continue;  // empty piece: its prefix is never read
      const int64_t seg = h.piece_seq[k], o = h.piece_offset[k];
      for (int64_t j = 0; j < W; ++j) {
        const int64_t oo = o - W + j;
        if (oo < 0) continue;  // before the segment start: a zero row
        const shard::Location loc = shard::locate(layout, h.cu_padded.data(), cp, h.total_local, seg, oo);
        if (q == rank || loc.rank == rank) out.moves.push_back(exchange::Move{loc.rank, loc.slot, q, k * W + j});
      }
    }
  }
  return out;
}

}  // namespace packcuda::conv
